//! The WGSL kernels of the wgpu backend: their sources, the pipelines made from them once at
//! load, and the parameter blocks each dispatch reads. Every shader uses plain f32 math with f16
//! data in u32 words (`unpack2x16float`) and shared-memory reductions, so none needs an optional
//! feature (SHADER_F16, SUBGROUP): every adapter runs them; faster variants that use those
//! features come with the speed work.

use super::gpu::Gpu;
use crate::BackendError;

/// A weight format the matmul and embedding kernels read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WType {
    F16,
    Q8_0,
    Q4_0,
    Q4_1,
}

impl WType {
    pub const ALL: [WType; 4] = [WType::F16, WType::Q8_0, WType::Q4_0, WType::Q4_1];

    pub fn name(self) -> &'static str {
        match self {
            WType::F16 => "F16",
            WType::Q8_0 => "Q8_0",
            WType::Q4_0 => "Q4_0",
            WType::Q4_1 => "Q4_1",
        }
    }

    /// Columns of one block (1 for f16), and u32 words of one block as the device stores it
    /// (Q4_0 and Q8_0 blocks are padded to whole words: their 2-byte scale takes a word).
    pub fn block(self) -> (usize, usize) {
        match self {
            WType::F16 => (2, 1),
            WType::Q8_0 => (32, 9),
            WType::Q4_0 | WType::Q4_1 => (32, 5),
        }
    }

    /// Words of one row of `cols` columns.
    pub fn row_words(self, cols: usize) -> usize {
        let (c, w) = self.block();
        cols / c * w
    }

    fn index(self) -> usize {
        self as usize
    }
}

pub const MATMUL: &str = include_str!("shaders/matmul.wgsl");
pub const TYPES: &str = include_str!("shaders/types.wgsl");
pub const RMS_NORM: &str = include_str!("shaders/rms_norm.wgsl");
pub const QKV_POST: &str = include_str!("shaders/qkv_post.wgsl");
pub const ATTENTION: &str = include_str!("shaders/attention.wgsl");
pub const SWIGLU: &str = include_str!("shaders/swiglu.wgsl");
pub const ARGMAX: &str = include_str!("shaders/argmax.wgsl");

/// The matmul/embedding module for weights of type `t`: its `load8`/`col8` section of
/// types.wgsl, then matmul.wgsl.
pub fn matmul_source(t: WType) -> String {
    let tag = format!("//! {}\n", t.name());
    let start = TYPES.find(&tag).expect("every type has a section") + tag.len();
    let end = TYPES[start..]
        .find("//! ")
        .map_or(TYPES.len(), |e| start + e);
    format!("{}\n{}", MATMUL, &TYPES[start..end])
}

