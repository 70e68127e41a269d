//! Times the wgpu decode attention kernel's variants and the decode step's small kernels, each
//! the way a step runs it: back to back in one compute pass, GPU timestamps only at the pass's
//! start and end (on NVIDIA's Vulkan driver a timestamp inside a pass drains the GPU and adds
//! microseconds to every dispatch it brackets; the bracketed time is printed beside it, so the
//! difference shows).
//!
//! Attention: for each shape (`--shapes`, B:HQ:HKV:D:BLOCK:KEYS, every row of KEYS keys of
//! which the last is the row's own, random scattered block tables, unused cache slots NaN as in
//! the tests), each keys-per-step count (`--keys`) and each workgroup target of the split
//! (`--targets`), the output is checked against an f64 reference (relative L2 error, must be
//! below 1e-4) and timed; the engine's choice is marked `*`. Small ops: RMSNorm of one 4096 row,
//! the QKV bias/RoPE kernel of one Llama-3-8B token, and a one-workgroup dispatch that does
//! nothing (the floor a dispatch costs in a pass).
//!
//! ```text
//! cargo run --release -p quire-backend --features wgpu --example wgpu_decode_bench -- \
//!     [--adapter N] [--shapes ...] [--keys 1,2,4] [--targets 512,1024,2048] [--samples 20]
//! ```
//! On lavapipe pass small shapes, e.g. `--shapes 2:4:2:64:16:300 --samples 2 --reps 2`.

use anyhow::{bail, Context, Result};
use half::f16;
use quire_backend::wgpu::kernels::{self, bind, Dispatch, HeadShape, SplitPlan};
use quire_backend::wgpu::probe::{AttnInput, Probe};
use quire_testkit::paged::{PagedBatch, PagedCase};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const HELP: &str = "\
wgpu_decode_bench: time the wgpu decode attention's variants and a decode step's small kernels

OPTIONS:
  --adapter N|NAME   adapter index or name substring (default: the first discrete GPU)
  --shapes LIST      comma-separated B:HQ:HKV:D:BLOCK:KEYS (default: the seed config
                     16:16:8:128:32:1024, 16:32:8:128:16:4096, 1:32:8:128:16:512,
                     1:32:8:128:16:4096, 16:16:8:128:32:256, 64:32:8:128:16:1024)
  --keys LIST        keys per key group and step to try (default 1,2,4,8; the engine's is
                     always run)
  --targets LIST     workgroups the split aims for (default 256,512,1024,2048)
  --samples N        timed samples per case (default 20)
  --reps N           runs per sample, back to back in one pass (default 10)
  --no-ops           skip the small kernels";

struct Args {
    adapter: Option<String>,
    shapes: Vec<[usize; 6]>,
    keys: Vec<usize>,
    targets: Vec<usize>,
    samples: usize,
    reps: usize,
    ops: bool,
}

fn list<T: std::str::FromStr>(s: &str) -> Result<Vec<T>> {
    s.split(',')
        .map(|x| {
            x.trim()
                .parse()
                .ok()
                .context(format!("bad list item {x:?}"))
        })
        .collect()
}

