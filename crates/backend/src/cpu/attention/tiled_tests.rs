//! The tiled f16-accumulator kernel against the one-row path, bit for bit: random non-contiguous
//! block tables, block sizes 16 to 128, GQA ratios 1, 3, 4 and 16, head dims 32 to 256, odd
//! lengths, batches mixing decode rows and prompt chunks, every unused cache slot poisoned with NaN.

use super::*;
use quire_core::BlockId;
use quire_testkit::paged::PagedCase;
use rand::{Rng, SeedableRng};

struct Setup {
    p: AttnParams,
    q: Vec<f32>,
    k_cache: Vec<f16>,
    v_cache: Vec<f16>,
    tables: Vec<Vec<BlockId>>,
    /// (query_start, query_len, seq_len)
    seqs: Vec<(usize, usize, usize)>,
    tokens: usize,
}

impl Setup {
    /// `seqs`: (context already cached, new tokens); `q_range`: |Q| bound (larger means sharper
    /// softmaxes, with the running maximum moving in the middle of the keys).
    fn new(
        heads: (usize, usize),
        head_dim: usize,
        block_size: usize,
        seqs: &[(usize, usize)],
        q_range: f32,
        seed: u64,
    ) -> Setup {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (num_heads, num_kv_heads) = heads;
        // The whole context is in the cache (the fused write is not under test here).
        let gen = PagedCase {
            new_in_cache: true,
            ..PagedCase::new(block_size, num_kv_heads * head_dim, seqs)
        }
        .generate::<f16>(&mut rng);
        let tables: Vec<Vec<BlockId>> = gen.seqs.iter().map(|s| s.block_table.clone()).collect();
        let out_seqs: Vec<(usize, usize, usize)> = gen
            .seqs
            .iter()
            .map(|s| (s.query_start, s.query_len, s.seq_len))
            .collect();
        let (k_cache, v_cache, start) = (gen.k_cache, gen.v_cache, gen.positions.len());
        let q = (0..start * num_heads * head_dim)
            .map(|_| rng.random_range(-q_range..q_range))
            .collect();
        Setup {
            p: AttnParams {
                num_heads,
                num_kv_heads,
                head_dim,
                block_size,
                scale: 1.0 / (head_dim as f32).sqrt(),
                f16_accum: true,
                sliding_window: None,
            },
            q,
            k_cache,
            v_cache,
            tables,
            seqs: out_seqs,
            tokens: start,
        }
    }

    fn batch(&self) -> Vec<SeqBatch<'_>> {
        self.seqs
            .iter()
            .zip(&self.tables)
            .map(|(&(query_start, query_len, seq_len), t)| SeqBatch {
                query_start,
                query_len,
                seq_len,
                block_table: t,
            })
            .collect()
    }

    /// (one-row output, tiled output)
    fn run(&self, threads: usize) -> (Vec<f32>, Vec<f32>) {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let q_row = self.p.num_heads * self.p.head_dim;
        let seqs = self.batch();
        let mut want = vec![f32::NAN; self.tokens * q_row];
        let mut got = want.clone();
        let (k, v) = (&self.k_cache[..], &self.v_cache[..]);
        attend_one_row(
            &pool,
            &self.p,
            &self.q,
            q_row,
            self.tokens,
            &seqs,
            k,
            v,
            &mut want,
        );
        attend_tiled(&pool, &self.p, &self.q, q_row, &seqs, k, v, &mut got);
        (want, got)
    }
}

fn assert_same_bits(want: &[f32], got: &[f32], what: &str) {
    assert_eq!(want.len(), got.len());
    for (i, (w, g)) in want.iter().zip(got).enumerate() {
        assert!(w.is_finite(), "{what}: one-row output {i} not finite");
        assert_eq!(w.to_bits(), g.to_bits(), "{what}: output {i}: {w} vs {g}");
    }
}

quire_testkit::simd_test! {
    fn tiled_f16_accumulator_is_bit_identical_to_the_one_row_path() {
        assert!(tiled::supports(64));
        let mut seed = 100;
        for heads in [(4, 4), (9, 3), (8, 2), (16, 1)] {
            for head_dim in [32, 64, 128, 256] {
                for block_size in [16, 32, 64, 128] {
                    if head_dim == 256 && block_size != 32 {
                        continue; // keep the test short; 256 is covered once
                    }
                    seed += 1;
                    // A fresh odd prompt, decodes at odd depths, chunks after cached prefixes, a
                    // prompt longer than a few key chunks.
                    let seqs = [
                        (0, 37),
                        (100, 1),
                        (1, 1),
                        (63, 13),
                        (0, 1),
                        (129, 1),
                        (20, 75),
                    ];
                    let q_range = if seed % 2 == 0 { 2.0 } else { 12.0 };
                    let s = Setup::new(heads, head_dim, block_size, &seqs, q_range, seed);
                    let (want, got) = s.run(2);
                    let what = format!("gqa {heads:?} d{head_dim} bs{block_size}");
                    assert_same_bits(&want, &got, &what);
                }
            }
        }
    }
}

quire_testkit::simd_test! {
    fn tiled_single_decodes_and_long_prompts_are_bit_identical() {
        assert!(tiled::supports(64));
        // One decode (tiles split per head), a lone long prompt, two decodes, on 1 to 3 threads.
        let cases: [&[(usize, usize)]; 4] = [&[(511, 1)], &[(0, 300)], &[(40, 1), (7, 1)], &[(0, 1)]];
        for (i, seqs) in cases.iter().enumerate() {
            for threads in [1, 2, 3] {
                let s = Setup::new((9, 3), 64, 16, seqs, 6.0, 7 + i as u64);
                let (want, got) = s.run(threads);
                assert_same_bits(&want, &got, &format!("case {i}, {threads} threads"));
            }
        }
    }
}

quire_testkit::simd_test! {
    fn chunked_prompt_equals_whole_prompt() {
        assert!(tiled::supports(64));
        // The same 90-token prompt whole, then as chunks of 41 + 49 (the second with 41 cached
        // tokens): every output row is the same.
        let whole = Setup::new((9, 3), 64, 16, &[(0, 90)], 6.0, 5);
        let (_, all) = whole.run(2);
        let q_row = 9 * 64;
        let mut second = Setup::new((9, 3), 64, 16, &[(41, 49)], 6.0, 5);
        second.k_cache = whole.k_cache.clone();
        second.v_cache = whole.v_cache.clone();
        second.tables = whole.tables.clone();
        second.q = whole.q[41 * q_row..].to_vec();
        let (_, tail) = second.run(2);
        assert_same_bits(&all[41 * q_row..], &tail, "second chunk");
    }
}
