//! The fast decode-attention kernel (`cpu::attention::fast`) on every instruction-set path:
//! its exponential against f64 `exp`, and each path against the dense f64 reference and against
//! the scalar path, on random non-contiguous block tables with NaN in every unused slot
//! (quire-testkit's generator), odd context lengths on both sides of the key-range splits, GQA
//! groups 1–8, head dims 64/80/128, f16 and f32 caches, sliding windows. A path this CPU cannot
//! run is reported as skipped on stderr (the test still passes: there is nothing to run).

use half::f16;
use quire_backend::cpu::attention::fast::{self, Isa, EXP_MAX_REL_ERR, SPLIT_KEYS};
use quire_backend::cpu::attention::{dense_reference, paged_attention_math, AttnParams, KvElem};
use quire_backend::cpu::CpuMath;
use quire_backend::SeqBatch;
use quire_testkit::metric::{self, RelL2};
use quire_testkit::paged::{CacheElem, PagedBatch, PagedCase};
use rand::{Rng, SeedableRng};

/// Whether `isa` runs here; prints the skip when not.
fn runs(isa: Isa, test: &str) -> bool {
    let ok = isa.available();
    if !ok {
        eprintln!(
            "SKIPPED {test}: the {} path cannot run on this CPU",
            isa.name()
        );
    }
    ok
}

fn pool() -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap()
}

fn exp_error(isa: Isa) -> f64 {
    // Every 2^-12 over [-87, 0], plus the ends and a few special arguments.
    let mut x: Vec<f32> = (0..=87 * 4096).map(|i| -(i as f32) / 4096.0).collect();
    x.extend([-87.3, -87.33, -1e-30, 0.0, -0.0]);
    let mut y = x.clone();
    fast::exp_in_place(isa, &mut y);
    let mut worst = 0f64;
    for (&a, &b) in x.iter().zip(&y) {
        let want = (a as f64).exp();
        let rel = ((b as f64) - want).abs() / want;
        assert!(rel.is_finite(), "exp({a}) = {b}");
        worst = worst.max(rel);
    }
    // Below the normal range the result is 0, and -inf gives 0, not NaN.
    let mut z = [-88.0f32, -1000.0, f32::NEG_INFINITY];
    fast::exp_in_place(isa, &mut z);
    assert_eq!(z, [0.0; 3]);
    worst
}

#[test]
fn fast_exp_error_is_bounded() {
    for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512] {
        if !runs(isa, "fast_exp_error_is_bounded") {
            continue;
        }
        let e = exp_error(isa);
        eprintln!(
            "{}: max relative error of exp over [-87, 0]: {e:.3e}",
            isa.name()
        );
        assert!(e < EXP_MAX_REL_ERR, "{}: {e:e}", isa.name());
    }
}

struct Case {
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    window: Option<usize>,
    /// (cached context, new tokens) per sequence.
    seqs: Vec<(usize, usize)>,
}

impl Case {
    fn params(&self) -> AttnParams {
        AttnParams {
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            block_size: self.block_size,
            scale: 1.0 / (self.head_dim as f32).sqrt(),
            f16_accum: false,
            sliding_window: self.window,
        }
    }
}

/// The batch (K/V of the new tokens already in their slots) and Q.
fn generate<T: CacheElem>(c: &Case, seed: u64) -> (PagedBatch<T>, Vec<f32>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let gen = PagedCase {
        spare_blocks: 5,
        window: c.window,
        new_in_cache: true,
        ..PagedCase::new(c.block_size, c.num_kv_heads * c.head_dim, &c.seqs)
    }
    .generate::<T>(&mut rng);
    let q_row = c.num_heads * c.head_dim;
    let q = (0..gen.positions.len() * q_row)
        .map(|_| rng.random_range(-2.0..2.0))
        .collect();
    (gen, q)
}

fn seq_batches<T>(gen: &PagedBatch<T>) -> Vec<SeqBatch<'_>> {
    gen.seqs
        .iter()
        .map(|s| SeqBatch {
            query_start: s.query_start,
            query_len: s.query_len,
            seq_len: s.seq_len,
            block_table: &s.block_table,
        })
        .collect()
}

/// Relative L2 error of `out` against the dense f64 reference.
fn error_vs_dense<T>(c: &Case, gen: &PagedBatch<T>, q: &[f32], out: &[f32]) -> f64 {
    let p = c.params();
    let q_row = c.num_heads * c.head_dim;
    let mut err = RelL2::default();
    for s in &gen.seqs {
        let rows = s.query_start * q_row..(s.query_start + s.query_len) * q_row;
        let want = dense_reference(&p, &q[rows.clone()], &s.keys, &s.values, s.seq_len);
        err.add(&out[rows], &want);
    }
    err.value()
}

