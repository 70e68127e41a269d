//! The wgpu backend's kernels through its probe (`wgpu::probe`: one dispatch on fresh buffers,
//! the same pipelines the executor records).

use quire_backend::wgpu::gemm::GemmPath;
use quire_backend::wgpu::kernels::HeadShape;
use quire_backend::wgpu::probe::{AttnInput, Probe};
use quire_backend::HostTensor;
use quire_core::RopeStyle;
use quire_gguf::GgmlType;
use quire_testkit::Backend;

use super::{AttnCase, AttnOut, MatmulForm, OpResult, Operand, Ops, Prec, QkvCase, Skip};

pub struct WgpuOps {
    p: Probe,
}

impl WgpuOps {
    pub fn new() -> Self {
        let adapter = std::env::var("QUIRE_WGPU_ADAPTER").ok();
        let p = Probe::new(adapter.as_deref())
            .unwrap_or_else(|e| quire_testkit::missing(Backend::Wgpu, &e));
        Self { p }
    }
}

/// A device error fails the test (it is not a skip).
fn ok<T>(r: Result<T, quire_backend::BackendError>) -> T {
    r.unwrap_or_else(|e| panic!("wgpu: {e}"))
}

fn shape(h: super::Heads) -> HeadShape {
    HeadShape {
        q_heads: h.q,
        kv_heads: h.kv,
        head_dim: h.dim,
    }
}

impl Ops for WgpuOps {
    fn matmul_form(&self, dtype: GgmlType, n: usize) -> OpResult<MatmulForm> {
        let stored = match dtype {
            // Quantized blocks are dequantized in the kernel.
            GgmlType::F16
            | GgmlType::Q8_0
            | GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K => Operand::Exact,
            // Converted to f16 when uploaded.
            GgmlType::F32 | GgmlType::BF16 => Operand::F16,
            t => {
                return Err(Skip(format!(
                    "the wgpu backend has no {} kernel yet (refused at load)",
                    t.name()
                )))
            }
        };
        Ok(match self.p.matmul_path(dtype, n) {
            // The cooperative-matrix GEMM stages the dequantized weights and the activations as
            // f16 fragments.
            Some(GemmPath::Coop(..)) => MatmulForm {
                weights: Operand::F16,
                act: Operand::F16,
            },
            // The GEMV and the tiled GEMM: f32 activations, the weights as stored.
            Some(GemmPath::Tiled) | None => MatmulForm {
                weights: stored,
                act: Operand::Exact,
            },
        })
    }

    fn matmul(
        &mut self,
        w: &HostTensor,
        x: &[f32],
        n: usize,
        add: Option<&[f32]>,
    ) -> OpResult<Vec<f32>> {
        Ok(ok(self.p.matmul_add(w, x, n, add)))
    }

    fn embed(&mut self, w: &HostTensor, tokens: &[u32]) -> OpResult<Vec<f32>> {
        match w.dtype {
            GgmlType::F16
            | GgmlType::Q8_0
            | GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K => Ok(ok(self.p.embed(w, tokens))),
            t => Err(Skip(format!(
                "{} tables are converted to f16 at load or refused; no kernel reads them",
                t.name()
            ))),
        }
    }

    fn rms_norm(&mut self, x: &[f32], w: &[f32], eps: f32) -> OpResult<(Vec<f32>, Prec)> {
        Ok((ok(self.p.rms_norm(x, w, eps)), Prec::F32))
    }

    fn qkv_post(&mut self, c: &QkvCase) -> OpResult<Vec<f32>> {
        let s = shape(c.heads);
        s.check().map_err(|e| Skip(e.to_string()))?;
        let norms = c.norms.as_ref().map(|(q, k)| (&q[..], &k[..]));
        Ok(ok(self.p.qkv_post(
            s,
            &c.qkv,
            c.bias.as_deref(),
            norms,
            &c.cs,
            c.style == RopeStyle::Neox,
            c.eps,
        )))
    }

    fn swiglu(&mut self, gu: &[f32], inter: usize) -> OpResult<(Vec<f32>, Prec)> {
        Ok((ok(self.p.swiglu(gu, inter)), Prec::F32))
    }

    fn argmax(&mut self, logits: &[f32], vocab: usize) -> OpResult<Vec<u32>> {
        Ok(ok(self.p.argmax(logits, vocab)))
    }

    fn attention(&mut self, c: &AttnCase) -> OpResult<AttnOut> {
        let s = shape(c.heads);
        s.check().map_err(|e| Skip(e.to_string()))?;
        let b = &c.batch;
        let mut tables = Vec::new();
        let mut tokens = Vec::new();
        for seq in &b.seqs {
            let off = tables.len() as u32;
            tables.extend(seq.block_table.iter().map(|x| x.0));
            for i in 0..seq.query_len {
                let t = seq.query_start + i;
                tokens.push([
                    b.positions[t],
                    b.slot_mapping[t],
                    (seq.seq_len - seq.query_len) as u32,
                    seq.query_start as u32,
                    off,
                ]);
            }
        }
        let qkv = c.qkv(c.heads.stride());
        let out = ok(self.p.attention(&AttnInput {
            shape: s,
            block_size: b.block_size,
            window: c.window.unwrap_or(0),
            qkv: &qkv,
            k_cache: &b.k_cache,
            v_cache: &b.v_cache,
            tokens: &tokens,
            tables: &tables,
            plan: None,
            keys: None,
        }));
        Ok(AttnOut {
            out: out.out,
            k_cache: out.k_cache,
            v_cache: out.v_cache,
            prec: Prec::F32,
        })
    }
}
