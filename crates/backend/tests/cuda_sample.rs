//! `sample_rows` (the CUDA sampling kernel) against `quire_backend::sample_row`, the host sampler,
//! on random rows of 49,152 and 128,256 logits (model-like, flat, tied, clustered, with -0/+0,
//! NaN and infinities) and random top-k, top-p, min-p, temperature and u.
//!
//! The host adds its probabilities as f32 in sorted order, which over a large vocabulary rounds by
//! up to ~3e-4 at a top-p cut; the kernel sums (nearly) exactly. So a differing token must be the
//! pick of exact arithmetic (`exact` below: the same semantics with f64 sums) or sit within 1e-5
//! (relative) of a top-p, min-p or draw boundary; and on rows like a model's such rows must stay
//! under 1%. (On flat rows or rows of huge runs of equal logits the host's own rounding moves a few
//! percent of the top-p cuts; there the differences are counted and each must be explained.) A
//! stratified sweep of u over a row checks the frequencies against the exact probabilities. Needs
//! a GPU: ignored without one (see quire-testkit). Prints the kernel's time per launch.

// The GPU-only parts compile with the `cuda` feature only; without it every test here fails
// when run (and is ignored unless QUIRE_REQUIRE_GPU is set: see quire-testkit).
#[cfg(feature = "cuda")]
use {
    quire_backend::cuda::gpu::Gpu,
    quire_backend::cuda::nvrtc,
    quire_backend::cuda::sample::SampleKernel,
    quire_backend::{argmax, mask_allows, mask_words, sample_row, sample_row_masked, SampleParams},
    rand::{rngs::StdRng, Rng, SeedableRng},
    std::time::Instant,
};

#[cfg(feature = "cuda")]
struct Device {
    g: Gpu,
    k: SampleKernel,
}

/// The GPU and its sampling kernel. A GPU without the shared memory `sample_rows` needs (the
/// backend then samples on the host) fails the test rather than passing it unchecked.
#[cfg(feature = "cuda")]
fn device() -> Device {
    let g = Gpu::new(0).unwrap_or_else(|e| quire_testkit::no_gpu(&e));
    let m = g.module(&nvrtc::SAMPLE, &[]).unwrap();
    match SampleKernel::new(&g, &m).unwrap() {
        Some(k) => Device { g, k },
        None => panic!(
            "{}: not enough shared memory for sample_rows (this GPU samples on the host)",
            g.name
        ),
    }
}

#[cfg(feature = "cuda")]
impl Device {
    /// Tokens of `params.len()` rows of `logits` (`[rows, stride]`; stride 0 repeats one row).
    fn sample(
        &mut self,
        logits: &[f32],
        stride: usize,
        vocab: usize,
        params: &[SampleParams],
    ) -> Vec<u32> {
        self.sample_masked(logits, stride, vocab, params, None)
    }

    /// `sample` under allowed-token masks (`[rows, mask_words(vocab)]`).
    fn sample_masked(
        &mut self,
        logits: &[f32],
        stride: usize,
        vocab: usize,
        params: &[SampleParams],
        mask: Option<&[u32]>,
    ) -> Vec<u32> {
        let dl = self.g.upload(logits).unwrap();
        let out = self.g.upload(&vec![-1i32; params.len()]).unwrap();
        let dm = mask.map(|m| self.g.upload(m).unwrap());
        let mp = dm.as_ref().map_or(0, |m| m.ptr);
        // SAFETY: every address is a live allocation of this test (g.upload / g.alloc), sized for the launch's shape, and the stream is synchronised (dtoh) before any of them drops.
        unsafe {
            self.k
                .launch(&self.g, dl.ptr, stride, vocab, params, mp, out.ptr)
        }
        .unwrap();
        let mut ids = vec![0i32; params.len()];
        self.g.dtoh(&out, &mut ids).unwrap();
        assert!(ids.iter().all(|&t| t >= 0), "unwritten output");
        ids.into_iter().map(|t| t as u32).collect()
    }
}

#[cfg(feature = "cuda")]
fn normal(rng: &mut StdRng) -> f32 {
    // Box-Muller.
    let (a, b): (f64, f64) = (rng.random(), rng.random());
    ((-2.0 * (1.0 - a).ln()).sqrt() * (std::f64::consts::TAU * b).cos()) as f32
}