/// Decode contexts on both sides of the split points and of block boundaries.
fn decode_seqs() -> Vec<(usize, usize)> {
    let s = SPLIT_KEYS;
    vec![
        (0, 1),
        (36, 1),
        (s - 1, 1),
        (s, 1),
        (2 * s + 37, 1),
        (700, 1),
        (3 * s - 1, 1),
    ]
}

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    for (num_heads, num_kv_heads) in [(4, 4), (9, 3), (8, 2), (16, 2)] {
        for head_dim in [64, 80, 128] {
            for (block_size, window) in [(16, None), (32, None), (16, Some(300)), (64, Some(7))] {
                v.push(Case {
                    num_heads,
                    num_kv_heads,
                    head_dim,
                    block_size,
                    window,
                    seqs: decode_seqs(),
                });
            }
        }
    }
    v
}

fn run_decode<T: KvElem + CacheElem>(
    isa: Isa,
    c: &Case,
    gen: &PagedBatch<T>,
    q: &[f32],
) -> Vec<f32> {
    run_decode_on(&pool(), isa, c, gen, q)
}

fn run_decode_on<T: KvElem + CacheElem>(
    pool: &rayon::ThreadPool,
    isa: Isa,
    c: &Case,
    gen: &PagedBatch<T>,
    q: &[f32],
) -> Vec<f32> {
    let p = c.params();
    let q_row = c.num_heads * c.head_dim;
    let mut out = vec![f32::NAN; gen.positions.len() * q_row];
    let seqs = seq_batches(gen);
    fast::decode_attention(
        pool,
        isa,
        &p,
        q,
        q_row,
        &seqs,
        &gen.k_cache,
        &gen.v_cache,
        &mut out,
    );
    out
}

fn path_matches_dense_and_scalar(isa: Isa, test: &str) {
    if !runs(isa, test) {
        return;
    }
    let (mut worst_dense, mut worst_scalar) = (0f64, 0f64);
    for (i, c) in cases().iter().enumerate() {
        if !isa.supports(c.head_dim) {
            continue;
        }
        let seed = 1000 + i as u64;
        let tag = format!(
            "{} gqa {}/{} d{} bs{} window {:?}",
            isa.name(),
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.block_size,
            c.window
        );
        // f32 cache: against the dense reference, and against the scalar path.
        let (gen, q) = generate::<f32>(c, seed);
        let out = run_decode(isa, c, &gen, &q);
        let rel = error_vs_dense(c, &gen, &q, &out);
        assert!(rel < metric::ATTENTION_F32, "{tag} f32: rel err {rel:e}");
        worst_dense = worst_dense.max(rel);
        let scalar = run_decode(Isa::Scalar, c, &gen, &q);
        let mut d = RelL2::default();
        d.add(&out, &scalar.iter().map(|&x| x as f64).collect::<Vec<_>>());
        worst_scalar = worst_scalar.max(d.value());
        assert!(
            d.value() < 1e-6,
            "{tag}: {:e} from the scalar path",
            d.value()
        );
        // f16 cache: the reference gets the rounded values the cache holds.
        let (gen, q) = generate::<f16>(c, seed);
        let out = run_decode(isa, c, &gen, &q);
        let rel = error_vs_dense(c, &gen, &q, &out);
        assert!(rel < metric::ATTENTION_F32, "{tag} f16: rel err {rel:e}");
    }
    eprintln!(
        "{}: worst rel err vs dense f64 {worst_dense:.2e}, vs scalar path {worst_scalar:.2e}",
        isa.name()
    );
}

#[test]
fn fast_decode_scalar_matches_dense_reference() {
    path_matches_dense_and_scalar(Isa::Scalar, "fast_decode_scalar_matches_dense_reference");
}

#[test]
fn fast_decode_avx2_matches_dense_reference_and_scalar() {
    path_matches_dense_and_scalar(
        Isa::Avx2,
        "fast_decode_avx2_matches_dense_reference_and_scalar",
    );
}

#[test]
fn fast_decode_avx512_matches_dense_reference_and_scalar() {
    path_matches_dense_and_scalar(
        Isa::Avx512,
        "fast_decode_avx512_matches_dense_reference_and_scalar",
    );
}

