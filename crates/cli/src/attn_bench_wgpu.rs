//! `quire attn-bench --backend wgpu`: the wgpu paged attention kernels on their own, with the
//! same random scattered-block batches as the CPU and CUDA paths (quire-testkit's generator:
//! shuffled block ids, unused slots NaN), parity against the dense f64 reference, and every
//! sample timed by GPU timestamps around 10 back-to-back runs in one pass (wall clock where the
//! adapter has none, said in the output; the median of a timestamp pair around each single run
//! is printed beside it, since that pair costs microseconds of its own on some drivers).
//! Decode mode runs the decode kernel (split over key ranges, merged by the last workgroup, one
//! dispatch as the engine runs it), prefill mode the prompt kernel (a causal chunk of --query-len
//! tokens per sequence; TFLOP/s counts the causal work, 4 · keys · q_heads · head_dim per
//! token). "dense" is the same kernels over each sequence's blocks laid out contiguously.
//! The 8B prompt shape: `quire attn-bench --backend wgpu --mode prefill --query-len 512
//! --batch 1 --q-heads 32 --kv-heads 8 --head-dim 128 --block-size 32 --max-blocks 16
//! --active-blocks 16`.

use anyhow::{bail, Context, Result};
use half::f16;
use quire_backend::cpu::attention::{dense_reference, AttnParams};
use quire_backend::wgpu::kernels::HeadShape;
use quire_backend::wgpu::probe::{AttnInput, Probe};
use quire_perf::{RunStamp, Summary, Table};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

use crate::attn_bench::{bench_batch, dispatch_csv, AttnBenchArgs};

/// Runs of the kernels timed together per sample: a pair of timestamps around each run would
/// time the timestamps too (on NVIDIA's Vulkan driver each pair adds microseconds), so runs go
/// back to back in one pass, as a step runs them, and a sample is their mean.
const BACK_TO_BACK: usize = 10;