fn args() -> Result<Args> {
    let mut a = Args {
        adapter: None,
        shapes: vec![
            [16, 16, 8, 128, 32, 1024],
            [16, 32, 8, 128, 16, 4096],
            [1, 32, 8, 128, 16, 512],
            [1, 32, 8, 128, 16, 4096],
            [16, 16, 8, 128, 32, 256],
            [64, 32, 8, 128, 16, 1024],
        ],
        keys: vec![1, 2, 4, 8],
        targets: vec![256, 512, 1024, 2048],
        samples: 20,
        reps: 10,
        ops: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().context(format!("{k} needs a value"));
        match k.as_str() {
            "--adapter" => a.adapter = Some(v()?),
            "--shapes" => {
                a.shapes = v()?
                    .split(',')
                    .map(|s| {
                        let d: Vec<usize> = s
                            .split(':')
                            .map(|x| x.parse().ok().context("bad shape"))
                            .collect::<Result<_>>()?;
                        d.try_into().ok().context("a shape has 6 numbers")
                    })
                    .collect::<Result<_>>()?
            }
            "--keys" => a.keys = list(&v()?)?,
            "--targets" => a.targets = list(&v()?)?,
            "--samples" => a.samples = v()?.parse()?,
            "--reps" => a.reps = v()?.parse()?,
            "--no-ops" => a.ops = false,
            "-h" | "--help" => {
                println!("{HELP}");
                std::process::exit(0);
            }
            _ => bail!("unknown option {k}\n{HELP}"),
        }
    }
    Ok(a)
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// f64 attention of each row's one query over its keys (the dense copies).
fn reference(b: &PagedBatch<f16>, q: &[f32], s: HeadShape) -> Vec<f64> {
    let (hd, kvr, g) = (s.head_dim, s.kv_size(), s.q_heads / s.kv_heads);
    let mut out = vec![0f64; b.seqs.len() * s.q_size()];
    for (t, seq) in b.seqs.iter().enumerate() {
        for h in 0..s.q_heads {
            let qh = &q[t * s.q_size() + h * hd..][..hd];
            let sc: Vec<f64> = (0..seq.seq_len)
                .map(|j| {
                    let k = &seq.keys[j * kvr + h / g * hd..][..hd];
                    let d: f64 = qh.iter().zip(k).map(|(&a, &b)| a as f64 * b as f64).sum();
                    d / (hd as f64).sqrt()
                })
                .collect();
            let m = sc.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
            for (j, x) in sc.iter().enumerate() {
                let v = &seq.values[j * kvr + h / g * hd..][..hd];
                let p = (x - m).exp() / z;
                for d in 0..hd {
                    out[t * s.q_size() + h * hd + d] += p * v[d] as f64;
                }
            }
        }
    }
    out
}

fn attention(p: &mut Probe, a: &Args, sh: [usize; 6], rng: &mut StdRng) -> Result<()> {
    let [b, hq, hkv, d, bs, keys] = sh;
    let s = HeadShape {
        q_heads: hq,
        kv_heads: hkv,
        head_dim: d,
    };
    s.check()?;
    let seqs: Vec<(usize, usize)> = vec![(keys - 1, 1); b];
    let batch: PagedBatch<f16> = PagedCase::new(bs, s.kv_size(), &seqs).generate(rng);
    let q: Vec<f32> = (0..b * s.q_size())
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let mut qkv = Vec::new();
    for t in 0..b {
        qkv.extend_from_slice(&q[t * s.q_size()..][..s.q_size()]);
        qkv.extend_from_slice(&batch.k_new[t * s.kv_size()..][..s.kv_size()]);
        qkv.extend_from_slice(&batch.v_new[t * s.kv_size()..][..s.kv_size()]);
    }
    let (mut tables, mut tokens) = (Vec::new(), Vec::new());
    for (t, seq) in batch.seqs.iter().enumerate() {
        let off = tables.len() as u32;
        tables.extend(seq.block_table.iter().map(|x| x.0));
        let pos = batch.positions[t];
        tokens.push([pos, batch.slot_mapping[t], pos, t as u32, off]);
    }
    let want = reference(&batch, &q, s);
    let engine = p.k.attn_split.kernel(&s);
    let engine_plan = SplitPlan::new(&engine, &s, b, keys, bs);
    let kv_bytes = (b * keys * s.kv_size() * 2 * 2) as f64;
    println!(
        "\n## B{b} Hq{hq} Hkv{hkv} D{d}, block {bs}, {keys} keys: {:.1} MiB of K/V; engine: {} \
         keys/step, {} ranges of {} keys",
        kv_bytes / (1 << 20) as f64,
        engine.keys,
        engine_plan.splits,
        engine_plan.split_keys
    );
    println!(
        "| keys/step | target | ranges × keys | µs back to back | TB/s | µs bracketed | rel err |"
    );
    println!("|---:|---:|---|---:|---:|---:|---:|");
    let mut ks = a.keys.clone();
    if !ks.contains(&engine.keys) {
        ks.push(engine.keys);
    }
    for &u in &ks {
        let dk = engine.with_keys(u);
        if dk.keys != u {
            continue;
        }
        let mut plans: Vec<(usize, SplitPlan)> = a
            .targets
            .iter()
            .map(|&tg| (tg, SplitPlan::with_target(&dk, &s, b, keys, bs, tg)))
            .collect();
        plans.dedup_by_key(|x| x.1);
        for (tg, plan) in plans {
            let input = AttnInput {
                shape: s,
                block_size: bs,
                window: 0,
                qkv: &qkv,
                k_cache: &batch.k_cache,
                v_cache: &batch.v_cache,
                tokens: &tokens,
                tables: &tables,
                plan: Some(plan),
                keys: Some(u),
            };
            let run = p.attention_run(&input)?;
            let (ns, _) = p.time_back_to_back(&run.list, a.reps, a.samples)?;
            let (br, _) = p.time(&run.list, a.samples.max(4))?;
            let out = p.attention_read(&run)?.out;
            let (mut num, mut den) = (0f64, 0f64);
            for (&o, &r) in out.iter().zip(&want) {
                num += (o as f64 - r).powi(2);
                den += r * r;
            }
            let rel = if out.iter().all(|x| x.is_finite()) {
                (num / den).sqrt()
            } else {
                f64::NAN
            };
            let us = median(&ns) / 1e3;
            let mark = if dk == engine && plan == engine_plan {
                "*"
            } else {
                ""
            };
            println!(
                "| {u}{mark} | {tg} | {} × {} | {us:.1} | {:.3} | {:.1} | {rel:.2e} |",
                plan.splits,
                plan.split_keys,
                kv_bytes / (us * 1e6),
                median(&br) / 1e3,
            );
            if rel.is_nan() || rel > 1e-4 {
                bail!("attention output differs from the reference: {rel:e}");
            }
        }
    }
    Ok(())
}

/// The small kernels of a Llama-3-8B decode step, one token.
fn small_ops(p: &mut Probe, a: &Args) -> Result<()> {
    let gpu = &mut p.gpu;
    let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST;
    let mut buf = |what: &str, words: usize| gpu.buffer(what, (words * 4) as u64, usage);
    let (x, w, y, idx) = (
        buf("x", 4096)?,
        buf("w", 4096)?,
        buf("y", 4096)?,
        buf("idx", 1)?,
    );
    let s = HeadShape {
        q_heads: 32,
        kv_heads: 8,
        head_dim: 128,
    };
    let (qkv, cs) = (buf("qkv", s.stride())?, buf("cs", 128)?);
    let pbuf = p.gpu.buffer(
        "params",
        768,
        wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
    )?;
    let rms = kernels::rms_params(4096, 1, 1e-5, false);
    let qp = kernels::qkv_params(&s, 1, 64, false, false, false, 1e-5);
    let mut words = vec![0u32; 192];
    words[..16].copy_from_slice(&rms);
    words[64..80].copy_from_slice(&qp);
    words[128..144].copy_from_slice(&kernels::rms_params(0, 1, 1e-5, false));
    let bytes: Vec<u8> = words.iter().flat_map(|x| x.to_le_bytes()).collect();
    p.gpu.queue.write_buffer(&pbuf, 0, &bytes);
    let k = &p.k;
    let d = |name, pipe: &wgpu::ComputePipeline, bind, groups| Dispatch {
        name,
        pipe: pipe.clone(),
        bind,
        groups,
        bytes: 0,
        flops: 0,
    };
    let rb = bind(
        &p.gpu,
        &k.rms_norm,
        (&pbuf, 0),
        &[(1, &x), (2, &w), (3, &y), (4, &idx)],
    );
    let eb = bind(
        &p.gpu,
        &k.rms_norm,
        (&pbuf, 512),
        &[(1, &x), (2, &w), (3, &y), (4, &idx)],
    );
    let dummy = &w;
    let qb = bind(
        &p.gpu,
        &k.qkv_post,
        (&pbuf, 256),
        &[(1, &qkv), (2, dummy), (3, dummy), (4, dummy), (5, &cs)],
    );
    let cases = [
        (
            "rms_norm, one 4096 row",
            d("rms_norm", &k.rms_norm, rb, [1, 1, 1]),
        ),
        (
            "qkv bias/RoPE, one 8B token",
            d("rope", &k.qkv_post, qb, kernels::qkv_groups(&s, 1)),
        ),
        // RMSNorm of a row of no columns: what any dispatch costs in a pass.
        (
            "rms_norm of 0 columns (a dispatch's floor)",
            d("rms_norm", &k.rms_norm, eb, [1, 1, 1]),
        ),
    ];
    println!("\n## small kernels: µs per dispatch, 100 back to back in one pass vs a timestamp pair around each");
    println!("| kernel | back to back | bracketed |");
    println!("|---|---:|---:|");
    for (what, disp) in &cases {
        let list = std::slice::from_ref(disp);
        let (ns, gpu) = p.time_back_to_back(list, 100, a.samples)?;
        let (br, _) = p.time(list, a.samples.max(4) * 10)?;
        println!(
            "| {what} | {:.2} | {:.2} |{}",
            median(&ns) / 1e3,
            median(&br) / 1e3,
            if gpu { "" } else { " (wall clock)" }
        );
    }
    Ok(())
}

fn main() -> Result<()> {
    let a = args()?;
    let mut p = Probe::new(a.adapter.as_deref())?;
    println!(
        "{} ({} {}); subgroups {:?}",
        p.gpu.info.name, p.gpu.info.backend, p.gpu.info.driver, p.gpu.caps.subgroup
    );
    let mut rng = StdRng::seed_from_u64(1);
    for &sh in &a.shapes {
        attention(&mut p, &a, sh, &mut rng)?;
    }
    if a.ops {
        small_ops(&mut p, &a)?;
    }
    Ok(())
}