#[test]
fn fast_decode_does_not_depend_on_threads() {
    // The key ranges are fixed, so any thread count gives the same bits. The batch's 14 key
    // ranges make a task of every KV head of a range with 1 or 2 threads, and a task per KV head
    // with 16 threads (too few ranges to keep them busy): both cuts must agree too.
    let c = &cases()[5];
    let (gen, q) = generate::<f16>(c, 77);
    let isa = Isa::detect();
    let two = run_decode(isa, c, &gen, &q);
    for threads in [1, 16] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let out = run_decode_on(&pool, isa, c, &gen, &q);
        assert_eq!(
            out.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            two.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "{threads} threads"
        );
    }
}

/// On AVX-512 an f16 cache with rows of 64 or 128 goes through a fused pass (each row converted
/// once into registers for every head of its group); any other cache takes the step by step
/// route. Their operations are the same, so an f32 copy of the cache (f16 to f32 is exact) must
/// give the same bits, for every GQA group the cases have.
#[test]
fn fused_f16_pass_equals_the_step_by_step_path() {
    let test = "fused_f16_pass_equals_the_step_by_step_path";
    if !runs(Isa::Avx512, test) {
        return;
    }
    let mut checked = 0;
    for (i, c) in cases().iter().enumerate() {
        if ![64, 128].contains(&c.head_dim) {
            continue;
        }
        let (gen, q) = generate::<f16>(c, 500 + i as u64);
        let wide = PagedBatch::<f32> {
            num_blocks: gen.num_blocks,
            block_size: gen.block_size,
            kv_row: gen.kv_row,
            seqs: gen.seqs.clone(),
            positions: gen.positions.clone(),
            slot_mapping: gen.slot_mapping.clone(),
            k_new: gen.k_new.clone(),
            v_new: gen.v_new.clone(),
            k_cache: gen.k_cache.iter().map(|x| x.to_f32()).collect(),
            v_cache: gen.v_cache.iter().map(|x| x.to_f32()).collect(),
        };
        let fused = run_decode(Isa::Avx512, c, &gen, &q);
        let steps = run_decode(Isa::Avx512, c, &wide, &q);
        assert!(fused.iter().all(|x| x.is_finite()));
        assert_eq!(
            fused.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            steps.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "gqa {}/{} d{} bs{} window {:?}",
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.block_size,
            c.window
        );
        checked += 1;
    }
    assert!(checked > 0);
}

/// With `CpuMath::Fast` a row's output depends only on its query and its keys: prompt chunks
/// computed in one call equal the same rows computed one per call (as after a prefix-cache hit,
/// which can leave a prompt's last token alone in its step), bit for bit.
#[test]
fn fast_mode_rows_do_not_depend_on_the_chunking() {
    // Short prompts, and prompts deep enough that neighbouring rows share whole key ranges
    // (walked once for all of them) beside ranges of their own, with and without a window.
    let short = vec![(63, 13), (0, 37), (300, 1)];
    let deep = vec![(600, 40), (500, 30), (2 * SPLIT_KEYS - 3, 7)];
    for (window, seqs) in [(None, short), (None, deep.clone()), (Some(300), deep)] {
        rows_do_not_depend_on_the_chunking(Case {
            num_heads: 9,
            num_kv_heads: 3,
            head_dim: 64,
            block_size: 16,
            window,
            seqs,
        });
    }
}

fn rows_do_not_depend_on_the_chunking(c: Case) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(900);
    let (p, kv_row, q_row) = (
        c.params(),
        c.num_kv_heads * c.head_dim,
        c.num_heads * c.head_dim,
    );
    let gen = PagedCase {
        spare_blocks: 7,
        ..PagedCase::new(c.block_size, kv_row, &c.seqs)
    }
    .generate::<f16>(&mut rng);
    let q: Vec<f32> = (0..gen.tokens() * q_row)
        .map(|_| rng.random_range(-2.0..2.0))
        .collect();
    let (mut kc, mut vc) = (gen.k_cache.clone(), gen.v_cache.clone());
    let mut whole = vec![f32::NAN; gen.tokens() * q_row];
    paged_attention_math(
        &pool(),
        CpuMath::Fast,
        &p,
        &q,
        q_row,
        &gen.k_new,
        &gen.v_new,
        kv_row,
        &gen.slot_mapping,
        &seq_batches(&gen),
        &mut kc,
        &mut vc,
        &mut whole,
    );
    let (mut kc, mut vc) = (gen.k_cache.clone(), gen.v_cache.clone());
    let mut rows = vec![f32::NAN; gen.tokens() * q_row];
    for s in &gen.seqs {
        for i in 0..s.query_len {
            let t = s.query_start + i;
            let one = [SeqBatch {
                query_start: 0,
                query_len: 1,
                seq_len: s.seq_len - s.query_len + i + 1,
                block_table: &s.block_table,
            }];
            paged_attention_math(
                &pool(),
                CpuMath::Fast,
                &p,
                &q[t * q_row..(t + 1) * q_row],
                q_row,
                &gen.k_new[t * kv_row..(t + 1) * kv_row],
                &gen.v_new[t * kv_row..(t + 1) * kv_row],
                kv_row,
                &gen.slot_mapping[t..t + 1],
                &one,
                &mut kc,
                &mut vc,
                &mut rows[t * q_row..(t + 1) * q_row],
            );
        }
    }
    assert!(whole.iter().all(|x| x.is_finite()));
    assert_eq!(
        whole.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        rows.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        "a chunk's rows differ from the same rows one at a time (window {:?}, {:?})",
        c.window,
        c.seqs
    );
}

