//! Single kernels run on host data: the entry of the kernel parity tests (each kernel against a
//! plain CPU reference on random inputs) and of tools that time one kernel. Slow by design
//! (fresh buffers per call); the executor never uses it.

use half::f16;

use super::gemm::{GemmKernels, GemmPath, Split};
use super::gpu::Gpu;
use super::kernels::{self, bind, Dispatch, HeadShape, Kernels, MmShape, Params};
use super::weights::DMatrix;
use crate::{BackendError, HostTensor};

pub struct Probe {
    pub gpu: Gpu,
    pub k: Kernels,
}

fn bytes_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bytes_u32(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn to_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn to_u32(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The attention kernel's inputs for one step.
pub struct AttnInput<'a> {
    pub shape: HeadShape,
    pub block_size: usize,
    /// 0: no window.
    pub window: usize,
    /// [n, q + 2kv] f32: each token's Q, K and V.
    pub qkv: &'a [f32],
    /// [slots, kv_heads, head_dim] f16 each.
    pub k_cache: &'a [f16],
    pub v_cache: &'a [f16],
    /// Per token: position, slot, first new position of its sequence, batch row of that
    /// token, offset of its block table in `tables`.
    pub tokens: &'a [[u32; 5]],
    pub tables: &'a [u32],
    /// Decode rows: the split to run instead of the executor's plan, and the keys per key group
    /// and step instead of the kernel's own (for benchmarks comparing them; `None`: as the
    /// executor runs it).
    pub plan: Option<kernels::SplitPlan>,
    pub keys: Option<usize>,
}

/// The attention kernels of one step on the device, ready to run.
pub struct AttnRun {
    pub list: Vec<Dispatch>,
    /// The split of the decode kernels, or `None` for the general kernel.
    pub plan: Option<kernels::SplitPlan>,
    kc: wgpu::Buffer,
    vc: wgpu::Buffer,
    out: wgpu::Buffer,
    out_words: usize,
    cache_halves: usize,
    /// Bytes moved and FLOPs of one run (as the profile counts them).
    pub bytes: u64,
    pub flops: u64,
    _keep: [wgpu::Buffer; 4],
    _scratch: Vec<wgpu::Buffer>,
}

/// The attention kernel's outputs: `[n, q]` f32, and the caches after its KV write.
pub struct AttnOutput {
    pub out: Vec<f32>,
    pub k_cache: Vec<f16>,
    pub v_cache: Vec<f16>,
}

impl Probe {
    pub fn new(adapter: Option<&str>) -> Result<Probe, BackendError> {
        let gpu = Gpu::new(adapter)?;
        let mut k = Kernels::new(&gpu)?;
        // Every GEMM blocking, not only the engine's: tests check them all, benchmarks compare.
        k.gemm = GemmKernels::all(&gpu)?;
        Ok(Probe { gpu, k })
    }

    fn input(&mut self, what: &str, data: &[u8]) -> Result<wgpu::Buffer, BackendError> {
        self.gpu.upload(what, data)
    }

    /// An output buffer of `words` words, filled with NaN (so an element never written shows).
    fn output(&mut self, what: &str, words: usize) -> Result<wgpu::Buffer, BackendError> {
        let nan = vec![f32::NAN; words.max(1)];
        let usage = wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_DST
            | wgpu::BufferUsages::COPY_SRC;
        let b = self.gpu.buffer(what, (words.max(1) * 4) as u64, usage)?;
        self.gpu.queue.write_buffer(&b, 0, &bytes_f32(&nan));
        Ok(b)
    }

    /// Runs one dispatch of `pipe` and waits for it.
    fn run(
        &mut self,
        pipe: &wgpu::ComputePipeline,
        params: Params,
        buffers: &[(u32, &wgpu::Buffer)],
        groups: [u32; 3],
    ) -> Result<(), BackendError> {
        let pbuf = self.gpu.buffer(
            "probe parameters",
            64,
            wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        )?;
        self.gpu.queue.write_buffer(&pbuf, 0, &bytes_u32(&params));
        let bind = bind(&self.gpu, pipe, (&pbuf, 0), buffers);
        let mut enc = self.gpu.device.create_command_encoder(&Default::default());
        kernels::encode(
            &mut enc,
            &[Dispatch {
                name: "probe",
                pipe: pipe.clone(),
                bind,
                groups,
                bytes: 0,
                flops: 0,
            }],
        );
        self.gpu.submit_wait(enc.finish())
    }

    /// The GEMM path [`Probe::matmul`] takes for weights of `dtype` over `n` tokens, as the
    /// executor picks it (`step::mm_kernel`, asked here rather than restated), or `None` for the
    /// GEMV. Tests use it to say how the operands are rounded: the cooperative-matrix GEMM stages
    /// weights and activations as f16 fragments; the tiled GEMM and the GEMV multiply the
    /// dequantized weights and f32 activations as they are.
    pub fn matmul_path(&self, dtype: quire_gguf::GgmlType, n: usize) -> Option<GemmPath> {
        use quire_gguf::GgmlType as G;
        let t = match dtype {
            // Converted to f16 when uploaded.
            G::F16 | G::F32 | G::BF16 => kernels::WType::F16,
            G::Q8_0 => kernels::WType::Q8_0,
            G::Q4_0 => kernels::WType::Q4_0,
            G::Q4_1 => kernels::WType::Q4_1,
            G::Q4_K => kernels::WType::Q4_K,
            G::Q5_K => kernels::WType::Q5_K,
            G::Q6_K => kernels::WType::Q6_K,
            _ => return None,
        };
        let s = MmShape {
            rows: 1,
            cols: t.block().0,
            n,
            x_stride: t.block().0,
            y_stride: 1,
            y_off: 0,
            add: false,
            row_words: t.row_words(t.block().0),
            row0: 0,
        };
        match super::step::mm_kernel(&self.k, t, &s) {
            super::step::Mm::Gemm { path, .. } => Some(path),
            super::step::Mm::Gemv(..) => None,
        }
    }

    /// `x` · `w`ᵀ: `w` a `[rows, cols]` tensor (ggml order: dims [cols, rows]), `x` `[n, cols]`.
    /// Returns `[n, rows]`.
    pub fn matmul(
        &mut self,
        w: &HostTensor,
        x: &[f32],
        n: usize,
    ) -> Result<Vec<f32>, BackendError> {
        self.matmul_add(w, x, n, None)
    }

    /// [`Probe::matmul`] in its residual form when `add` (`[n, rows]`) is given: the product
    /// added into those values, as the layer's output projections do.
    pub fn matmul_add(
        &mut self,
        w: &HostTensor,
        x: &[f32],
        n: usize,
        add: Option<&[f32]>,
    ) -> Result<Vec<f32>, BackendError> {
        let (cols, rows) = (w.row_len(), w.rows());
        let m = DMatrix::stack(&mut self.gpu, &w.name, &[w], cols)?;
        let xb = self.input("x", &bytes_f32(x))?;
        let y = self.output("y", n * rows)?;
        if let Some(a) = add {
            self.gpu.queue.write_buffer(&y, 0, &bytes_f32(a));
        }
        for part in &m.parts {
            let s = MmShape {
                rows: part.rows,
                cols,
                n,
                x_stride: cols,
                y_stride: rows,
                y_off: part.y_off,
                add: add.is_some(),
                row_words: part.ty.row_words(cols),
                row0: part.row0,
            };
            match super::step::mm_kernel(&self.k, part.ty, &s) {
                super::step::Mm::Gemm { path, split, .. } => {
                    self.gemm_part(path, split, part, &s, &xb, &y)?;
                }
                super::step::Mm::Gemv(pipe, groups) => {
                    let pipe = pipe.clone();
                    let bufs = [(1, &part.buf), (2, &xb), (3, &y)];
                    self.run(&pipe, s.params(), &bufs, groups)?;
                }
            }
        }
        Ok(to_f32(&self.gpu.download(&y, (n * rows * 4) as u64)?))
    }

    /// The decode GEMV with the SwiGLU fused into its input: `x` · `w`ᵀ where row t of `x` is
    /// silu(gate) · up of row t of `gu` (`[n, 2 cols]`, `[gate | up]`), as a decode step's down
    /// projection runs. Returns `[n, rows]`.
    pub fn matmul_swiglu(
        &mut self,
        w: &HostTensor,
        gu: &[f32],
        n: usize,
    ) -> Result<Vec<f32>, BackendError> {
        let (cols, rows) = (w.row_len(), w.rows());
        let m = DMatrix::stack(&mut self.gpu, &w.name, &[w], cols)?;
        let xb = self.input("gate_up", &bytes_f32(gu))?;
        let y = self.output("y", n * rows)?;
        for part in &m.parts {
            let s = MmShape {
                rows: part.rows,
                cols,
                n,
                x_stride: 2 * cols,
                y_stride: rows,
                y_off: part.y_off,
                add: false,
                row_words: part.ty.row_words(cols),
                row0: part.row0,
            };
            let pipe = self.k.matmul_swiglu(part.ty).clone();
            let bufs = [(1, &part.buf), (2, &xb), (3, &y)];
            self.run(&pipe, s.params(), &bufs, s.matmul_groups())?;
        }
        Ok(to_f32(&self.gpu.download(&y, (n * rows * 4) as u64)?))
    }

    /// The prompt GEMM through `path`: `y` (`[n, y_stride]`, given) (+)= `x` · `w`ᵀ into its
    /// columns `y_off..y_off + rows`, `x` `[n, x_stride]` of which the first `w.row_len()`
    /// columns are read, split over columns as `split` (`None`: as the path splits this shape).
    /// Returns the whole `y`; `None` where the device lacks `path`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &mut self,
        path: GemmPath,
        split: Option<Split>,
        w: &HostTensor,
        x: &[f32],
        x_stride: usize,
        n: usize,
        y: &[f32],
        y_stride: usize,
        y_off: usize,
        add: bool,
    ) -> Result<Option<Vec<f32>>, BackendError> {
        let cols = w.row_len();
        let m = DMatrix::stack(&mut self.gpu, &w.name, &[w], cols)?;
        let xb = self.input("x", &bytes_f32(x))?;
        let yb = self.output("y", y.len())?;
        self.gpu.queue.write_buffer(&yb, 0, &bytes_f32(y));
        for part in &m.parts {
            let s = MmShape {
                rows: part.rows,
                cols,
                n,
                x_stride,
                y_stride,
                y_off: y_off + part.y_off,
                add,
                row_words: part.ty.row_words(cols),
                row0: part.row0,
            };
            if self.k.gemm.pipe(path, part.ty).is_none() {
                return Ok(None);
            }
            let split = split.unwrap_or_else(|| path.split(part.ty, &s));
            self.gemm_part(path, split, part, &s, &xb, &yb)?;
        }
        let out = self.gpu.download(&yb, (y.len() * 4) as u64)?;
        Ok(Some(to_f32(&out)))
    }

    /// One part's GEMM over `s` through `path` split as `split`, then the reduce of a split
    /// (its partial sums in a NaN-filled buffer of their own).
    fn gemm_part(
        &mut self,
        path: GemmPath,
        split: Split,
        part: &super::weights::Part,
        s: &MmShape,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
    ) -> Result<(), BackendError> {
        let pipe = self
            .k
            .gemm
            .pipe(path, part.ty)
            .cloned()
            .ok_or_else(|| BackendError::Wgpu(format!("no GEMM path {}", path.name())))?;
        let partials = self.output("partial sums", split.slices as usize * s.n * s.rows)?;
        let bufs = [(1, &part.buf), (2, x), (3, y), (4, &partials)];
        self.run(&pipe, split.params(s), &bufs, path.groups(s, split))?;
        if split.is_split() {
            let (p, groups) = split.reduce(s);
            let pipe = self.k.gemm.reduce.clone();
            self.run(&pipe, p, &[(3, y), (4, &partials)], groups)?;
        }
        self.gpu.release(&partials);
        Ok(())
    }

    /// The embedding rows of `tokens` from `w` (`[vocab, cols]`): `[tokens, cols]`.
    pub fn embed(&mut self, w: &HostTensor, tokens: &[u32]) -> Result<Vec<f32>, BackendError> {
        let cols = w.row_len();
        let m = DMatrix::stack(&mut self.gpu, &w.name, &[w], cols)?;
        let tb = self.input("tokens", &bytes_u32(tokens))?;
        let n = tokens.len();
        let y = self.output("y", n * cols)?;
        for part in &m.parts {
            let s = MmShape {
                rows: part.rows,
                cols,
                n,
                x_stride: 0,
                y_stride: cols,
                y_off: 0,
                add: false,
                row_words: part.ty.row_words(cols),
                row0: part.row0,
            };
            let pipe = self.k.embed(part.ty).clone();
            let bufs = [(1, &part.buf), (3, &y), (4, &tb)];
            self.run(&pipe, s.params(), &bufs, s.embed_groups(part.ty))?;
        }
        Ok(to_f32(&self.gpu.download(&y, (n * cols * 4) as u64)?))
    }

    /// RMSNorm of each row of `x` (`[n, w.len()]`).
    pub fn rms_norm(&mut self, x: &[f32], w: &[f32], eps: f32) -> Result<Vec<f32>, BackendError> {
        let n = x.len() / w.len();
        let xb = self.input("x", &bytes_f32(x))?;
        let wb = self.input("w", &bytes_f32(w))?;
        let ib = self.input("idx", &[0u8; 4])?;
        let y = self.output("y", x.len())?;
        let pipe = self.k.rms_norm.clone();
        let p = kernels::rms_params(w.len(), n, eps, false);
        self.run(
            &pipe,
            p,
            &[(1, &xb), (2, &wb), (3, &y), (4, &ib)],
            [n as u32, 1, 1],
        )?;
        Ok(to_f32(&self.gpu.download(&y, (x.len() * 4) as u64)?))
    }

    /// Bias, QK-norm and RoPE on `qkv` (`[n, q + 2kv]`); `cs` `[n, pairs]` (cos, sin).
    #[allow(clippy::too_many_arguments)]
    pub fn qkv_post(
        &mut self,
        shape: HeadShape,
        qkv: &[f32],
        bias: Option<&[f32]>,
        norms: Option<(&[f32], &[f32])>,
        cs: &[(f32, f32)],
        neox: bool,
        eps: f32,
    ) -> Result<Vec<f32>, BackendError> {
        let n = qkv.len() / shape.stride();
        let pairs = cs.len() / n.max(1);
        let qb = self.output("qkv", qkv.len())?;
        self.gpu.queue.write_buffer(&qb, 0, &bytes_f32(qkv));
        let zero = [0f32; 4];
        let bb = self.input("bias", &bytes_f32(bias.unwrap_or(&zero)))?;
        let (qn, kn) = norms.unwrap_or((&zero, &zero));
        let qnb = self.input("q_norm", &bytes_f32(qn))?;
        let knb = self.input("k_norm", &bytes_f32(kn))?;
        let flat: Vec<f32> = cs.iter().flat_map(|&(c, s)| [c, s]).collect();
        let csb = self.input(
            "cs",
            &bytes_f32(if flat.is_empty() { &zero } else { &flat }),
        )?;
        let p = kernels::qkv_params(&shape, n, pairs, neox, bias.is_some(), norms.is_some(), eps);
        let pipe = self.k.qkv_post.clone();
        let bufs = [(1, &qb), (2, &bb), (3, &qnb), (4, &knb), (5, &csb)];
        self.run(&pipe, p, &bufs, kernels::qkv_groups(&shape, n))?;
        Ok(to_f32(&self.gpu.download(&qb, (qkv.len() * 4) as u64)?))
    }

    /// The fused KV write and paged attention of one step (the split decode kernels when every
    /// token is its sequence's only new one, as the executor picks them).
    pub fn attention(&mut self, a: &AttnInput) -> Result<AttnOutput, BackendError> {
        let run = self.attention_run(a)?;
        let mut enc = self.gpu.device.create_command_encoder(&Default::default());
        kernels::encode(&mut enc, &run.list);
        self.gpu.submit_wait(enc.finish())?;
        self.attention_read(&run)
    }

    /// The attention kernels' buffers and dispatches for `a`, ready to run (and time) again and
    /// again: the KV write is idempotent.
    pub fn attention_run(&mut self, a: &AttnInput) -> Result<AttnRun, BackendError> {
        let n = a.tokens.len();
        let f16_words = |c: &[f16]| -> Vec<u8> { c.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let usage = wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_DST
            | wgpu::BufferUsages::COPY_SRC;
        let mut cache = |what: &str, c: &[f16]| -> Result<wgpu::Buffer, BackendError> {
            let b = self.gpu.buffer(what, (c.len() * 2) as u64, usage)?;
            self.gpu.queue.write_buffer(&b, 0, &f16_words(c));
            Ok(b)
        };
        let kc = cache("k cache", a.k_cache)?;
        let vc = cache("v cache", a.v_cache)?;
        let qb = self.input("qkv", &bytes_f32(a.qkv))?;
        let mut tok = vec![0u32; n * kernels::TOK_WORDS];
        for (i, t) in a.tokens.iter().enumerate() {
            tok[i * kernels::TOK_WORDS..][..5].copy_from_slice(t);
        }
        let tiles = kernels::fill_tiles(&mut tok, self.k.attention.tile_tokens(&a.shape));
        let tb = self.input("tokens", &bytes_u32(&tok))?;
        let tab = self.input("tables", &bytes_u32(a.tables))?;
        let out = self.output("out", n * a.shape.q_size())?;
        let pbuf = self.gpu.buffer(
            "probe parameters",
            64,
            wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        )?;
        // Decode rows only: each token's first new position is its own, and it is its own row.
        let decode = a
            .tokens
            .iter()
            .enumerate()
            .all(|(i, t)| t[2] == t[0] && t[3] as usize == i);
        let window = a.window;
        let keys = |t: &[u32; 5]| {
            let k = t[0] as usize + 1;
            if window > 0 {
                k.min(window)
            } else {
                k
            }
        };
        let total: usize = a.tokens.iter().map(keys).sum();
        let (bytes, flops) = super::step::attn_cost(&a.shape, n, total);
        let mut scratch = Vec::new();
        let dispatch = |name, pipe: &wgpu::ComputePipeline, bind, groups, bytes, flops| Dispatch {
            name,
            pipe: pipe.clone(),
            bind,
            groups,
            bytes,
            flops,
        };
        let (list, plan) = if decode && n > 0 && kernels::split_fits(&a.shape) {
            let d = self.k.attn_split.kernel(&a.shape);
            let max_keys = a.tokens.iter().map(keys).max().unwrap_or(1);
            let plan = a.plan.unwrap_or_else(|| {
                kernels::SplitPlan::new(&d, &a.shape, n, max_keys, a.block_size)
            });
            let d = a.keys.map_or(d, |u| d.with_keys(u));
            let (pw, mw) = plan.scratch_words(&a.shape, n);
            let part = self.output("partials", pw + mw)?;
            let usage = wgpu::BufferUsages::STORAGE;
            let done =
                self.gpu
                    .buffer("range counters", (n * a.shape.kv_heads * 4) as u64, usage)?;
            let p = kernels::split_params(&a.shape, n, a.block_size, window, plan, pw);
            self.gpu.queue.write_buffer(&pbuf, 0, &bytes_u32(&p));
            let pipe = self.k.attn_split.pipe_of(&self.gpu, d)?;
            let b = bind(
                &self.gpu,
                &pipe,
                (&pbuf, 0),
                &[
                    (1, &qb),
                    (2, &kc),
                    (3, &vc),
                    (4, &tb),
                    (5, &tab),
                    (6, &part),
                    (7, &done),
                    (8, &out),
                ],
            );
            let list = vec![dispatch(
                "attn_decode",
                &pipe,
                b,
                kernels::split_groups(&a.shape, n, plan),
                bytes as u64,
                flops as u64,
            )];
            scratch.extend([part, done]);
            (list, Some(plan))
        } else {
            let p = self.k.attention.params(&a.shape, n, a.block_size, window);
            self.gpu.queue.write_buffer(&pbuf, 0, &bytes_u32(&p));
            let pipe = self.k.attention.pipe(&self.gpu, &a.shape)?;
            let b = bind(
                &self.gpu,
                &pipe,
                (&pbuf, 0),
                &[(1, &qb), (2, &kc), (3, &vc), (4, &tb), (5, &tab), (6, &out)],
            );
            let list = vec![dispatch(
                "attention",
                &pipe,
                b,
                kernels::attn_groups(&a.shape, tiles),
                bytes as u64,
                flops as u64,
            )];
            (list, None)
        };
        Ok(AttnRun {
            list,
            plan,
            kc,
            vc,
            out,
            out_words: n * a.shape.q_size(),
            cache_halves: a.k_cache.len(),
            bytes: bytes as u64,
            flops: flops as u64,
            _keep: [qb, tb, tab, pbuf],
            _scratch: scratch,
        })
    }

    /// The output and the caches of `run` after it ran.
    pub fn attention_read(&mut self, run: &AttnRun) -> Result<AttnOutput, BackendError> {
        let halves = |b: Vec<u8>| -> Vec<f16> {
            b.chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]))
                .collect()
        };
        let ch = (run.cache_halves * 2) as u64;
        Ok(AttnOutput {
            out: to_f32(&self.gpu.download(&run.out, (run.out_words * 4) as u64)?),
            k_cache: halves(self.gpu.download(&run.kc, ch)?),
            v_cache: halves(self.gpu.download(&run.vc, ch)?),
        })
    }

    /// Runs `list` `reps` times and returns each run's nanoseconds: by GPU timestamps (from the
    /// first dispatch's start to the last one's end) where the device has them, else by the wall
    /// clock around one submission per run. The bool says which.
    pub fn time(
        &mut self,
        list: &[Dispatch],
        reps: usize,
    ) -> Result<(Vec<f64>, bool), BackendError> {
        let k = list.iter().filter(|d| d.runs()).count().max(1);
        let per = (super::gpu::MAX_TIMED / k).max(1);
        let Some(timer) = self.gpu.timer(per * k)? else {
            let mut out = Vec::with_capacity(reps);
            for _ in 0..reps {
                let t = std::time::Instant::now();
                let mut enc = self.gpu.device.create_command_encoder(&Default::default());
                kernels::encode(&mut enc, list);
                self.gpu.submit_wait(enc.finish())?;
                out.push(t.elapsed().as_nanos() as f64);
            }
            return Ok((out, false));
        };
        let mut out = Vec::with_capacity(reps);
        while out.len() < reps {
            let m = per.min(reps - out.len());
            let all: Vec<Dispatch> = (0..m).flat_map(|_| list.iter().cloned()).collect();
            let mut enc = self.gpu.device.create_command_encoder(&Default::default());
            let order = kernels::encode_timed(&mut enc, &all, &timer);
            timer.resolve(&mut enc, order.len());
            self.gpu.submit_wait(enc.finish())?;
            let spans = timer.read_spans(&self.gpu, order.len())?;
            out.extend(spans.chunks_exact(k).map(|c| c[k - 1].1 - c[0].0));
        }
        Ok((out, true))
    }

    /// Runs `list` `per` times back to back in one compute pass, as a step runs its dispatches
    /// (wgpu orders them with the same barriers), `samples` times, and returns each sample's
    /// nanoseconds per run of `list`: by GPU timestamps at the pass's start and end where the
    /// device has them, else by the wall clock around the sample's submission (the bool says
    /// which). Unlike [`Probe::time`], no timestamp sits between the dispatches: on NVIDIA's
    /// Vulkan driver a timestamp inside a pass drains the GPU, which adds microseconds to every
    /// short dispatch it brackets.
    pub fn time_back_to_back(
        &mut self,
        list: &[Dispatch],
        per: usize,
        samples: usize,
    ) -> Result<(Vec<f64>, bool), BackendError> {
        let per = per.max(1);
        let all: Vec<Dispatch> = (0..per).flat_map(|_| list.iter().cloned()).collect();
        let Some(timer) = self.gpu.timer(samples.clamp(1, super::gpu::MAX_TIMED))? else {
            let mut out = Vec::with_capacity(samples);
            for _ in 0..samples {
                let t = std::time::Instant::now();
                let mut enc = self.gpu.device.create_command_encoder(&Default::default());
                kernels::encode(&mut enc, &all);
                self.gpu.submit_wait(enc.finish())?;
                out.push(t.elapsed().as_nanos() as f64 / per as f64);
            }
            return Ok((out, false));
        };
        let mut out = Vec::with_capacity(samples);
        while out.len() < samples {
            let m = timer.cap.min(samples - out.len());
            let mut enc = self.gpu.device.create_command_encoder(&Default::default());
            for k in 0..m {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("back to back"),
                    timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                        query_set: &timer.set,
                        beginning_of_pass_write_index: Some(2 * k as u32),
                        end_of_pass_write_index: Some(2 * k as u32 + 1),
                    }),
                });
                kernels::record_all(&mut pass, &all);
            }
            timer.resolve(&mut enc, m);
            self.gpu.submit_wait(enc.finish())?;
            let ns = timer.read(&self.gpu, m)?;
            out.extend(ns.iter().map(|t| t / per as f64));
        }
        Ok((out, true))
    }

    /// The adapter's read bandwidth: a buffer of up to `bytes` (at most one binding) read
    /// `reps` times by 16-byte loads. Returns (bytes read per run, seconds per run, GPU timed).
    pub fn read_bandwidth(
        &mut self,
        bytes: u64,
        reps: usize,
    ) -> Result<(u64, Vec<f64>, bool), BackendError> {
        let size = bytes.min(self.gpu.max_binding()) / 16 * 16;
        let words = (size / 16) as u32;
        let src = self
            .gpu
            .buffer("bandwidth source", size, wgpu::BufferUsages::STORAGE)?;
        let per_group = 4096u32;
        let groups = words.div_ceil(per_group);
        let sums = self.output("bandwidth sums", groups as usize)?;
        let pipe = self.gpu.pipeline("read_bw", kernels::READ_BW, "main")?;
        let pbuf = self.gpu.buffer(
            "probe parameters",
            64,
            wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        )?;
        let mut p = [0u32; 16];
        p[0] = words;
        p[1] = per_group;
        self.gpu.queue.write_buffer(&pbuf, 0, &bytes_u32(&p));
        let b = bind(&self.gpu, &pipe, (&pbuf, 0), &[(1, &src), (2, &sums)]);
        let d = Dispatch {
            name: "read_bw",
            pipe,
            bind: b,
            groups: [groups, 1, 1],
            bytes: size,
            flops: 0,
        };
        // Warm-up of half a second at least: a GPU that was idle runs its first milliseconds at
        // low clocks (an H200 read at 1,883 GB/s after two warm-up runs, 4,445 when warm).
        let t = std::time::Instant::now();
        while t.elapsed().as_secs_f64() < 0.5 {
            self.time(std::slice::from_ref(&d), 20)?;
        }
        let (ns, gpu) = self.time(std::slice::from_ref(&d), reps)?;
        Ok((size, ns.iter().map(|t| t / 1e9).collect(), gpu))
    }

    /// silu(gate) · up of each row of `gu` (`[n, 2 inter]`, `[gate | up]`).
    pub fn swiglu(&mut self, gu: &[f32], inter: usize) -> Result<Vec<f32>, BackendError> {
        let n = gu.len() / (2 * inter);
        let gb = self.input("gu", &bytes_f32(gu))?;
        let y = self.output("y", n * inter)?;
        let pipe = self.k.swiglu.clone();
        let p = kernels::swiglu_params(n, inter);
        self.run(
            &pipe,
            p,
            &[(1, &gb), (2, &y)],
            kernels::swiglu_groups(n, inter),
        )?;
        Ok(to_f32(&self.gpu.download(&y, (n * inter * 4) as u64)?))
    }

    /// The argmax of each row of `logits` (`[rows, vocab]`).
    pub fn argmax(&mut self, logits: &[f32], vocab: usize) -> Result<Vec<u32>, BackendError> {
        let rows = logits.len() / vocab;
        let lb = self.input("logits", &bytes_f32(logits))?;
        let y = self.output("ids", rows)?;
        let pipe = self.k.argmax.clone();
        let p = kernels::argmax_params(rows, vocab);
        self.run(&pipe, p, &[(1, &lb), (2, &y)], [rows as u32, 1, 1])?;
        Ok(to_u32(&self.gpu.download(&y, (rows * 4) as u64)?))
    }
}
