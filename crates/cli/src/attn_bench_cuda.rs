//! `quire attn-bench --backend cuda`: the CUDA paged attention kernel on its own, with the same
//! random scattered-block batches as the CPU path and the attention tests (quire-testkit's
//! generator: shuffled block ids, unused slots NaN), parity
//! against the dense f64 reference, and every dispatch timed with CUDA events. "dense" is the same
//! kernel over each sequence's blocks laid out contiguously, so paged / dense is the cost of paging.
//! The launch is planned as the engine plans it: decode mode (query_len 1) times `paged_decode`,
//! prefill mode `paged_prefill` (chunks of 16+ rows; shorter ones `paged_attention`, with the
//! engine's splits for this batch and context).

use anyhow::{bail, Context, Result};
use half::f16;
use quire_backend::cpu::attention::{dense_reference, AttnParams};
use quire_backend::cuda::attention::{HostRun, PagedAttention};
use quire_backend::cuda::gpu::{EventFlags, Gpu};
use quire_backend::ForwardBatch;
use quire_perf::{RunStamp, Summary, Table};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

use crate::attn_bench::{bench_batch, dispatch_csv, seq_batches, AttnBenchArgs};

pub fn run(a: &AttnBenchArgs) -> Result<()> {
    if !matches!(
        a.dtype.to_ascii_lowercase().as_str(),
        "float16" | "f16" | "half"
    ) {
        bail!("--backend cuda: the GPU KV cache is f16; use --dtype float16");
    }
    if a.batch == 0 || a.repeats == 0 || a.active_blocks == 0 || a.active_blocks > a.max_blocks {
        bail!(
            "--batch and --repeats must be at least 1, --active-blocks between 1 and --max-blocks"
        );
    }
    if !matches!(a.block_size, 16 | 32 | 64 | 128) {
        bail!("--block-size must be 16, 32, 64 or 128");
    }
    let stamp = RunStamp::collect();
    let g = Gpu::new(0)?;
    let attn = PagedAttention::new(&g, a.q_heads, a.kv_heads, a.head_dim)?;
    let mut rng = StdRng::seed_from_u64(a.seed);
    let (b, d, bs) = (a.batch, a.head_dim, a.block_size);
    let kv_row = a.kv_heads * d;
    let q_row = a.q_heads * d;
    let seq_len = a.active_blocks * bs;
    let qlen = if a.mode == "prefill" {
        a.query_len.clamp(1, seq_len)
    } else {
        1
    };
    let tokens = b * qlen;
    let stride = q_row + 2 * kv_row;
    let paged_batch = bench_batch::<f16>(a, qlen, &mut rng);
    let dense_batch = paged_batch.contiguous();
    // One row per new token: Q, then its K and V (the layout the engine's QKV projection writes).
    let mut qkv = vec![0f32; tokens * stride];
    for (t, row) in qkv.chunks_exact_mut(stride).enumerate() {
        for x in &mut row[..q_row] {
            *x = rng.random_range(-2.0..2.0);
        }
        row[q_row..q_row + kv_row].copy_from_slice(&paged_batch.k_new[t * kv_row..][..kv_row]);
        row[q_row + kv_row..].copy_from_slice(&paged_batch.v_new[t * kv_row..][..kv_row]);
    }
    let p = AttnParams {
        num_heads: a.q_heads,
        num_kv_heads: a.kv_heads,
        head_dim: d,
        block_size: bs,
        scale: 1.0 / (d as f32).sqrt(),
        f16_accum: false,
        sliding_window: None,
    };
    let reference: Vec<f64> = (0..b)
        .into_par_iter()
        .flat_map_iter(|i| {
            let q: Vec<f32> = (0..qlen)
                .flat_map(|t| qkv[(i * qlen + t) * stride..][..q_row].to_vec())
                .collect();
            let s = &paged_batch.seqs[i];
            dense_reference(&p, &q, &s.keys, &s.values, seq_len)
        })
        .collect();

    let elem = 2usize;
    let kv_bytes = (b * seq_len * 2 * kv_row * elem) as u64;
    let bytes = kv_bytes + (tokens * (q_row * 4 + q_row * 2 + 2 * kv_row * (4 + elem))) as u64;
    let pairs: usize = (0..qlen).map(|i| seq_len - qlen + i + 1).sum::<usize>() * b;
    let flops = (4 * pairs * q_row) as u64;
    let mut times: Vec<(&str, Vec<f64>)> = vec![];
    let mut parity = vec![];
    let mut plan = None;
    let toks = vec![0u32; tokens];
    for (name, gen) in [("paged", &paged_batch), ("dense", &dense_batch)] {
        let seqs = seq_batches(&gen.seqs);
        let batch = ForwardBatch {
            token_ids: &toks,
            positions: &gen.positions,
            slot_mapping: &gen.slot_mapping,
            seqs: &seqs,
            logits_indices: &[],
        };
        let run = HostRun::new(
            &g,
            &attn,
            &qkv,
            stride,
            &batch,
            bs,
            &gen.k_cache,
            &gen.v_cache,
        )?;
        plan = Some((run.plan, run.layout.num_tiles));
        run.launch(&g, &attn)?;
        let (out, _, _) = run.read(&g)?;
        let (mut num, mut den, mut bad) = (0f64, 0f64, 0usize);
        for (&o, &r) in out.iter().zip(&reference) {
            if !o.is_finite() {
                bad += 1;
            }
            num += (o as f64 - r).powi(2);
            den += r * r;
        }
        let rel = (num / den).sqrt();
        let ok = bad == 0 && rel < 2e-3;
        println!(
            "parity {name} vs dense f64 reference (f16 KV, {} outputs): relative error {rel:.3e}, non-finite {bad} — {}",
            out.len(),
            if ok { "OK" } else { "FAILED" }
        );
        parity.push((name, rel, ok));
        // Timing: events around each dispatch.
        let ev = |g: &Gpu| {
            g.ctx
                .new_event(Some(EventFlags::CU_EVENT_DEFAULT))
                .context("cuEventCreate")
        };
        let mut marks = Vec::with_capacity(a.repeats);
        for _ in 0..a.repeats {
            let (e0, e1) = (ev(&g)?, ev(&g)?);
            e0.record(&g.stream).context("cuEventRecord")?;
            run.launch(&g, &attn)?;
            e1.record(&g.stream).context("cuEventRecord")?;
            marks.push((e0, e1));
        }
        g.sync()?;
        let ms: Vec<f64> = marks
            .iter()
            .map(|(e0, e1)| e0.elapsed_ms(e1).map(|x| x as f64))
            .collect::<Result<_, _>>()
            .context("cuEventElapsedTime")?;
        times.push((name, ms));
    }
    if parity.iter().any(|x| !x.2) {
        bail!("attention output differs from the reference (NaN means a poisoned slot was read)");
    }
    let (plan, tiles) = plan.expect("two runs");
    let kernel = kernel_name(plan.decode, tiles);
    let ctas = if tiles > 0 {
        tiles * a.kv_heads
    } else {
        tokens * a.kv_heads * plan.splits
    };
    if let Some(path) = &a.csv {
        let text = dispatch_csv(
            &[
                ("tokens", tokens.to_string()),
                ("seq_len", seq_len.to_string()),
                ("heads", a.q_heads.to_string()),
                ("kv_heads", a.kv_heads.to_string()),
                ("head_dim", d.to_string()),
                ("block_size", bs.to_string()),
                ("splits", plan.splits.to_string()),
                ("kernel", kernel.to_string()),
            ],
            &times,
            bytes,
            flops,
        );
        std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
        let meta = path.with_extension("meta.json");
        let info = serde_json::json!({
            "stamp": stamp, "device": g.name,
            "settings": {"batch": b, "q_heads": a.q_heads, "kv_heads": a.kv_heads, "head_dim": d, "block_size": bs,
                "max_blocks": a.max_blocks, "active_blocks": a.active_blocks, "repeats": a.repeats, "dtype": "float16",
                "mode": a.mode, "query_len": qlen, "seed": a.seed, "backend": "cuda", "splits": plan.splits,
                "kernel": kernel},
            "parity": parity.iter().map(|(n, rel, _)| serde_json::json!({"kernel": n, "rel_err": rel})).collect::<Vec<_>>(),
        });
        std::fs::write(&meta, serde_json::to_string_pretty(&info)? + "\n")
            .with_context(|| format!("cannot write {}", meta.display()))?;
    }
    println!(
        "\n{} mode on {}: {b} seqs × {qlen} new tokens, context {seq_len} ({} blocks of {bs}), {} q / {} kv heads × {d}, f16 KV, \
         {} key splits per row ({}, {} CTAs; paged_decode fits {} per SM), {} dispatches per kernel",
        a.mode,
        g.name,
        a.active_blocks,
        a.q_heads,
        a.kv_heads,
        plan.splits,
        kernel,
        ctas,
        attn.decode_ctas_per_sm(),
        a.repeats
    );
    println!(
        "per dispatch: {:.2} MiB moved ({:.2} MiB of KV), {:.3} GFLOP\n",
        bytes as f64 / (1 << 20) as f64,
        kv_bytes as f64 / (1 << 20) as f64,
        flops as f64 / 1e9
    );
    let cols = [
        "kernel",
        "median µs",
        "p10 µs",
        "p90 µs",
        "first µs",
        "TB/s",
        "TFLOP/s",
    ];
    let mut t = Table::new(&cols, &cols[1..]);
    let mut med = vec![];
    for (name, ms) in &times {
        let s = Summary::of(if ms.len() > 3 { &ms[3..] } else { ms });
        med.push(s.median);
        t.push(vec![
            name.to_string(),
            format!("{:.1}", s.median * 1e3),
            format!("{:.1}", s.p10 * 1e3),
            format!("{:.1}", s.p90 * 1e3),
            format!("{:.1}", ms[0] * 1e3),
            format!("{:.3}", bytes as f64 / (s.median * 1e9)),
            format!("{:.2}", flops as f64 / (s.median * 1e9)),
        ]);
    }
    print!("{}", t.markdown());
    println!(
        "\nmedians over dispatches 4..{}; paged / dense: {:.3}×",
        a.repeats,
        med[0] / med[1]
    );
    println!("{}", stamp.line());
    Ok(())
}

fn kernel_name(decode: bool, prefill_tiles: usize) -> &'static str {
    if decode {
        "paged_decode"
    } else if prefill_tiles > 0 {
        "paged_prefill"
    } else {
        "paged_attention"
    }
}
