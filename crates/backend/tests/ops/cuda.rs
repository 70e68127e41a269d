//! The CUDA backend's kernels, launched as its forward pass launches them (`cuda/forward.rs`,
//! `cuda/load.rs`): quantized weights through 8-bit activations quantized on the device and the
//! dp4a matmuls, f16 weights through quire's GEMV (one token) or cuBLAS (several), the f16
//! embedding gather and the quantized one, RMSNorm and SwiGLU into f16, `rope_qkv`, the split
//! argmax, and paged attention with its fused K/V write (`HostRun`).

use cudarc::driver::{CudaFunction, DeviceRepr};
use half::f16;
use quire_backend::cuda::attention::{HostRun, PagedAttention};
use quire_backend::cuda::gemv::{Gemv, GemvInput};
use quire_backend::cuda::gpu::{DBuf, Gpu, KArg};
use quire_backend::cuda::nvrtc;
use quire_backend::cuda::qmat::{QuantKernels, Q8A_BYTES};
use quire_backend::cuda::sample::{argmax_ctas, ARGMAX_MAX_CTAS};
use quire_backend::{BackendError, ForwardBatch, HostTensor};
use quire_core::RopeStyle;
use quire_gguf::GgmlType;

use super::{AttnCase, AttnOut, MatmulForm, OpResult, Operand, Ops, Prec, QkvCase, Skip};

pub struct CudaOps {
    g: Gpu,
    q: QuantKernels,
    gemv: Gemv,
    rms_norm: CudaFunction,
    embed: CudaFunction,
    swiglu: CudaFunction,
    rope: CudaFunction,
    argmax: CudaFunction,
}

/// A device error fails the test (it is not a skip).
fn ok<T>(r: Result<T, BackendError>) -> T {
    r.unwrap_or_else(|e| panic!("CUDA: {e}"))
}

impl CudaOps {
    pub fn new() -> Self {
        let g = Gpu::new(0).unwrap_or_else(|e| quire_testkit::no_gpu(&e));
        let f = |src: &nvrtc::KernelSource, name: &str| {
            ok(g.module(src, &[]).and_then(|m| Gpu::function(&m, name)))
        };
        Self {
            rms_norm: f(&nvrtc::NORM, "rms_norm_f16"),
            embed: f(&nvrtc::EMBED, "embed_f16"),
            swiglu: f(&nvrtc::ACTIVATION, "swiglu_f16"),
            rope: f(&nvrtc::ROPE, "rope_qkv"),
            argmax: f(&nvrtc::SAMPLE, "argmax_split"),
            q: ok(QuantKernels::new(&g)),
            gemv: ok(Gemv::new(&g)),
            g,
        }
    }

    fn read<T: DeviceRepr + Default + Clone>(&self, b: &DBuf<T>) -> Vec<T> {
        let mut v = vec![T::default(); b.len];
        ok(self.g.dtoh(b, &mut v));
        v
    }

    fn read_f16(&self, b: &DBuf<f16>) -> Vec<f32> {
        self.read(b).into_iter().map(f16::to_f32).collect()
    }

    fn is_quantized(t: GgmlType) -> bool {
        matches!(
            t,
            GgmlType::Q4_0
                | GgmlType::Q4_1
                | GgmlType::Q8_0
                | GgmlType::Q4_K
                | GgmlType::Q5_K
                | GgmlType::Q6_K
        )
    }
}

/// F32 and BF16 weights never reach a kernel: the loader converts them to f16.
fn converted_at_load(t: GgmlType) -> Skip {
    Skip(format!(
        "{} weights are converted to f16 at load (cuda/load.rs); the F16 case runs the kernels",
        t.name()
    ))
}

impl Ops for CudaOps {
    fn matmul_form(&self, dtype: GgmlType, _n: usize) -> OpResult<MatmulForm> {
        match dtype {
            t if Self::is_quantized(t) => Ok(MatmulForm {
                weights: Operand::Exact,
                act: Operand::Q8,
            }),
            GgmlType::F16 => Ok(MatmulForm {
                weights: Operand::Exact,
                act: Operand::F16,
            }),
            t => Err(converted_at_load(t)),
        }
    }