/// A model's head: a few tokens far above the rest.
#[cfg(feature = "cuda")]
fn head(l: &mut [f32], rng: &mut StdRng) {
    for _ in 0..rng.random_range(1..30) {
        let i = rng.random_range(0..l.len());
        l[i] += rng.random_range(4.0..18.0);
    }
}

/// A row of one of the kinds below.
#[cfg(feature = "cuda")]
fn row(rng: &mut StdRng, vocab: usize, kind: usize) -> Vec<f32> {
    let sigma = rng.random_range(1.5f32..3.0);
    let mut l: Vec<f32> = (0..vocab).map(|_| sigma * normal(rng)).collect();
    match kind {
        // Model-like.
        0 => head(&mut l, rng),
        // Flat: the whole vocabulary matters.
        1 => l.iter_mut().for_each(|v| *v /= sigma),
        // Ties everywhere: logits on a grid of 0.5, the head tied too.
        2 => {
            head(&mut l, rng);
            l.iter_mut().for_each(|v| *v = (*v * 2.0).round() / 2.0);
        }
        // Non-finite entries: NaN, ±inf and huge negatives among model-like logits.
        3 => {
            head(&mut l, rng);
            for _ in 0..vocab / 50 {
                let i = rng.random_range(0..vocab);
                l[i] = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY, -1e30][rng.random_range(0..4)];
            }
        }
        // Mostly masked: all but ~2000 tokens share one logit 20 below the best (one huge run of
        // equal logits that top-k and the draw reach).
        4 => {
            head(&mut l, rng);
            let mx = l.iter().cloned().fold(f32::MIN, f32::max);
            for v in l.iter_mut() {
                if rng.random_range(0..vocab) >= 2000 {
                    *v = mx - 20.0;
                }
            }
        }
        // A dense cluster: 20,000 logits within 0.002 of each other just below the best (one
        // bucket far over the kernel's sort capacity, split by key digits).
        5 => {
            head(&mut l, rng);
            let mx = l.iter().cloned().fold(f32::MIN, f32::max);
            for _ in 0..20_000 {
                let i = rng.random_range(0..vocab);
                l[i] = mx - 0.5 - rng.random_range(0.0..0.002);
            }
        }
        // Signed zeros: the best logit is 0 with both signs (+0 ranks first), the rest -1 or 0.
        _ => {
            for v in l.iter_mut() {
                *v = [0.0, -0.0, -1.0, -3.0][rng.random_range(0..4)];
            }
        }
    }
    l
}

#[cfg(feature = "cuda")]
fn random_params(rng: &mut StdRng) -> SampleParams {
    let temperature = if rng.random_bool(0.1) {
        0.0
    } else {
        rng.random_range(0.3..2.0)
    };
    let u = match rng.random_range(0..20) {
        0 => 0.0,
        1 => 1.0 - 1e-12,
        _ => rng.random(),
    };
    SampleParams {
        temperature,
        top_k: [0, 1, 40, 1000, 5000][rng.random_range(0..5)],
        top_p: if rng.random_bool(0.3) {
            1.0
        } else {
            rng.random_range(0.1..1.0)
        },
        min_p: if rng.random_bool(0.5) {
            0.0
        } else {
            rng.random_range(0.0..0.2)
        },
        u,
    }
}

