//! The one-token GEMV's fused forms (`GemvIn::Norm`, `GemvIn::NormRope`: the RMSNorm before a
//! projection, and RoPE of the QKV projection's Q and K rows, taken into the GEMV so a decode
//! step runs fewer dispatches) against a plain CPU reference: RMSNorm in f64, the product of the
//! dequantized weights, then RoPE of adjacent pairs with the same (cos, sin) table. Every type
//! that has a one-token kernel, the engine's designs and others (1, 2, 4 and 8 rows per
//! workgroup; slot and unit kernels), subgroup sums and workgroup-memory sums, odd row counts,
//! partial rotation, a QKV matrix of two parts (two weight types), several tokens along the
//! grid's z; outputs poisoned with NaN first, the activations and tables of other tokens
//! present around the one read. Needs an adapter (lavapipe will do): ignored unless
//! QUIRE_REQUIRE_WGPU is set at build time (see quire-testkit).

#[cfg(feature = "wgpu")]
use {
    quire_backend::wgpu::gemv::{gemv_pipeline, Gemv, GemvIn},
    quire_backend::wgpu::kernels::{bind, encode, Dispatch, MmShape},
    quire_backend::wgpu::probe::Probe,
    quire_backend::wgpu::weights::DMatrix,
    quire_backend::HostTensor,
    quire_gguf::GgmlType,
    quire_testkit::metric::{self, rel_l2},
    quire_testkit::random::{rnd, tensor},
    rand::{rngs::StdRng, SeedableRng},
};

#[cfg(feature = "wgpu")]
fn probe() -> Probe {
    let adapter = std::env::var("QUIRE_WGPU_ADAPTER").ok();
    Probe::new(adapter.as_deref())
        .unwrap_or_else(|e| quire_testkit::missing(quire_testkit::Backend::Wgpu, &e))
}

/// RoPE of a QKV row's layout: heads of `head_dim`, the first `pairs` adjacent pairs of each
/// head rotate, for the output columns below `rows` (Q and K).
#[cfg(feature = "wgpu")]
#[derive(Clone, Copy)]
struct Rope {
    head_dim: usize,
    pairs: usize,
    rows: usize,
}

#[cfg(feature = "wgpu")]
const EPS: f32 = 1e-5;

/// The reference: per token, h = x / sqrt(mean(x²) + eps) · g (f64), y = W h (the dequantized
/// weights of `ws`, stacked, as the device holds them), then RoPE of `rope`'s rows with token t's (cos, sin) from `cs`.
#[cfg(feature = "wgpu")]
fn reference(
    ws: &[&HostTensor],
    x: &[f32],
    g: &[f32],
    n: usize,
    rope: Option<(Rope, &[f32])>,
) -> Vec<f64> {
    let cols = g.len();
    // f32 and bf16 weights go to the device as f16.
    let to_dev = |t: &HostTensor| -> Vec<f32> {
        let v = t.to_f32().unwrap();
        if matches!(t.dtype, GgmlType::F32 | GgmlType::BF16) {
            v.into_iter()
                .map(|x| half::f16::from_f32(x).to_f32())
                .collect()
        } else {
            v
        }
    };
    let w: Vec<f32> = ws.iter().flat_map(|t| to_dev(t)).collect();
    let rows = w.len() / cols;
    let mut y = vec![0f64; n * rows];
    for t in 0..n {
        let xr = &x[t * cols..][..cols];
        let ms = xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / cols as f64;
        let s = 1.0 / (ms + EPS as f64).sqrt();
        let h: Vec<f64> = xr
            .iter()
            .zip(g)
            .map(|(&v, &gv)| v as f64 * s * gv as f64)
            .collect();
        let yr = &mut y[t * rows..][..rows];
        for (r, out) in yr.iter_mut().enumerate() {
            *out = (0..cols).map(|c| w[r * cols + c] as f64 * h[c]).sum();
        }
        if let Some((rp, cs)) = rope {
            for r in (0..rp.rows.min(rows)).step_by(2) {
                let c = r % rp.head_dim;
                if c / 2 < rp.pairs {
                    let k = (t * rp.pairs + c / 2) * 2;
                    let (co, si) = (cs[k] as f64, cs[k + 1] as f64);
                    let (a, b) = (yr[r], yr[r + 1]);
                    yr[r] = a * co - b * si;
                    yr[r + 1] = a * si + b * co;
                }
            }
        }
    }
    y
}

