//! The CPU backend's kernels as its forward pass runs them (`cpu/step.rs`): the threaded,
//! tiled matmul with its four-row and four-token SIMD dot products over 8-bit activations, the
//! row-parallel RMSNorm, the FMA RoPE and polynomial-exp SwiGLU, and the paged attention with
//! its fused K/V write, on a pool of two threads.

use half::f16;
use quire_backend::cpu::attention::{paged_attention, AttnParams};
use quire_backend::cpu::matmul::{matmul, Activations, QMatrix};
use quire_backend::cpu::ops as cpu_ops;
use quire_backend::cpu::quant::{needs_q8, supported_matmul_type};
use quire_backend::HostTensor;
use quire_gguf::GgmlType;

use super::{AttnCase, AttnOut, MatmulForm, OpResult, Operand, Ops, Prec, QkvCase, Skip};

pub struct CpuOps {
    pool: rayon::ThreadPool,
}

impl CpuOps {
    pub fn new() -> Self {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("a two-thread pool");
        Self { pool }
    }
}

impl Ops for CpuOps {
    fn matmul_form(&self, dtype: GgmlType, _n: usize) -> OpResult<MatmulForm> {
        if !supported_matmul_type(dtype) {
            return Err(Skip(format!("no CPU matmul for {}", dtype.name())));
        }
        // Integer dot products over 8-bit activations for quantized weights (llama.cpp's
        // numerics); float weights meet f32 activations.
        let act = if needs_q8(dtype) {
            Operand::Q8
        } else {
            Operand::Exact
        };
        Ok(MatmulForm {
            weights: Operand::Exact,
            act,
        })
    }

    fn matmul(
        &mut self,
        w: &HostTensor,
        x: &[f32],
        n: usize,
        add: Option<&[f32]>,
    ) -> OpResult<Vec<f32>> {
        let q = QMatrix::from_tensor(w, w.row_len(), w.rows())
            .map_err(|e| Skip(format!("the CPU refuses the matrix: {e}")))?;
        let mut act = Activations::default();
        act.prepare(&self.pool, x, q.cols, q.dtype);
        let mut y = vec![f32::NAN; n * q.rows];
        matmul(&self.pool, &q, x, &act, &mut y);
        if let Some(a) = add {
            // The forward adds the residual after the product (`cpu/step.rs`).
            cpu_ops::add_in_place(&mut y, a);
        }
        Ok(y)
    }

    fn embed(&mut self, w: &HostTensor, tokens: &[u32]) -> OpResult<Vec<f32>> {
        let q = QMatrix::from_tensor(w, w.row_len(), w.rows())
            .map_err(|e| Skip(format!("the CPU refuses the table: {e}")))?;
        let mut out = vec![f32::NAN; tokens.len() * q.cols];
        for (t, &tok) in tokens.iter().enumerate() {
            q.dequantize_row(tok as usize, &mut out[t * q.cols..(t + 1) * q.cols]);
        }
        Ok(out)
    }

    fn rms_norm(&mut self, x: &[f32], w: &[f32], eps: f32) -> OpResult<(Vec<f32>, Prec)> {
        let mut out = vec![f32::NAN; x.len()];
        cpu_ops::rms_norm_par(&self.pool, x, w, eps, &mut out);
        Ok((out, Prec::F32))
    }

    fn qkv_post(&mut self, c: &QkvCase) -> OpResult<Vec<f32>> {
        let h = c.heads;
        let pairs = c.pairs();
        let mut out = c.qkv.clone();
        for (t, row) in out.chunks_exact_mut(h.stride()).enumerate() {
            if let Some(b) = &c.bias {
                cpu_ops::add_in_place(row, b);
            }
            let (q, rest) = row.split_at_mut(h.q_size());
            let k = &mut rest[..h.kv_size()];
            if let Some((qn, kn)) = &c.norms {
                cpu_ops::rms_norm_heads(q, qn, c.eps);
                cpu_ops::rms_norm_heads(k, kn, c.eps);
            }
            let cs = &c.cs[t * pairs..(t + 1) * pairs];
            cpu_ops::rope(q, h.dim, cs, c.style);
            cpu_ops::rope(k, h.dim, cs, c.style);
        }
        Ok(out)
    }

    fn swiglu(&mut self, gu: &[f32], inter: usize) -> OpResult<(Vec<f32>, Prec)> {
        let mut out = vec![f32::NAN; gu.len() / 2];
        cpu_ops::swiglu(gu, inter, &mut out);
        Ok((out, Prec::F32))
    }

    fn argmax(&mut self, logits: &[f32], vocab: usize) -> OpResult<Vec<u32>> {
        Ok(logits
            .chunks_exact(vocab)
            .map(quire_backend::argmax)
            .collect())
    }

    fn attention(&mut self, c: &AttnCase) -> OpResult<AttnOut> {
        let h = c.heads;
        let b = &c.batch;
        let p = AttnParams {
            num_heads: h.q,
            num_kv_heads: h.kv,
            head_dim: h.dim,
            block_size: b.block_size,
            scale: 1.0 / (h.dim as f32).sqrt(),
            // f32 accumulation; the f16 accumulator (llama.cpp's numerics, the executor's
            // default) has its own tests in cpu/attention.
            f16_accum: false,
            sliding_window: c.window,
        };
        if h.dim > 256 || b.block_size * (h.q / h.kv) > 128 * 16 {
            return Err(Skip(format!(
                "the CPU kernel takes head dims to 256 and block size × GQA group to 2048 \
                 ({} and {})",
                h.dim,
                b.block_size * (h.q / h.kv)
            )));
        }
        let (mut k, mut v): (Vec<f16>, Vec<f16>) = (b.k_cache.clone(), b.v_cache.clone());
        let mut out = vec![f32::NAN; b.tokens() * h.q_size()];
        let seqs = c.seq_batches();
        paged_attention(
            &self.pool,
            &p,
            &c.q,
            h.q_size(),
            &b.k_new,
            &b.v_new,
            h.kv_size(),
            &b.slot_mapping,
            &seqs,
            &mut k,
            &mut v,
            &mut out,
        );
        Ok(AttnOut {
            out,
            k_cache: k,
            v_cache: v,
            prec: Prec::F32,
        })
    }
}