/// `sample_row`'s kept tokens (sorted) and their weights, with f64 sums (exact to ~1e-15), and
/// how close (relative) the top-p or min-p cut came to a boundary. Temperature > 0; `None`
/// without finite logits.
#[cfg(feature = "cuda")]
fn exact_kept(l: &[f32], p: &SampleParams) -> Option<(Vec<u32>, Vec<f64>, f64)> {
    let mut c: Vec<(f32, u32)> = l
        .iter()
        .enumerate()
        .filter(|(_, v)| v.is_finite())
        .map(|(i, &v)| (v, i as u32))
        .collect();
    if c.is_empty() {
        return None;
    }
    c.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    if p.top_k > 0 && (p.top_k as usize) < c.len() {
        c.truncate(p.top_k as usize);
    }
    let mx = c[0].0;
    let e: Vec<f64> = c.iter().map(|&(v, _)| ((v - mx) as f64).exp()).collect();
    let z: f64 = e.iter().sum();
    let mut keep = c.len();
    let mut margin = f64::INFINITY;
    if p.top_p < 1.0 {
        let tp = p.top_p as f64;
        let mut cum = 0.0;
        for (i, v) in e.iter().enumerate() {
            let prev = cum;
            cum += v / z;
            if cum >= tp {
                keep = i + 1;
                margin = (cum - tp) / tp;
                if i > 0 {
                    margin = margin.min((tp - prev) / tp);
                }
                break;
            }
        }
        if keep == c.len() {
            margin = margin.min((tp - cum).abs() / tp);
        }
    }
    if p.min_p > 0.0 {
        let floor = p.min_p as f64 * e[0] / z;
        let km = e.iter().take_while(|&&v| v / z >= floor).count();
        for j in [km.wrapping_sub(1), km] {
            if let Some(v) = e.get(j) {
                margin = margin.min((v / z - floor).abs() / floor);
            }
        }
        keep = keep.min(km.max(1));
    }
    let w = c[..keep]
        .iter()
        .map(|&(v, _)| (((v - mx) / p.temperature) as f64).exp())
        .collect();
    Some((c[..keep].iter().map(|e| e.1).collect(), w, margin))
}

/// `sample_row` with exact sums, and how close (relative) its top-p, min-p or draw decision came
/// to a boundary.
#[cfg(feature = "cuda")]
fn exact(l: &[f32], p: &SampleParams) -> (u32, f64) {
    if p.temperature <= 0.0 {
        return (argmax(l), f64::INFINITY);
    }
    let Some((ids, w, margin)) = exact_kept(l, p) else {
        return (0, f64::INFINITY);
    };
    let total: f64 = w.iter().sum();
    let t = p.u * total;
    let mut cum = 0.0;
    for (j, v) in w.iter().enumerate() {
        let next = cum + v;
        if t < next {
            let mut m = (next - t) / total;
            if j > 0 {
                m = m.min((t - cum) / total);
            }
            return (ids[j], margin.min(m));
        }
        cum = next;
    }
    (ids[ids.len() - 1], margin.min((t - cum).abs() / total))
}

/// Row kinds like a model's output (a head far above the rest; some with ties on a grid or
/// non-finite entries); the others are flat or dominated by huge runs of equal logits.
#[cfg(feature = "cuda")]
const MODEL_LIKE: [usize; 3] = [0, 2, 3];

quire_testkit::gpu_test! {
    fn sampled_tokens_match_the_host_sampler() {
        let mut d = device();
        let mut rng = StdRng::seed_from_u64(11);
        // Per kind: rows, rows where the device differs from the host, rows where the host differs
        // from exact sums.
        let mut by_kind = [(0usize, 0usize, 0usize); 7];
        let mut unexplained = vec![];
        for vocab in [49_152usize, 128_256] {
            for chunk in 0..25 {
                let n = 24;
                let mut logits = Vec::with_capacity(n * vocab);
                let mut kinds = vec![];
                for r in 0..n {
                    let kind = (chunk * n + r) % 7;
                    kinds.push(kind);
                    logits.extend(row(&mut rng, vocab, kind));
                }
                let params: Vec<SampleParams> = (0..n).map(|_| random_params(&mut rng)).collect();
                let got = d.sample(&logits, vocab, vocab, &params);
                for r in 0..n {
                    let l = &logits[r * vocab..(r + 1) * vocab];
                    let p = &params[r];
                    let host = sample_row(l, p);
                    let (want_exact, margin) = exact(l, p);
                    let k = &mut by_kind[kinds[r]];
                    k.0 += 1;
                    k.2 += (host != want_exact) as usize;
                    if got[r] == host {
                        continue;
                    }
                    k.1 += 1;
                    eprintln!(
                        "vocab {vocab} kind {} {p:?}: device {} host {host} exact {want_exact} (margin {margin:.1e})",
                        kinds[r], got[r]
                    );
                    if p.temperature <= 0.0 || (got[r] != want_exact && margin >= 1e-5) {
                        unexplained.push(format!("vocab {vocab} kind {} {p:?}", kinds[r]));
                    }
                }
            }
        }
        for (kind, (rows, differ, inexact)) in by_kind.iter().enumerate() {
            eprintln!("kind {kind}: {rows} rows, {differ} differ from the host sampler; the host differs from exact sums on {inexact}");
        }
        assert!(unexplained.is_empty(), "unexplained: {unexplained:#?}");
        let (rows, differ) = MODEL_LIKE
            .iter()
            .fold((0, 0), |a, &k| (a.0 + by_kind[k].0, a.1 + by_kind[k].1));
        assert!(
            differ * 100 < rows,
            "{differ} of {rows} model-like rows differ from the host sampler"
        );
    }
}