/// The fused GEMV of design `g` (the engine's pipelines where `design` is `None`) over the
/// stacked `ws`, its input as `input` says, for `n` tokens (one per z of the grid). `x` and
/// `cs` are the tokens' rows; the output is poisoned with NaN first.
#[cfg(feature = "wgpu")]
#[allow(clippy::too_many_arguments)]
fn run(
    p: &mut Probe,
    design: Option<(Gemv, bool)>,
    input: GemvIn,
    ws: &[&HostTensor],
    x: &[f32],
    g: &[f32],
    n: usize,
    rope: Option<(Rope, &[f32])>,
) -> Vec<f32> {
    let cols = g.len();
    let m = DMatrix::stack(&mut p.gpu, "w", ws, cols).unwrap();
    let f32s = |v: &[f32]| v.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>();
    let xb = p.gpu.upload("x", &f32s(x)).unwrap();
    let gb = p.gpu.upload("g", &f32s(g)).unwrap();
    let csb = p
        .gpu
        .upload("cs", &f32s(rope.map_or(&[0.0; 4][..], |r| r.1)))
        .unwrap();
    let rows = m.rows;
    let yu =
        wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST;
    let y = p.gpu.buffer("y", (n * rows * 4) as u64, yu).unwrap();
    p.gpu
        .queue
        .write_buffer(&y, 0, &f32s(&vec![f32::NAN; n * rows]));
    let usage = wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST;
    let mut list = Vec::new();
    for part in &m.parts {
        let s = MmShape {
            rows: part.rows,
            cols,
            n,
            x_stride: cols,
            y_stride: rows,
            y_off: part.y_off,
            add: false,
            row_words: part.ty.row_words(cols),
            row0: part.row0,
        };
        let rot = rope.map(|(r, _)| (r.head_dim, r.pairs, r.rows));
        let pbuf = p.gpu.buffer("params", 64, usage).unwrap();
        let words: Vec<u8> = s
            .fused_params(EPS, rot)
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        p.gpu.queue.write_buffer(&pbuf, 0, &words);
        let (pipe, groups) = match design {
            Some((d, sub)) => (
                gemv_pipeline(&p.gpu, part.ty, d, sub, input).unwrap(),
                d.groups(&s),
            ),
            None => (
                p.k.gemv1(part.ty, input)
                    .expect("a one-token kernel")
                    .clone(),
                Gemv::engine(part.ty).groups(&s),
            ),
        };
        let mut buffers = vec![(1, &part.buf), (2, &xb), (3, &y), (5, &gb)];
        if input == GemvIn::NormRope {
            buffers.push((6, &csb));
        }
        let bind = bind(&p.gpu, &pipe, (&pbuf, 0), &buffers);
        list.push(Dispatch {
            name: "gemv",
            pipe,
            bind,
            groups,
            bytes: 0,
            flops: 0,
        });
    }
    let mut enc = p.gpu.device.create_command_encoder(&Default::default());
    encode(&mut enc, &list);
    p.gpu.submit_wait(enc.finish()).unwrap();
    let b = p.gpu.download(&y, (n * rows * 4) as u64).unwrap();
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// A random (cos, sin) table of `n` tokens' `pairs` angles.
#[cfg(feature = "wgpu")]
fn table(rng: &mut StdRng, n: usize, pairs: usize) -> Vec<f32> {
    let a = rnd(rng, n * pairs, 3.0);
    a.iter().flat_map(|&t| [t.cos(), t.sin()]).collect()
}

/// The types with a one-token kernel (Q8_0 runs the multi-token kernel, which has no fused
/// form: the engine keeps its norm a dispatch of its own).
#[cfg(feature = "wgpu")]
const TYPES: [GgmlType; 8] = [
    GgmlType::F16,
    GgmlType::F32,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

quire_testkit::wgpu_test! {
    fn gemv_with_the_rms_norm_in_its_input_matches_norm_then_product() {
        // The engine's kernels and other designs, subgroup sums and without; odd rows (fewer than a
        // workgroup's, and not a multiple of them), rows
        // shorter than a workgroup's stride and many strides long, up to 3 tokens (the engine
        // runs one); activations of a wide range so the norm's scale matters.
        let mut p = probe();
        let mut rng = StdRng::seed_from_u64(41);
        let subs: &[bool] = if p.gpu.caps.subgroup.is_some() { &[true, false] } else { &[false] };
        for t in TYPES {
            let k = t.block_size().max(8);
            let mut designs: Vec<Option<(Gemv, bool)>> = vec![None];
            for &sub in subs {
                designs.push(Some((Gemv::Slot { rows: 1, wg: 32 }, sub)));
                designs.push(Some((Gemv::Slot { rows: 8, wg: 256 }, sub)));
                let unit = [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::Q4_0, GgmlType::Q4_1];
                if unit.contains(&t) {
                    designs.push(Some((Gemv::Unit { rows: 2, wg: 64 }, sub)));
                    designs.push(Some((Gemv::Unit { rows: 8, wg: 128 }, sub)));
                }
            }
            for (i, d) in designs.into_iter().enumerate() {
                let (rows, cols, n) = [(37, 3 * k, 1), (5, k, 1), (17, 33 * k, 2), (64, 5 * k, 3)][i % 4];
                let w = tensor(&mut rng, t, rows, cols);
                let x = rnd(&mut rng, n * cols, 4.0);
                let g = rnd(&mut rng, cols, 2.0);
                let got = run(&mut p, d, GemvIn::Norm, &[&w], &x, &g, n, None);
                let want = reference(&[&w], &x, &g, n, None);
                let e = rel_l2(&got, &want);
                let name = d.map_or("engine".into(), |(g, s)| format!("{} subgroup={s}", g.name()));
                assert!(e < metric::DOT_F32, "{} {name} {rows}x{cols} n={n}: rel L2 {e:e}", t.name());
            }
        }
    }
}

quire_testkit::wgpu_test! {
    fn qkv_gemv_with_norm_and_rope_matches_norm_product_then_rope() {
        // A QKV matrix (Q heads, then K, then V, which is not rotated) as the engine runs it, the
        // engine's kernels and even-row designs of others: full and partial rotation (rope_dim
        // below head_dim), GQA, Q and K of one type and V of another (two parts, the second at
        // an even column past 0), up to 2 tokens.
        let mut p = probe();
        let mut rng = StdRng::seed_from_u64(43);
        let subs: &[bool] = if p.gpu.caps.subgroup.is_some() { &[true, false] } else { &[false] };
        // (head_dim, rope pairs, q heads, kv heads, tokens)
        let shapes = [(16, 8, 4, 2, 1), (32, 4, 3, 1, 2), (64, 32, 2, 2, 1)];
        for (qk, v) in [
            (GgmlType::F16, GgmlType::F16),
            (GgmlType::Q4_K, GgmlType::Q6_K),
            (GgmlType::Q4_0, GgmlType::F16),
            (GgmlType::Q5_K, GgmlType::Q4_1),
        ] {
            let cols = qk.block_size().max(v.block_size()).max(8) * 2;
            let mut designs: Vec<Option<(Gemv, bool)>> = vec![None];
            for &sub in subs {
                designs.push(Some((Gemv::Slot { rows: 2, wg: 64 }, sub)));
            }
            for (i, d) in designs.into_iter().enumerate() {
                let (hd, pairs, qh, kvh, n) = shapes[i % shapes.len()];
                let rope = Rope { head_dim: hd, pairs, rows: (qh + kvh) * hd };
                let wqk = tensor(&mut rng, qk, (qh + kvh) * hd, cols);
                let wv = tensor(&mut rng, v, kvh * hd, cols);
                let x = rnd(&mut rng, n * cols, 3.0);
                let g = rnd(&mut rng, cols, 2.0);
                let cs = table(&mut rng, n, pairs);
                let ws = [&wqk, &wv];
                let got = run(&mut p, d, GemvIn::NormRope, &ws, &x, &g, n, Some((rope, &cs)));
                let want = reference(&ws, &x, &g, n, Some((rope, &cs)));
                let e = rel_l2(&got, &want);
                let name = d.map_or("engine".into(), |(g, s)| format!("{} subgroup={s}", g.name()));
                assert!(
                    e < metric::DOT_F32,
                    "{}+{} {name} head {hd} pairs {pairs} {qh}/{kvh} heads n={n}: rel L2 {e:e}",
                    qk.name(),
                    v.name()
                );
            }
        }
    }
}