/// Every WGSL module the backend compiles, with its name and entry points (the naga
/// translation test walks this list).
pub fn all_sources() -> Vec<(String, String, Vec<&'static str>)> {
    let mut v: Vec<(String, String, Vec<&'static str>)> = WType::ALL
        .iter()
        .map(|&t| {
            (
                format!("matmul_{}", t.name()),
                matmul_source(t),
                vec!["matmul", "embed"],
            )
        })
        .collect();
    // The prompt GEMM's tiled fallback (its coop variant needs features this list's checks do
    // not grant: gemm::coop_sources).
    for &t in &WType::ALL {
        v.push((
            format!("gemm_{}", t.name()),
            super::gemm::gemm_source(t),
            vec!["gemm"],
        ));
    }
    for (name, src) in [
        ("rms_norm", RMS_NORM),
        ("qkv_post", QKV_POST),
        ("attention", ATTENTION),
        ("swiglu", SWIGLU),
        ("argmax", ARGMAX),
    ] {
        v.push((name.to_string(), src.to_string(), vec!["main"]));
    }
    v
}

/// Rows of one matmul workgroup, and tokens of one.
pub const MM_ROWS: u32 = 64;
pub const MM_TOKENS: u32 = 16;
/// The attention kernel's limits: query heads per KV head, and their Q in shared memory.
pub const ATTN_MAX_GROUP: usize = 16;
pub const ATTN_MAX_QS: usize = 2048;
pub const ATTN_MAX_HEAD_DIM: usize = 256;

/// The pipelines, made once.
pub struct Kernels {
    matmul: Vec<wgpu::ComputePipeline>,
    embed: Vec<wgpu::ComputePipeline>,
    pub rms_norm: wgpu::ComputePipeline,
    pub qkv_post: wgpu::ComputePipeline,
    pub attention: wgpu::ComputePipeline,
    pub swiglu: wgpu::ComputePipeline,
    pub argmax: wgpu::ComputePipeline,
    /// The prompt GEMM (gemm.rs).
    pub gemm: super::gemm::GemmKernels,
}

impl Kernels {
    pub fn new(gpu: &Gpu) -> Result<Kernels, BackendError> {
        let mut matmul = Vec::new();
        let mut embed = Vec::new();
        for t in WType::ALL {
            let src = matmul_source(t);
            let name = format!("matmul_{}", t.name());
            matmul.push(gpu.pipeline(&name, &src, "matmul")?);
            embed.push(gpu.pipeline(&name, &src, "embed")?);
        }
        Ok(Kernels {
            matmul,
            embed,
            rms_norm: gpu.pipeline("rms_norm", RMS_NORM, "main")?,
            qkv_post: gpu.pipeline("qkv_post", QKV_POST, "main")?,
            attention: gpu.pipeline("attention", ATTENTION, "main")?,
            swiglu: gpu.pipeline("swiglu", SWIGLU, "main")?,
            argmax: gpu.pipeline("argmax", ARGMAX, "main")?,
            gemm: super::gemm::GemmKernels::new(gpu)?,
        })
    }

    pub fn matmul(&self, t: WType) -> &wgpu::ComputePipeline {
        &self.matmul[t.index()]
    }

    pub fn embed(&self, t: WType) -> &wgpu::ComputePipeline {
        &self.embed[t.index()]
    }
}

/// A dispatch's parameter block: up to 16 words (u32, or f32 bits), as its shader's `P` lays
/// them out.
pub type Params = [u32; 16];

fn params(words: &[u32]) -> Params {
    let mut p = [0u32; 16];
    p[..words.len()].copy_from_slice(words);
    p
}

/// One matmul (or embedding) dispatch's geometry.
#[derive(Debug, Clone, Copy)]
pub struct MmShape {
    pub rows: usize,
    pub cols: usize,
    pub n: usize,
    pub x_stride: usize,
    pub y_stride: usize,
    pub y_off: usize,
    pub add: bool,
    pub row_words: usize,
    pub row0: usize,
}

impl MmShape {
    pub fn params(&self) -> Params {
        params(&[
            self.rows as u32,
            self.cols as u32,
            self.n as u32,
            self.x_stride as u32,
            self.y_stride as u32,
            self.y_off as u32,
            self.add as u32,
            self.row_words as u32,
            self.row0 as u32,
        ])
    }

    pub fn matmul_groups(&self) -> [u32; 3] {
        [
            (self.rows as u32).div_ceil(MM_ROWS),
            (self.n as u32).div_ceil(MM_TOKENS),
            1,
        ]
    }

    pub fn embed_groups(&self) -> [u32; 3] {
        [(self.cols as u32 / 8).div_ceil(64), self.n as u32, 1]
    }
}

pub fn rms_params(dim: usize, n: usize, eps: f32, gather: bool) -> Params {
    params(&[dim as u32, n as u32, eps.to_bits(), gather as u32])
}

/// The model geometry the per-head kernels read.
#[derive(Debug, Clone, Copy)]
pub struct HeadShape {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl HeadShape {
    pub fn q_size(&self) -> usize {
        self.q_heads * self.head_dim
    }
    pub fn kv_size(&self) -> usize {
        self.kv_heads * self.head_dim
    }
    pub fn stride(&self) -> usize {
        self.q_size() + 2 * self.kv_size()
    }

    /// The limits of the attention kernel (and of RoPE's shared row), checked at load.
    pub fn check(&self) -> Result<(), BackendError> {
        let group = self.q_heads / self.kv_heads.max(1);
        if !self.head_dim.is_multiple_of(2)
            || self.head_dim > ATTN_MAX_HEAD_DIM
            || group > ATTN_MAX_GROUP
            || group * self.head_dim > ATTN_MAX_QS
        {
            return Err(BackendError::Config(format!(
                "the wgpu attention kernel takes an even head_dim up to {ATTN_MAX_HEAD_DIM} and up \
                 to {ATTN_MAX_GROUP} query heads per KV head ({ATTN_MAX_QS} values of Q in all); \
                 this model has head_dim {} and {group} query heads per KV head",
                self.head_dim
            )));
        }
        Ok(())
    }
}

/// qkv_post's parameters: `pairs` = rope_dim / 2.
#[allow(clippy::too_many_arguments)]
pub fn qkv_params(
    s: &HeadShape,
    n: usize,
    pairs: usize,
    neox: bool,
    bias: bool,
    norm: bool,
    eps: f32,
) -> Params {
    params(&[
        n as u32,
        s.q_heads as u32,
        s.kv_heads as u32,
        s.head_dim as u32,
        pairs as u32,
        neox as u32,
        bias as u32,
        norm as u32,
        eps.to_bits(),
        s.stride() as u32,
    ])
}

pub fn qkv_groups(s: &HeadShape, n: usize) -> [u32; 3] {
    [(s.q_heads + 2 * s.kv_heads) as u32, n as u32, 1]
}

/// The attention kernel's parameters (`window` 0: none).
pub fn attn_params(s: &HeadShape, n: usize, block_size: usize, window: usize) -> Params {
    params(&[
        n as u32,
        s.q_heads as u32,
        s.kv_heads as u32,
        s.head_dim as u32,
        block_size as u32,
        (1.0 / (s.head_dim as f32).sqrt()).to_bits(),
        window as u32,
        s.stride() as u32,
        s.q_size() as u32,
        (s.q_size() + s.kv_size()) as u32,
        s.q_size() as u32,
        (s.q_heads / s.kv_heads) as u32,
    ])
}

pub fn attn_groups(s: &HeadShape, n: usize) -> [u32; 3] {
    [s.kv_heads as u32, n as u32, 1]
}

/// Words per token of the attention kernel's token table.
pub const TOK_WORDS: usize = 8;

pub fn swiglu_params(n: usize, inter: usize) -> Params {
    params(&[n as u32, inter as u32])
}

pub fn swiglu_groups(n: usize, inter: usize) -> [u32; 3] {
    [(inter as u32).div_ceil(256), n as u32, 1]
}

pub fn argmax_params(rows: usize, vocab: usize) -> Params {
    params(&[rows as u32, vocab as u32])
}

/// A bind group for `pipe`: binding 0 the parameter block (`(buffer, offset)`, 64 bytes), then
/// `(binding, whole buffer)` pairs.
pub fn bind(
    gpu: &Gpu,
    pipe: &wgpu::ComputePipeline,
    params: (&wgpu::Buffer, u64),
    buffers: &[(u32, &wgpu::Buffer)],
) -> wgpu::BindGroup {
    let mut entries = vec![wgpu::BindGroupEntry {
        binding: 0,
        resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: params.0,
            offset: params.1,
            size: wgpu::BufferSize::new(64),
        }),
    }];
    for &(i, b) in buffers {
        entries.push(wgpu::BindGroupEntry {
            binding: i,
            resource: b.as_entire_binding(),
        });
    }
    gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipe.get_bind_group_layout(0),
        entries: &entries,
    })
}

/// A recorded dispatch: run in order in one compute pass.
#[derive(Clone)]
pub struct Dispatch {
    /// The kernel's name, for per-kernel timing.
    pub name: &'static str,
    pub pipe: wgpu::ComputePipeline,
    pub bind: wgpu::BindGroup,
    pub groups: [u32; 3],
}

/// Encodes `list` into one compute pass of `enc` (wgpu orders the dispatches' buffer accesses).
pub fn encode(enc: &mut wgpu::CommandEncoder, list: &[Dispatch]) {
    let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
        label: Some("quire step"),
        timestamp_writes: None,
    });
    for d in list {
        if d.groups.contains(&0) {
            continue;
        }
        pass.set_pipeline(&d.pipe);
        pass.set_bind_group(0, &d.bind, &[]);
        pass.dispatch_workgroups(d.groups[0], d.groups[1], d.groups[2]);
    }
}