quire_testkit::gpu_test! {
    fn edge_rows_match_the_host_sampler() {
        let mut d = device();
        let nan = f32::NAN;
        let inf = f32::INFINITY;
        let rows: Vec<Vec<f32>> = vec![
            vec![nan, -inf, -inf],
            vec![-0.0, 0.0, -1.0],
            vec![0.0, -0.0, nan],
            vec![nan, nan],
            vec![-inf, -inf, nan, -inf],
            vec![3.0],
            vec![1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
            vec![inf, 2.0, 1.0, nan, 2.0],
            (0..1000).map(|i| (i % 13) as f32 * 0.25).collect(),
            vec![0.0; 70_000],
        ];
        let mut rng = StdRng::seed_from_u64(5);
        for l in &rows {
            let mut params = vec![SampleParams::GREEDY];
            for _ in 0..40 {
                params.push(random_params(&mut rng));
            }
            params.push(SampleParams {
                temperature: 1.0,
                top_k: 3,
                top_p: 1.0,
                min_p: 0.0,
                u: 1.0 - 1e-12,
            });
            let got = d.sample(l, 0, l.len(), &params);
            for (p, g) in params.iter().zip(got) {
                let host = sample_row(l, p);
                let (want, margin) = exact(l, p);
                assert!(
                    g == host || (g == want || margin < 1e-5) && p.temperature > 0.0,
                    "row of {} ({:?}...) {p:?}: device {g}, host {host}",
                    l.len(),
                    &l[..l.len().min(8)]
                );
            }
        }
    }
}

quire_testkit::gpu_test! {
    fn frequencies_over_a_sweep_of_u_match_the_probabilities() {
        let mut d = device();
        let mut rng = StdRng::seed_from_u64(8);
        let vocab = 49_152;
        let model = row(&mut rng, vocab, 0);
        let flat = row(&mut rng, vocab, 1);
        for (l, base) in [
            (
                &model,
                SampleParams {
                    temperature: 2.0,
                    top_k: 0,
                    top_p: 0.995,
                    min_p: 0.0005,
                    u: 0.0,
                },
            ),
            (
                &model,
                SampleParams {
                    temperature: 1.5,
                    top_k: 1000,
                    top_p: 1.0,
                    min_p: 0.0,
                    u: 0.0,
                },
            ),
            (
                &flat,
                SampleParams {
                    temperature: 0.9,
                    top_k: 0,
                    top_p: 0.5,
                    min_p: 0.0,
                    u: 0.0,
                },
            ),
        ] {
            // u at the middles of n equal steps: token j gets n · P(j) of them, give or take one.
            let n = 1usize << 16;
            let params: Vec<SampleParams> = (0..n)
                .map(|i| SampleParams {
                    u: (i as f64 + 0.5) / n as f64,
                    ..base
                })
                .collect();
            let got = d.sample(l, 0, vocab, &params);
            let mut count = vec![0usize; vocab];
            got.iter().for_each(|&t| count[t as usize] += 1);
            // The exact probabilities of the kept tokens.
            let (ids, w, _) = exact_kept(l, &base).unwrap();
            let total: f64 = w.iter().sum();
            let mut prob = vec![0f64; vocab];
            ids.iter()
                .zip(&w)
                .for_each(|(&i, v)| prob[i as usize] = v / total);
            let kept = prob.iter().filter(|&&p| p > 0.0).count();
            let mut worst = 0f64;
            for j in 0..vocab {
                let want = n as f64 * prob[j];
                let dev = (count[j] as f64 - want).abs();
                worst = worst.max(dev);
                assert!(
                    dev <= 2.0,
                    "{base:?}: token {j} drawn {} times, expected {want:.1}",
                    count[j]
                );
            }
            eprintln!(
                "{base:?}: {kept} kept tokens, counts within {worst:.2} of n · P over {n} stratified draws"
            );
        }
    }
}

quire_testkit::gpu_test! {
    fn time_per_launch() {
        let mut d = device();
        let mut rng = StdRng::seed_from_u64(2);
        for vocab in [49_152usize, 128_256] {
            for rows in [1usize, 132] {
                let mut logits = vec![];
                for r in 0..rows {
                    logits.extend(row(&mut rng, vocab, r % 2));
                }
                let params: Vec<SampleParams> = (0..rows)
                    .map(|_| SampleParams {
                        temperature: 0.8,
                        top_k: 40,
                        top_p: 0.95,
                        min_p: 0.05,
                        u: rng.random(),
                    })
                    .collect();
                let dl = d.g.upload(&logits).unwrap();
                let out = d.g.upload(&vec![0i32; rows]).unwrap();
                for (name, ps) in [
                    ("top-k 40, top-p 0.95, min-p 0.05", params.clone()),
                    (
                        "full vocabulary, T 1",
                        vec![
                            SampleParams {
                                temperature: 1.0,
                                top_k: 0,
                                top_p: 1.0,
                                min_p: 0.0,
                                u: 0.5,
                            };
                            rows
                        ],
                    ),
                    (
                        "top-p 0.9 only",
                        vec![
                            SampleParams {
                                temperature: 1.0,
                                top_k: 0,
                                top_p: 0.9,
                                min_p: 0.0,
                                u: 0.7,
                            };
                            rows
                        ],
                    ),
                ] {
                    let mut times = vec![];
                    for _ in 0..7 {
                        let t = Instant::now();
                        // SAFETY: every address is a live allocation of this test (g.upload / g.alloc), sized for the launch's shape, and the stream is synchronised (dtoh) before any of them drops.
                        unsafe { d.k.launch(&d.g, dl.ptr, vocab, vocab, &ps, 0, out.ptr) }
                            .unwrap();
                        d.g.sync().unwrap();
                        times.push(t.elapsed().as_secs_f64() * 1e6);
                    }
                    times.sort_by(f64::total_cmp);
                    eprintln!(
                        "sample_rows vocab {vocab}, {rows} rows, {name}: {:.0} µs per launch (median of 7, with the upload)",
                        times[3]
                    );
                }
            }
        }
    }
}

/// A random allowed-token mask of one row: about a `density` share of the tokens, or one token,
/// none, or all of them.
#[cfg(feature = "cuda")]
fn random_mask(rng: &mut StdRng, vocab: usize, kind: usize) -> Vec<u32> {
    let mut m = vec![0u32; mask_words(vocab)];
    let mut allow = |t: usize| m[t / 32] |= 1 << (t % 32);
    match kind {
        0 => allow(rng.random_range(0..vocab)),
        1 => {}
        2 => (0..vocab).for_each(&mut allow),
        // A JSON grammar's masks: a few hundred tokens scattered over the vocabulary.
        3 => (0..rng.random_range(1..400)).for_each(|_| allow(rng.random_range(0..vocab))),
        _ => {
            let density = rng.random_range(0.01..0.9);
            (0..vocab)
                .filter(|_| rng.random_bool(density))
                .for_each(allow)
        }
    }
    // Stray bits past the vocabulary must be ignored.
    if !vocab.is_multiple_of(32) {
        *m.last_mut().unwrap() |= !0u32 << (vocab % 32);
    }
    m
}

quire_testkit::gpu_test! {
    /// Masked rows: the device's pick is `sample_row_masked`'s (the host sampler on the row with
    /// every disallowed logit at -inf) under the same tolerance as unmasked rows (greedy exactly),
    /// and never a disallowed token where an allowed logit is finite.
    fn masked_rows_match_the_host_and_pick_only_allowed_tokens() {
        let mut d = device();
        let mut rng = StdRng::seed_from_u64(26);
        let (mut rows_seen, mut differ, mut unexplained) = (0usize, 0usize, vec![]);
        for vocab in [49_152usize, 49_153, 128_256] {
            for chunk in 0..8 {
                let n = 20;
                let words = mask_words(vocab);
                let (mut logits, mut masks, mut kinds) = (vec![], vec![], vec![]);
                for r in 0..n {
                    let kind = (chunk * n + r) % 7;
                    kinds.push(kind);
                    logits.extend(row(&mut rng, vocab, kind));
                    masks.extend(random_mask(&mut rng, vocab, r % 5));
                }
                let params: Vec<SampleParams> = (0..n)
                    .map(|r| if r % 4 == 0 { SampleParams::GREEDY } else { random_params(&mut rng) })
                    .collect();
                let got = d.sample_masked(&logits, vocab, vocab, &params, Some(&masks));
                for r in 0..n {
                    let l = &logits[r * vocab..(r + 1) * vocab];
                    let m = &masks[r * words..(r + 1) * words];
                    let p = &params[r];
                    let lm: Vec<f32> = l
                        .iter()
                        .enumerate()
                        .map(|(i, &v)| if mask_allows(m, i) { v } else { f32::NEG_INFINITY })
                        .collect();
                    let host = sample_row_masked(l, Some(m), p, &mut Vec::new());
                    assert_eq!(host, sample_row(&lm, p), "the host reference");
                    let finite = if p.temperature > 0.0 {
                        lm.iter().any(|v| v.is_finite())
                    } else {
                        lm.iter().any(|&v| v > f32::NEG_INFINITY)
                    };
                    assert!(
                        !finite || mask_allows(m, got[r] as usize),
                        "vocab {vocab} kind {} {p:?}: picked disallowed token {}",
                        kinds[r],
                        got[r]
                    );
                    rows_seen += 1;
                    if got[r] == host {
                        continue;
                    }
                    differ += 1;
                    let (want_exact, margin) = exact(&lm, p);
                    eprintln!(
                        "vocab {vocab} kind {} {p:?}: device {} host {host} exact {want_exact} (margin {margin:.1e})",
                        kinds[r], got[r]
                    );
                    if p.temperature <= 0.0 || (got[r] != want_exact && margin >= 1e-5) {
                        unexplained.push(format!("vocab {vocab} kind {} {p:?}", kinds[r]));
                    }
                }
            }
        }
        eprintln!("masked: {differ} of {rows_seen} rows differ from the host sampler (each explained)");
        assert!(unexplained.is_empty(), "unexplained: {unexplained:#?}");
        assert!(differ * 20 < rows_seen, "{differ} of {rows_seen} masked rows differ");
    }
}

quire_testkit::gpu_test! {
    /// What a mask adds to a launch: 16 rows of 49,152 logits (the default model's), greedy and
    /// sampled, with and without masks of a few hundred allowed tokens (uploaded each time, as
    /// the executor does).
    fn masked_time_per_launch() {
        let mut d = device();
        let mut rng = StdRng::seed_from_u64(3);
        let (vocab, rows) = (49_152usize, 16usize);
        let mut logits = vec![];
        let mut masks = vec![];
        for _ in 0..rows {
            logits.extend(row(&mut rng, vocab, 0));
            masks.extend(random_mask(&mut rng, vocab, 3));
        }
        let dl = d.g.upload(&logits).unwrap();
        let out = d.g.upload(&vec![0i32; rows]).unwrap();
        let mut dm = d.g.upload(&masks).unwrap();
        let sampled = SampleParams { temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.05, u: 0.3 };
        for (name, p) in [("greedy", SampleParams::GREEDY), ("top-k 40, top-p 0.95, min-p 0.05", sampled)] {
            let ps = vec![p; rows];
            for masked in [false, true] {
                let mut times = vec![];
                for _ in 0..15 {
                    let t = Instant::now();
                    if masked {
                        d.g.htod(&masks, &mut dm, 0).unwrap();
                    }
                    let mp = if masked { dm.ptr } else { 0 };
                    // SAFETY: live allocations of this test sized for the launch; synchronised below.
                    unsafe { d.k.launch(&d.g, dl.ptr, vocab, vocab, &ps, mp, out.ptr) }.unwrap();
                    d.g.sync().unwrap();
                    times.push(t.elapsed().as_secs_f64() * 1e6);
                }
                times.sort_by(f64::total_cmp);
                eprintln!(
                    "sample_rows vocab {vocab}, {rows} rows, {name}, {}: {:.0} µs per launch (median of 15)",
                    if masked { "masked (with the mask upload)" } else { "unmasked" },
                    times[7]
                );
            }
        }
    }
}