    fn matmul(
        &mut self,
        w: &HostTensor,
        x: &[f32],
        n: usize,
        add: Option<&[f32]>,
    ) -> OpResult<Vec<f32>> {
        let (cols, rows) = (w.row_len(), w.rows());
        let g = &self.g;
        let (y0, beta) = match add {
            Some(a) => (a.to_vec(), 1.0),
            None => (vec![f32::NAN; n * rows], 0.0),
        };
        let dy = ok(g.upload(&y0));
        let dw = ok(g.upload(w.bytes.as_slice()));
        if Self::is_quantized(w.dtype) {
            let dx = ok(g.upload(x));
            let dq = ok(g.alloc::<u8>(n * cols / 32 * Q8A_BYTES));
            // SAFETY: every address is a live allocation made above, sized for these shapes
            // (x [n, cols] f32, its 8-bit blocks, w rows × cols of its type, y [n, rows]), and
            // `read` synchronises the stream before any of them drops.
            unsafe {
                ok(self.q.quantize(g, dx.ptr, true, dq.ptr, n, cols));
                ok(self
                    .q
                    .matmul(g, w.dtype, dw.ptr, dq.ptr, dy.ptr, n, cols, rows, beta));
            }
            return Ok(self.read(&dy));
        }
        if w.dtype != GgmlType::F16 {
            return Err(converted_at_load(w.dtype));
        }
        let x16: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        let dx = ok(g.upload(&x16));
        let input = GemvInput::F16 { x: dx.ptr };
        // SAFETY: as above: x [n, cols] f16, w [rows, cols] f16, y [n, rows] f32, all live
        // until `read` has synchronised the stream.
        unsafe {
            if n == 1 && self.gemv.fits(cols, &input) {
                ok(self.gemv.run(g, dw.ptr, input, dy.ptr, cols, rows, beta));
            } else {
                ok(g.gemm_f16(dx.ptr, dw.ptr, dy.ptr, n, cols, rows, beta));
            }
        }
        Ok(self.read(&dy))
    }

    fn embed(&mut self, w: &HostTensor, tokens: &[u32]) -> OpResult<Vec<f32>> {
        let (cols, n) = (w.row_len(), tokens.len());
        let g = &self.g;
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let (dt, di) = (ok(g.upload(w.bytes.as_slice())), ok(g.upload(&ids)));
        let dx = ok(g.upload(&vec![f32::NAN; n * cols]));
        // SAFETY: the table [vocab, cols] of its type, the ids [n] (each inside the table) and
        // the output [n, cols] f32 are live allocations made above; `read` synchronises.
        unsafe {
            if Self::is_quantized(w.dtype) {
                ok(self.q.embed(g, w.dtype, di.ptr, dt.ptr, dx.ptr, n, cols));
            } else if w.dtype == GgmlType::F16 {
                let args = [
                    KArg::P(di.ptr),
                    KArg::P(dt.ptr),
                    KArg::P(dx.ptr),
                    KArg::I(cols as i32),
                ];
                ok(g.launch(&self.embed, (n as u32, 1, 1), (256, 1, 1), &args));
            } else {
                return Err(converted_at_load(w.dtype));
            }
        }
        Ok(self.read(&dx))
    }

    fn rms_norm(&mut self, x: &[f32], w: &[f32], eps: f32) -> OpResult<(Vec<f32>, Prec)> {
        let (dim, n) = (w.len(), x.len() / w.len());
        let g = &self.g;
        // The kernel reads its rows through an index (the forward gathers the rows whose logits
        // it wants): the rows go up in reverse and the index brings them back in order.
        let rev: Vec<f32> = x.chunks_exact(dim).rev().flatten().copied().collect();
        let idx: Vec<i32> = (0..n as i32).rev().collect();
        let (dx, dw, di) = (ok(g.upload(&rev)), ok(g.upload(w)), ok(g.upload(&idx)));
        let out = ok(g.upload(&vec![f16::NAN; n * dim]));
        let threads = (dim.div_ceil(32) * 32).min(1024) as u32;
        let args = [
            KArg::P(dx.ptr),
            KArg::P(di.ptr),
            KArg::P(dw.ptr),
            KArg::P(out.ptr),
            KArg::I(dim as i32),
            KArg::F(eps),
        ];
        // SAFETY: x [n, dim] f32, the index [n] (each < n), w [dim] and the output [n, dim] f16
        // are live allocations made above; `read_f16` synchronises.
        ok(unsafe { g.launch(&self.rms_norm, (n as u32, 1, 1), (threads, 1, 1), &args) });
        Ok((self.read_f16(&out), Prec::F16))
    }

