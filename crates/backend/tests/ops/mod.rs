#![cfg_attr(not(all(feature = "cuda", feature = "wgpu")), allow(dead_code))]
//! One interface to every backend's kernels, host data in and host data out, so that each kernel
//! op is tested by one body for every executor (the shape of llama.cpp's test-backend-ops and
//! candle's `test_device!`): the CPU backend's optimized kernels (SIMD, threaded), the CUDA
//! kernels and the wgpu kernels are each compared with the plain references of [`reference`],
//! under the bound [`bound`] states once per op.
//!
//! Why an interface of its own rather than the executors: an executor runs whole steps, so a
//! wrong kernel shows only as a wrong logit somewhere. Here each op runs alone on random inputs
//! with outputs poisoned with NaN first (an element never written fails the metric).
//!
//! An op or a case a backend does not have returns [`Skip`] with the reason; the test bodies
//! print each skip, and a body that ran no case for its backend fails.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod reference;
#[cfg(feature = "wgpu")]
pub mod wgpu;

use half::f16;
use quire_backend::HostTensor;
use quire_core::RopeStyle;
use quire_gguf::GgmlType;
use quire_testkit::metric;
use quire_testkit::paged::PagedBatch;
use quire_testkit::Backend;

/// Why a backend does not run an op or a case (printed by the body).
#[derive(Debug, Clone)]
pub struct Skip(pub String);

pub type OpResult<T> = Result<T, Skip>;

/// The form a matmul operand takes before the backend's f32 sums: the reference rounds its
/// operands the same way, so the comparison sees only the order of the sums.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operand {
    /// As given: the stored weights dequantized exactly, or f32 activations.
    Exact,
    /// Rounded to f16.
    F16,
    /// Quantized to 8-bit blocks of 32 (`quantize_row_q8a_scalar`), for integer dot products.
    Q8,
}

/// How a backend multiplies a weight type: what its weights and activations become first.
#[derive(Debug, Clone, Copy)]
pub struct MatmulForm {
    pub weights: Operand,
    pub act: Operand,
}

/// The precision of an op's output (RMSNorm, SwiGLU) or, for attention, of its products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prec {
    F32,
    /// Outputs rounded to f16 (the CUDA backend's RMSNorm and SwiGLU feed f16 matmuls), or Q
    /// and K/V products in f16 on tensor cores (CUDA attention).
    F16,
}

/// The ops whose outputs are compared under a bound (embedding rows and argmax must be exact).
#[derive(Debug, Clone, Copy)]
pub enum Op {
    Matmul(Operand),
    RmsNorm(Prec),
    Rope,
    Swiglu(Prec),
    Attention(Prec),
}

/// The relative-L2 bound of each op, with the reason (constants and their derivations in
/// `quire_testkit::metric`).
pub fn bound(op: Op) -> f64 {
    match op {
        // The reference rounds the operands as the backend does; what is left is f32 summation
        // in another order over at most a few thousand products.
        Op::Matmul(Operand::Exact | Operand::Q8) => metric::DOT_F32,
        // f16 operands on matrix units (cuBLAS, wgpu's cooperative-matrix GEMM), which may
        // split K and accumulate in their own order.
        Op::Matmul(Operand::F16) => metric::DOT_F32_VS_CUBLAS,
        // The same formula in another order: a few f32 roundings.
        Op::RmsNorm(Prec::F32) | Op::Swiglu(Prec::F32) | Op::Rope => metric::F32_ELEMENTWISE,
        // One f16 rounding of each output.
        Op::RmsNorm(Prec::F16) | Op::Swiglu(Prec::F16) => metric::F16_OUTPUT,
        // f32 softmax and sums over at most a few hundred keys.
        Op::Attention(Prec::F32) => metric::ATTENTION_F32,
        // f16 Q·K and P·V products on tensor cores, f32 softmax.
        Op::Attention(Prec::F16) => metric::ATTENTION_GPU,
    }
}

/// Head counts of an attention layer.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub q: usize,
    pub kv: usize,
    pub dim: usize,
}

impl Heads {
    pub fn q_size(&self) -> usize {
        self.q * self.dim
    }
    pub fn kv_size(&self) -> usize {
        self.kv * self.dim
    }
    /// One token's QKV row: `[q | k | v]`.
    pub fn stride(&self) -> usize {
        self.q_size() + 2 * self.kv_size()
    }
}

/// Bias, per-head RMSNorm of Q and K, and RoPE on QKV rows (`LayerOps::qkv_post`).
#[derive(Debug, Clone)]
pub struct QkvCase {
    pub heads: Heads,
    /// `[n, heads.stride()]`.
    pub qkv: Vec<f32>,
    /// `[heads.stride()]`: added to Q, K and V.
    pub bias: Option<Vec<f32>>,
    /// `[heads.dim]` each: the Q and K norm weights.
    pub norms: Option<(Vec<f32>, Vec<f32>)>,
    /// `[n, rope_dim / 2]` (cos, sin) of each token's position (`RopeTable::angles`).
    pub cs: Vec<(f32, f32)>,
    pub style: RopeStyle,
    pub eps: f32,
}

impl QkvCase {
    pub fn tokens(&self) -> usize {
        self.qkv.len() / self.heads.stride()
    }
    pub fn pairs(&self) -> usize {
        self.cs.len() / self.tokens().max(1)
    }
}

/// One step of paged attention: the fused K/V write of the new tokens, then causal attention
/// of their queries over each sequence's keys.
#[derive(Debug, Clone)]
pub struct AttnCase {
    pub heads: Heads,
    pub window: Option<usize>,
    /// The cache (f16, unused slots NaN), block tables, positions, slots and new K/V rows.
    pub batch: PagedBatch<f16>,
    /// `[tokens, heads.q_size()]`.
    pub q: Vec<f32>,
}