#[test]
fn fast_mode_mixed_batch_matches_dense_reference() {
    // Through the executor's entry point: decodes and prompt chunks by the fast kernel, with the
    // fused KV write, in one batch.
    for (i, window) in [None, Some(40)].into_iter().enumerate() {
        let c = Case {
            num_heads: 9,
            num_kv_heads: 3,
            head_dim: 64,
            block_size: 16,
            window,
            seqs: vec![(0, 37), (300, 1), (1, 1), (63, 13), (0, 1), (600, 1)],
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(500 + i as u64);
        let kv_row = c.num_kv_heads * c.head_dim;
        let q_row = c.num_heads * c.head_dim;
        let gen = PagedCase {
            spare_blocks: 7,
            window,
            ..PagedCase::new(c.block_size, kv_row, &c.seqs)
        }
        .generate::<f32>(&mut rng);
        let q: Vec<f32> = (0..gen.positions.len() * q_row)
            .map(|_| rng.random_range(-2.0..2.0))
            .collect();
        let (mut kc, mut vc) = (gen.k_cache.clone(), gen.v_cache.clone());
        let mut out = vec![f32::NAN; gen.positions.len() * q_row];
        let seqs = seq_batches(&gen);
        paged_attention_math(
            &pool(),
            CpuMath::Fast,
            &c.params(),
            &q,
            q_row,
            &gen.k_new,
            &gen.v_new,
            kv_row,
            &gen.slot_mapping,
            &seqs,
            &mut kc,
            &mut vc,
            &mut out,
        );
        let rel = error_vs_dense(&c, &gen, &q, &out);
        assert!(
            rel < metric::ATTENTION_F32,
            "window {window:?}: rel err {rel:e}"
        );
    }
}

/// The microbenchmark: one decode step of the default model's attention shape (9 query heads, 3
/// KV heads, head dim 64, f16 cache, blocks of 16 in random order) at 8192 cached tokens, on
/// each vector path this CPU runs (the scalar one is some 25× slower), 2 threads; prints the
/// median and best times and the K/V bytes read per second.
/// `cargo test --release -p quire-backend --test cpu_fast_attention -- --ignored --nocapture`
#[test]
#[ignore = "a benchmark: run with --ignored --nocapture"]
fn bench_fast_decode_d8192() {
    let c = Case {
        num_heads: 9,
        num_kv_heads: 3,
        head_dim: 64,
        block_size: 16,
        window: None,
        seqs: vec![(8192, 1)],
    };
    let (gen, q) = generate::<f16>(&c, 9);
    let bytes = 2 * 8193 * c.num_kv_heads * c.head_dim * std::mem::size_of::<f16>();
    let pool = pool();
    for isa in [Isa::Avx2, Isa::Avx512] {
        if !runs(isa, "bench_fast_decode_d8192") {
            continue;
        }
        let p = c.params();
        let q_row = c.num_heads * c.head_dim;
        let seqs = seq_batches(&gen);
        let mut out = vec![0f32; q_row];
        let mut times: Vec<f64> = (0..100)
            .map(|_| {
                let t = std::time::Instant::now();
                fast::decode_attention(
                    &pool,
                    isa,
                    &p,
                    &q,
                    q_row,
                    &seqs,
                    &gen.k_cache,
                    &gen.v_cache,
                    &mut out,
                );
                t.elapsed().as_secs_f64()
            })
            .collect();
        times.sort_by(f64::total_cmp);
        // The best run as well as the median: on a shared machine the best is the one least
        // disturbed by other processes.
        let (best, med) = (times[0], times[times.len() / 2]);
        eprintln!(
            "{:>6}: d8192 decode attention, one layer: median {:.1} µs ({:.2} GB/s of K/V), \
             best {:.1} µs ({:.2} GB/s)",
            isa.name(),
            med * 1e6,
            bytes as f64 / med / 1e9,
            best * 1e6,
            bytes as f64 / best / 1e9
        );
    }
}