    fn qkv_post(&mut self, c: &QkvCase) -> OpResult<Vec<f32>> {
        let (h, n, pairs) = (c.heads, c.tokens(), c.pairs());
        let g = &self.g;
        // The table is indexed by position: token t at position t, its row of `cs`.
        let cs: Vec<f32> = c.cs.iter().flat_map(|&(c, s)| [c, s]).collect();
        let positions: Vec<i32> = (0..n as i32).collect();
        let d = ok(g.upload(&c.qkv));
        let up = |v: Option<&Vec<f32>>| v.map(|v| ok(g.upload(v)));
        let db = up(c.bias.as_ref());
        let dqn = up(c.norms.as_ref().map(|n| &n.0));
        let dkn = up(c.norms.as_ref().map(|n| &n.1));
        let (dcs, dpos) = (ok(g.upload(&cs)), ok(g.upload(&positions)));
        let p = |x: &Option<DBuf<f32>>| KArg::P(x.as_ref().map_or(0, |b| b.ptr));
        let args = [
            KArg::P(d.ptr),
            p(&db),
            p(&dqn),
            p(&dkn),
            KArg::P(dcs.ptr),
            KArg::P(dpos.ptr),
            KArg::I(h.stride() as i32),
            KArg::I(h.q as i32),
            KArg::I(h.kv as i32),
            KArg::I(h.dim as i32),
            KArg::I(pairs as i32),
            KArg::I((c.style == RopeStyle::Neox) as i32),
            KArg::F(c.eps),
        ];
        let grid = (n as u32, (h.q + 2 * h.kv) as u32, 1);
        // SAFETY: the rows [n, stride], the optional bias [stride] and norms [dim] (0 when
        // absent, which the kernel skips), the table [n, pairs] and the positions [n] are live
        // allocations made above; `read` synchronises.
        ok(unsafe { g.launch(&self.rope, grid, (128, 1, 1), &args) });
        Ok(self.read(&d))
    }

    fn swiglu(&mut self, gu: &[f32], inter: usize) -> OpResult<(Vec<f32>, Prec)> {
        let total = gu.len() / 2;
        let g = &self.g;
        let dgu = ok(g.upload(gu));
        let out = ok(g.upload(&vec![f16::NAN; total]));
        let args = [
            KArg::P(dgu.ptr),
            KArg::P(out.ptr),
            KArg::I(inter as i32),
            KArg::L(total as i64),
        ];
        // SAFETY: gate/up [n, 2 inter] f32 and the output [n, inter] f16 are live allocations
        // made above; `read_f16` synchronises.
        let grid = (total.div_ceil(256) as u32, 1, 1);
        ok(unsafe { g.launch(&self.swiglu, grid, (256, 1, 1), &args) });
        Ok((self.read_f16(&out), Prec::F16))
    }

    fn argmax(&mut self, logits: &[f32], vocab: usize) -> OpResult<Vec<u32>> {
        let rows = logits.len() / vocab;
        let g = &self.g;
        let dl = ok(g.upload(logits));
        let out = ok(g.upload(&vec![-1i32; rows]));
        let part = ok(g.alloc::<f32>(rows * ARGMAX_MAX_CTAS * 2));
        let counters = ok(g.upload(&vec![0i32; rows]));
        let args = [
            KArg::P(dl.ptr),
            KArg::I(vocab as i32),
            KArg::P(out.ptr),
            KArg::P(part.ptr),
            KArg::P(counters.ptr),
        ];
        let grid = (argmax_ctas(vocab) as u32, rows as u32, 1);
        // SAFETY: logits [rows, vocab], the output [rows], the slices [rows, MAX_CTAS] and
        // the zeroed counters [rows] are live allocations made above; `read` synchronises.
        ok(unsafe { g.launch(&self.argmax, grid, (256, 1, 1), &args) });
        Ok(self.read(&out).into_iter().map(|t| t as u32).collect())
    }

    fn attention(&mut self, c: &AttnCase) -> OpResult<AttnOut> {
        let (h, b) = (c.heads, &c.batch);
        let g = &self.g;
        let a = PagedAttention::new(g, h.q, h.kv, h.dim)
            .map_err(|e| Skip(e.to_string()))?
            .with_window(c.window);
        // float4 loads need 16-byte rows; the padding also keeps rows from being packed.
        let stride = (h.stride() + 3).div_ceil(4) * 4;
        let qkv = c.qkv(stride);
        let tok = vec![0u32; b.tokens()];
        let seqs = c.seq_batches();
        let batch = ForwardBatch {
            token_ids: &tok,
            positions: &b.positions,
            slot_mapping: &b.slot_mapping,
            seqs: &seqs,
            logits_indices: &[],
        };
        let mut run = ok(HostRun::new(
            g,
            &a,
            &qkv,
            stride,
            &batch,
            b.block_size,
            &b.k_cache,
            &b.v_cache,
        ));
        // f32 output rows, as when the o-projection quantizes them.
        run.out_f32 = true;
        ok(run.launch(g, &a));
        let (out, k_cache, v_cache) = ok(run.read(g));
        Ok(AttnOut {
            out,
            k_cache,
            v_cache,
            prec: Prec::F16,
        })
    }
}