pub fn run(a: &AttnBenchArgs) -> Result<()> {
    if !matches!(
        a.dtype.to_ascii_lowercase().as_str(),
        "float16" | "f16" | "half"
    ) {
        bail!("--backend wgpu: the wgpu KV cache is f16; use --dtype float16");
    }
    if a.batch == 0 || a.repeats == 0 || a.active_blocks == 0 || a.active_blocks > a.max_blocks {
        bail!(
            "--batch and --repeats must be at least 1, --active-blocks between 1 and --max-blocks"
        );
    }
    if !matches!(a.block_size, 16 | 32 | 64 | 128) {
        bail!("--block-size must be 16, 32, 64 or 128");
    }
    let shape = HeadShape {
        q_heads: a.q_heads,
        kv_heads: a.kv_heads,
        head_dim: a.head_dim,
    };
    if a.kv_heads == 0 || !a.q_heads.is_multiple_of(a.kv_heads) {
        bail!("--q-heads must be a multiple of --kv-heads");
    }
    shape.check()?;
    let stamp = RunStamp::collect();
    let mut probe = Probe::new(a.adapter.as_deref())?;
    let mut rng = StdRng::seed_from_u64(a.seed);
    let (b, d, bs) = (a.batch, a.head_dim, a.block_size);
    let (kv_row, q_row) = (shape.kv_size(), shape.q_size());
    let seq_len = a.active_blocks * bs;
    let qlen = if a.mode == "prefill" {
        a.query_len.clamp(1, seq_len)
    } else {
        1
    };
    let tokens = b * qlen;
    let stride = shape.stride();
    let paged = bench_batch::<f16>(a, qlen, &mut rng);
    let dense = paged.contiguous();
    let mut qkv = vec![0f32; tokens * stride];
    for (t, row) in qkv.chunks_exact_mut(stride).enumerate() {
        for x in &mut row[..q_row] {
            *x = rng.random_range(-2.0..2.0);
        }
        row[q_row..q_row + kv_row].copy_from_slice(&paged.k_new[t * kv_row..][..kv_row]);
        row[q_row + kv_row..].copy_from_slice(&paged.v_new[t * kv_row..][..kv_row]);
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
            let s = &paged.seqs[i];
            dense_reference(&p, &q, &s.keys, &s.values, seq_len)
        })
        .collect();
    let mut times: Vec<(&str, Vec<f64>)> = vec![];
    let mut parity = vec![];
    let (mut bytes, mut flops, mut kernel, mut splits, mut gpu_timed) =
        (0, 0, String::new(), 1, false);
    let mut bracketed = 0.0;
    for (name, gen) in [("paged", &paged), ("dense", &dense)] {
        let mut tables = Vec::new();
        let mut toks = Vec::new();
        for s in &gen.seqs {
            let off = tables.len() as u32;
            tables.extend(s.block_table.iter().map(|x| x.0));
            for i in 0..s.query_len {
                let t = s.query_start + i;
                toks.push([
                    gen.positions[t],
                    gen.slot_mapping[t],
                    (s.seq_len - s.query_len) as u32,
                    s.query_start as u32,
                    off,
                ]);
            }
        }
        let input = AttnInput {
            shape,
            block_size: bs,
            window: 0,
            qkv: &qkv,
            k_cache: &gen.k_cache,
            v_cache: &gen.v_cache,
            tokens: &toks,
            tables: &tables,
            plan: None,
            keys: None,
        };
        let run = probe.attention_run(&input)?;
        let (ns, gpu) = probe.time_back_to_back(&run.list, BACK_TO_BACK, a.repeats)?;
        if name == "paged" && gpu {
            let (stamped, _) = probe.time(&run.list, 20)?;
            bracketed = Summary::of(&stamped[3..]).median / 1e3;
        }
        let out = probe.attention_read(&run)?.out;
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
        bytes = run.bytes;
        flops = run.flops;
        kernel = run
            .list
            .iter()
            .map(|d| d.name)
            .collect::<Vec<_>>()
            .join("+");
        splits = run.plan.map_or(1, |p| p.splits);
        if run.plan.is_some() {
            kernel += &format!(" [{}]", probe.k.attn_split.kernel(&shape).describe());
        } else {
            kernel += &format!(" [{}]", probe.k.attention.describe(&shape));
        }
        gpu_timed = gpu;
        times.push((name, ns.iter().map(|t| t / 1e6).collect()));
    }
    if parity.iter().any(|x| !x.2) {
        bail!("attention output differs from the reference (NaN means a poisoned slot was read)");
    }
    let info = &probe.gpu.info;
    let clock = if gpu_timed {
        format!("GPU timestamps around {BACK_TO_BACK} back-to-back runs in one pass")
    } else {
        format!("wall clock around {BACK_TO_BACK} back-to-back runs (no timestamp queries on this adapter)")
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
                ("splits", splits.to_string()),
                ("kernel", kernel.clone()),
            ],
            &times,
            bytes,
            flops,
        );
        std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
        let meta = path.with_extension("meta.json");
        let m = serde_json::json!({
            "stamp": stamp, "device": info.name, "adapter": {"backend": info.backend, "driver": info.driver,
                "features": info.features}, "timing": clock,
            "settings": {"batch": b, "q_heads": a.q_heads, "kv_heads": a.kv_heads, "head_dim": d, "block_size": bs,
                "max_blocks": a.max_blocks, "active_blocks": a.active_blocks, "repeats": a.repeats, "dtype": "float16",
                "mode": a.mode, "query_len": qlen, "seed": a.seed, "backend": "wgpu", "splits": splits, "kernel": kernel},
            "parity": parity.iter().map(|(n, rel, _)| serde_json::json!({"kernel": n, "rel_err": rel})).collect::<Vec<_>>(),
        });
        std::fs::write(&meta, serde_json::to_string_pretty(&m)? + "\n")
            .with_context(|| format!("cannot write {}", meta.display()))?;
    }
    println!(
        "\n{} mode on {} ({} {}): {b} seqs × {qlen} new tokens, context {seq_len} ({} blocks of {bs}), {} q / {} kv heads × {d}, \
         f16 KV, {kernel} ({splits} key ranges per row), {} samples per kernel, {clock}",
        a.mode, info.name, info.backend, info.driver, a.active_blocks, a.q_heads, a.kv_heads, a.repeats
    );
    println!(
        "per dispatch: {:.2} MiB moved, {:.3} GFLOP\n",
        bytes as f64 / (1 << 20) as f64,
        flops as f64 / 1e9
    );
    let cols = [
        "kernel",
        "median µs",
        "p10 µs",
        "p90 µs",
        "first sample µs",
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
        "\nmedians over samples 4..{} (each the mean of {BACK_TO_BACK} runs); paged / dense: {:.3}×",
        a.repeats,
        med[0] / med[1]
    );
    if bracketed > 0.0 {
        println!(
            "paged, timed instead with a timestamp pair around each run: median {bracketed:.1} \
             µs (where a timestamp drains the GPU, as on NVIDIA's Vulkan driver, the difference \
             is the timestamps' own cost)"
        );
    }
    println!("{}", stamp.line());
    Ok(())
}