impl AttnCase {
    /// The QKV rows `[tokens, stride]` (`stride` ≥ `heads.stride()`, any padding 0).
    pub fn qkv(&self, stride: usize) -> Vec<f32> {
        let (h, n) = (self.heads, self.batch.tokens());
        let mut qkv = vec![0f32; n * stride];
        for t in 0..n {
            let row = &mut qkv[t * stride..];
            row[..h.q_size()].copy_from_slice(&self.q[t * h.q_size()..][..h.q_size()]);
            let kv = h.kv_size();
            row[h.q_size()..][..kv].copy_from_slice(&self.batch.k_new[t * kv..][..kv]);
            row[h.q_size() + kv..][..kv].copy_from_slice(&self.batch.v_new[t * kv..][..kv]);
        }
        qkv
    }

    /// The batch's sequences as the backends take them.
    pub fn seq_batches(&self) -> Vec<quire_backend::SeqBatch<'_>> {
        self.batch
            .seqs
            .iter()
            .map(|s| quire_backend::SeqBatch {
                query_start: s.query_start,
                query_len: s.query_len,
                seq_len: s.seq_len,
                block_table: &s.block_table,
            })
            .collect()
    }
}

/// What an attention op returns: `[tokens, q_size]`, and the caches after its K/V write.
pub struct AttnOut {
    pub out: Vec<f32>,
    pub k_cache: Vec<f16>,
    pub v_cache: Vec<f16>,
    pub prec: Prec,
}

/// A backend's kernels on host data. Every output is poisoned with NaN before the kernel runs.
pub trait Ops {
    /// How this backend multiplies weights of `dtype` over `n` tokens (`Skip`: it does not). A
    /// backend whose kernel for `n` tokens rounds its operands otherwise than its kernel for
    /// one says so per `n`: the reference rounds the same way and the bound follows from it.
    fn matmul_form(&self, dtype: GgmlType, n: usize) -> OpResult<MatmulForm>;
    /// `x · wᵀ` (plus `add`, the residual, when given): `w` `[rows, cols]` (dims `[cols,
    /// rows]`), `x` `[n, cols]`; returns `[n, rows]`.
    fn matmul(
        &mut self,
        w: &HostTensor,
        x: &[f32],
        n: usize,
        add: Option<&[f32]>,
    ) -> OpResult<Vec<f32>>;
    /// The rows of `tokens` from the table `w` (`[vocab, cols]`), as f32.
    fn embed(&mut self, w: &HostTensor, tokens: &[u32]) -> OpResult<Vec<f32>>;
    /// RMSNorm of each row of `x` (`[n, w.len()]`) times `w`.
    fn rms_norm(&mut self, x: &[f32], w: &[f32], eps: f32) -> OpResult<(Vec<f32>, Prec)>;
    /// [`QkvCase`]'s bias, QK-norm and RoPE: the rows after them.
    fn qkv_post(&mut self, c: &QkvCase) -> OpResult<Vec<f32>>;
    /// silu(gate) · up of each row of `gu` (`[n, 2 · inter]`, `[gate | up]`).
    fn swiglu(&mut self, gu: &[f32], inter: usize) -> OpResult<(Vec<f32>, Prec)>;
    /// The greedy pick of each row of `logits` (`[rows, vocab]`).
    fn argmax(&mut self, logits: &[f32], vocab: usize) -> OpResult<Vec<u32>>;
    /// [`AttnCase`]'s step.
    fn attention(&mut self, c: &AttnCase) -> OpResult<AttnOut>;
}

/// The kernels of `b`. Fails the test, saying what is missing, where `b` cannot run.
pub fn ops(b: Backend) -> Box<dyn Ops> {
    match b {
        Backend::Cpu => Box::new(cpu::CpuOps::new()),
        #[cfg(feature = "cuda")]
        Backend::Cuda => Box::new(cuda::CudaOps::new()),
        #[cfg(not(feature = "cuda"))]
        Backend::Cuda => quire_testkit::not_built_with_cuda(),
        #[cfg(feature = "wgpu")]
        Backend::Wgpu => Box::new(wgpu::WgpuOps::new()),
        #[cfg(not(feature = "wgpu"))]
        Backend::Wgpu => quire_testkit::not_built_with_wgpu(),
    }
}

/// Counts a body's cases, prints each skipped one, and fails a body that ran none.
pub struct Tally {
    op: &'static str,
    backend: Backend,
    ran: usize,
    skipped: usize,
}

impl Tally {
    pub fn new(op: &'static str, backend: Backend) -> Self {
        Self {
            op,
            backend,
            ran: 0,
            skipped: 0,
        }
    }

    /// The result of one case: `Some` to compare, `None` (printed) when the backend skipped it.
    pub fn take<T>(&mut self, case: &dyn std::fmt::Display, r: OpResult<T>) -> Option<T> {
        match r {
            Ok(v) => {
                self.ran += 1;
                Some(v)
            }
            Err(Skip(why)) => {
                self.skipped += 1;
                eprintln!(
                    "SKIPPED {} {} [{case}]: {why}",
                    self.backend.name(),
                    self.op
                );
                None
            }
        }
    }

    /// Prints the count; fails when no case ran.
    pub fn finish(self) {
        eprintln!(
            "{} {}: {} cases compared, {} skipped",
            self.backend.name(),
            self.op,
            self.ran,
            self.skipped
        );
        assert!(
            self.ran > 0,
            "{} ran no case of {} ({} skipped): nothing was tested",
            self.backend.name(),
            self.op,
            self.skipped
        );
    }
}
