//! The WGSL kernels of the wgpu backend: their sources, the pipelines made from them once at
//! load, and the parameter blocks each dispatch reads. These shaders use plain f32 math with f16
//! data in u32 words (`unpack2x16float`), so none needs SHADER_F16. The decode GEMV, the split
//! decode attention and the scalar prompt attention sum with subgroup operations where the device
//! has SUBGROUP and through workgroup memory otherwise (both variants are built from one
//! source); every other kernel uses workgroup memory, so every adapter runs them all. The
//! kernels on matrix units (the prompt GEMM's and the prompt attention's coop forms, gemm.rs and
//! attn_prompt.rs) need f16, subgroups and cooperative matrices, and have these as fallbacks.

use super::gemv::{gemv_pipeline, Gemv, GemvIn};
use super::gpu::Gpu;
use crate::BackendError;

/// A weight format the matmul and embedding kernels read.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WType {
    F16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_K,
    Q6_K,
}

impl WType {
    pub const ALL: [WType; 7] = [
        WType::F16,
        WType::Q8_0,
        WType::Q4_0,
        WType::Q4_1,
        WType::Q4_K,
        WType::Q5_K,
        WType::Q6_K,
    ];

    pub fn name(self) -> &'static str {
        match self {
            WType::F16 => "F16",
            WType::Q8_0 => "Q8_0",
            WType::Q4_0 => "Q4_0",
            WType::Q4_1 => "Q4_1",
            WType::Q4_K => "Q4_K",
            WType::Q5_K => "Q5_K",
            WType::Q6_K => "Q6_K",
        }
    }

    /// Columns of one block as the kernels read it (a row's length must be a multiple), and
    /// bytes of one block on the device, scales included (see weights.rs for the layouts).
    pub fn block(self) -> (usize, usize) {
        match self {
            WType::F16 => (8, 16),
            WType::Q8_0 => (32, 34),
            WType::Q4_0 => (32, 18),
            WType::Q4_1 => (32, 20),
            WType::Q4_K => (256, 144),
            WType::Q5_K => (256, 176),
            WType::Q6_K => (256, 210),
        }
    }

    /// Columns of one unit: what one 16-byte load of the type holds (types.wgsl's `4 * UV`).
    pub fn unit_cols(self) -> usize {
        match self {
            WType::F16 => 8,
            WType::Q8_0 => 16,
            _ => 32,
        }
    }

    /// Device bytes of one row of `cols` columns.
    pub fn row_bytes(self, cols: usize) -> usize {
        let (c, b) = self.block();
        cols / c * b
    }

    /// Device bytes of one row of `cols` columns / 4, rounded down (the `row_words` parameter,
    /// informational).
    pub fn row_words(self, cols: usize) -> usize {
        self.row_bytes(cols) / 4
    }

    fn index(self) -> usize {
        self as usize
    }
}

pub const MATMUL: &str = include_str!("shaders/matmul.wgsl");
pub const TYPES: &str = include_str!("shaders/types.wgsl");
pub const RMS_NORM: &str = include_str!("shaders/rms_norm.wgsl");
pub const QKV_POST: &str = include_str!("shaders/qkv_post.wgsl");
pub const ATTN_DECODE: &str = include_str!("shaders/attn_decode.wgsl");
pub const READ_BW: &str = include_str!("shaders/read_bw.wgsl");
pub const SWIGLU: &str = include_str!("shaders/swiglu.wgsl");
pub const ARGMAX: &str = include_str!("shaders/argmax.wgsl");

/// The text of section `//! tag` of `src` (up to the next section or the end), and the text
/// before the first section.
pub(crate) fn section<'a>(src: &'a str, tag: &str) -> (&'a str, &'a str) {
    // Sections start at the beginning of a line.
    let prelude = &src[..src.find("\n//! ").map_or(src.len(), |e| e + 1)];
    let tag = format!("\n//! {tag}\n");
    let start = src.find(&tag).expect("every section exists") + tag.len();
    let end = src[start..]
        .find("\n//! ")
        .map_or(src.len(), |e| start + e + 1);
    (prelude, &src[start..end])
}

/// How weights of type `t` are read (types.wgsl's prelude and `t`'s section): prepend it to a
/// shader that declares `w` and `p` as types.wgsl's header says.
pub fn type_source(t: WType) -> String {
    let (prelude, body) = section(TYPES, t.name());
    format!("{prelude}\n{body}")
}

/// The GEMV/embedding module for weights of type `t`, with the subgroup reduction or the
/// workgroup-memory one, reading its activations as stored or (`swiglu`) as silu(gate) · up of
/// [gate | up] rows.
pub fn matmul_source(t: WType, subgroup: bool, swiglu: bool) -> String {
    let (core, reduce) = section(MATMUL, if subgroup { "SUBGROUP" } else { "SHARED" });
    let (_, xv) = section(MATMUL, if swiglu { "X_SWIGLU" } else { "X_PLAIN" });
    format!("{}\n{core}\n{reduce}\n{xv}", type_source(t))
}

/// Every WGSL module the backend compiles, with its name and entry points (the naga
/// translation test walks this list; a name ending in `_subgroup` needs the SUBGROUP feature,
/// and has a fallback of the same name without the suffix).
pub fn all_sources() -> Vec<(String, String, Vec<&'static str>)> {
    let mut v: Vec<(String, String, Vec<&'static str>)> = Vec::new();
    for t in WType::ALL {
        for (sub, suffix) in [(false, ""), (true, "_subgroup")] {
            v.push((
                format!("matmul_{}{suffix}", t.name()),
                matmul_source(t, sub, false),
                vec!["gemv", "embed"],
            ));
            v.push((
                format!("matmul_swiglu_{}{suffix}", t.name()),
                matmul_source(t, sub, true),
                vec!["gemv"],
            ));
        }
    }
    v.extend(super::gemv::sources());
    // The prompt GEMM's tiled fallback (its coop variant needs features this list's checks do
    // not grant: gemm::coop_sources).
    for t in WType::ALL {
        v.push((
            format!("gemm_{}", t.name()),
            super::gemm::gemm_source(t),
            vec!["gemm"],
        ));
    }
    v.extend(super::moe::sources());
    v.push((
        "gemm_reduce".into(),
        super::gemm::GEMM_REDUCE.into(),
        vec!["main"],
    ));
    for (sub, suffix) in [(false, ""), (true, "_subgroup")] {
        v.push((
            format!("attention{suffix}"),
            super::attn_prompt::scalar_source(sub),
            vec!["main"],
        ));
    }
    for (name, src) in [
        ("rms_norm", RMS_NORM),
        ("qkv_post", QKV_POST),
        ("swiglu", SWIGLU),
        ("argmax", ARGMAX),
        ("read_bw", READ_BW),
    ] {
        v.push((name.to_string(), src.to_string(), vec!["main"]));
    }
    // The split decode kernel as the seed shape (GQA 2, head dim 128), GQA 4 and GQA 16 at
    // head dim 256 instantiate it, through subgroups and without.
    for (group, head_dim) in [(2, 128), (4, 128), (16, 256)] {
        for (sub, suffix) in [(false, ""), (true, "_subgroup")] {
            let d = DecodeKernel::new(if sub { Some(32) } else { None }, group, head_dim);
            v.push((
                format!("attn_decode_g{group}_d{head_dim}{suffix}"),
                d.source(),
                vec!["decode"],
            ));
        }
    }
    v
}

/// Rows of one GEMV workgroup, and tokens of one (matmul.wgsl's RW and NT).
pub const MM_ROWS: u32 = 16;
pub const MM_TOKENS: u32 = 8;
/// The attention kernel's limits: query heads per KV head, and their Q in shared memory.
pub const ATTN_MAX_GROUP: usize = 16;
pub const ATTN_MAX_QS: usize = 2048;
pub const ATTN_MAX_HEAD_DIM: usize = 256;

/// The pipelines, made once.
pub struct Kernels {
    matmul: Vec<wgpu::ComputePipeline>,
    /// The GEMV reading silu(gate) · up of [gate | up] rows (the decode down projection).
    matmul_swiglu: Vec<wgpu::ComputePipeline>,
    /// By input form ([`GemvIn::ALL`]'s order), then by type, the one-token GEMV
    /// ([`Gemv::engine`]); `None` where that is the multi-token kernel.
    gemv1: Vec<Vec<Option<wgpu::ComputePipeline>>>,
    embed: Vec<wgpu::ComputePipeline>,
    pub rms_norm: wgpu::ComputePipeline,
    pub qkv_post: wgpu::ComputePipeline,
    /// The prompt attention (attn_prompt.rs).
    pub attention: PromptAttn,
    /// The decode attention kernel's pipelines, one per head geometry (made on first use).
    pub attn_split: DecodeSplit,
    pub swiglu: wgpu::ComputePipeline,
    pub argmax: wgpu::ComputePipeline,
    /// Whether the GEMV sums with subgroup operations.
    pub subgroup: bool,
    /// The prompt GEMM (gemm.rs).
    pub gemm: super::gemm::GemmKernels,
    /// Mixture-of-experts layers (moe.rs), made for models that have them.
    pub moe: Option<super::moe::MoeKernels>,
}

impl Kernels {
    /// The pipelines, the GEMV with subgroup sums where the device has them.
    pub fn new(gpu: &Gpu) -> Result<Kernels, BackendError> {
        Kernels::with_subgroups(gpu, gpu.caps.subgroup.is_some())
    }

    /// The pipelines, the GEMV with subgroup sums if `subgroup` (the device must have the
    /// feature) or with workgroup-memory sums.
    pub fn with_subgroups(gpu: &Gpu, subgroup: bool) -> Result<Kernels, BackendError> {
        if subgroup && gpu.caps.subgroup.is_none() {
            return Err(BackendError::Wgpu(format!(
                "adapter {} has no subgroup operations",
                gpu.info.name
            )));
        }
        let mut matmul = Vec::new();
        let mut matmul_swiglu = Vec::new();
        let mut embed = Vec::new();
        let mut gemv1 = vec![Vec::new(); GemvIn::ALL.len()];
        for t in WType::ALL {
            let g = Gemv::engine(t);
            let one = g != Gemv::Multi;
            for (i, input) in GemvIn::ALL.into_iter().enumerate() {
                gemv1[i].push(
                    one.then(|| gemv_pipeline(gpu, t, g, subgroup, input))
                        .transpose()?,
                );
            }
            let src = matmul_source(t, subgroup, false);
            let name = format!("matmul_{}", t.name());
            matmul.push(gpu.pipeline(&name, &src, "gemv")?);
            embed.push(gpu.pipeline(&name, &src, "embed")?);
            let src = matmul_source(t, subgroup, true);
            let name = format!("matmul_swiglu_{}", t.name());
            matmul_swiglu.push(gpu.pipeline(&name, &src, "gemv")?);
        }
        Ok(Kernels {
            matmul,
            matmul_swiglu,
            gemv1,
            embed,
            rms_norm: gpu.pipeline("rms_norm", RMS_NORM, "main")?,
            qkv_post: gpu.pipeline("qkv_post", QKV_POST, "main")?,
            attention: PromptAttn::new(gpu, subgroup)?,
            attn_split: DecodeSplit::new(gpu.caps.subgroup.filter(|_| subgroup).map(|(lo, _)| lo)),
            swiglu: gpu.pipeline("swiglu", SWIGLU, "main")?,
            argmax: gpu.pipeline("argmax", ARGMAX, "main")?,
            subgroup,
            gemm: super::gemm::GemmKernels::new(gpu)?,
            moe: None,
        })
    }

    pub fn matmul(&self, t: WType) -> &wgpu::ComputePipeline {
        &self.matmul[t.index()]
    }

    pub fn matmul_swiglu(&self, t: WType) -> &wgpu::ComputePipeline {
        &self.matmul_swiglu[t.index()]
    }

    pub fn embed(&self, t: WType) -> &wgpu::ComputePipeline {
        &self.embed[t.index()]
    }

    /// The GEMV for shape `s` (at most [`MM_TOKENS`] tokens) of type `t`, reading silu(gate) ·
    /// up if `swiglu`, and its grid: [`Gemv::engine`] of `t` for one token, the multi-token
    /// kernel for more.
    pub fn gemv(&self, t: WType, s: &MmShape, swiglu: bool) -> (&wgpu::ComputePipeline, [u32; 3]) {
        let input = if swiglu {
            GemvIn::Swiglu
        } else {
            GemvIn::Plain
        };
        if let (1, Some(pipe)) = (s.n, self.gemv1(t, input)) {
            return (pipe, Gemv::engine(t).groups(s));
        }
        let pipe = if swiglu {
            self.matmul_swiglu(t)
        } else {
            self.matmul(t)
        };
        (pipe, s.matmul_groups())
    }

    /// The one-token GEMV of type `t` reading its input as `input` says (`None` where the type's
    /// one-token GEMV is the multi-token kernel, which has only the plain and SwiGLU forms).
    pub fn gemv1(&self, t: WType, input: GemvIn) -> Option<&wgpu::ComputePipeline> {
        let i = GemvIn::ALL.iter().position(|&f| f == input)?;
        self.gemv1[i][t.index()].as_ref()
    }
}

/// A dispatch's parameter block: up to 16 words (u32, or f32 bits), as its shader's `P` lays
/// them out.
pub type Params = [u32; 16];

pub(crate) fn params(words: &[u32]) -> Params {
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
    /// A product over `n` tokens of a whole `[rows, cols]` matrix with dense input and output
    /// rows (no offset, no residual add).
    pub fn dense(rows: usize, cols: usize, n: usize) -> MmShape {
        MmShape {
            rows,
            cols,
            n,
            x_stride: cols,
            y_stride: rows,
            y_off: 0,
            add: false,
            row_words: 0,
            row0: 0,
        }
    }

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

    /// [`Self::params`] with the fused forms' words (matmul.wgsl's `P`): the norm's epsilon, and
    /// for RoPE in the output the head size, the rotated pairs of a head and the output columns
    /// of Q and K.
    pub fn fused_params(&self, eps: f32, rope: Option<(usize, usize, usize)>) -> Params {
        let mut p = self.params();
        p[9] = eps.to_bits();
        if let Some((head_dim, pairs, rows)) = rope {
            p[10] = head_dim as u32;
            p[11] = pairs as u32;
            p[12] = rows as u32;
        }
        p
    }

    pub fn matmul_groups(&self) -> [u32; 3] {
        [
            (self.rows as u32).div_ceil(MM_ROWS),
            (self.n as u32).div_ceil(MM_TOKENS),
            1,
        ]
    }

    /// The embedding's grid for weights of type `t`: a unit per invocation.
    pub fn embed_groups(&self, t: WType) -> [u32; 3] {
        let units = (self.cols / t.unit_cols()) as u32;
        [units.div_ceil(64), self.n as u32, 1]
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

/// Cuts the tokens of a token table (`TOK_WORDS` words per token, words 0..5 filled) into the
/// prompt attention's query tiles: runs of at most `qt` consecutive tokens of one sequence (the
/// same first new position, first row and block table). Writes tile i's first token and token
/// count into words 5 and 6 of entry i; returns the number of tiles.
pub fn fill_tiles(tok: &mut [u32], qt: usize) -> usize {
    let n = tok.len() / TOK_WORDS;
    let seq = |tok: &[u32], t: usize| -> [u32; 3] {
        let w = &tok[t * TOK_WORDS..];
        [w[2], w[3], w[4]]
    };
    let mut tiles = 0;
    let mut t = 0;
    while t < n {
        let mut e = t + 1;
        while e < n && e - t < qt.max(1) && seq(tok, e) == seq(tok, t) {
            e += 1;
        }
        tok[tiles * TOK_WORDS + 5] = t as u32;
        tok[tiles * TOK_WORDS + 6] = (e - t) as u32;
        tiles += 1;
        t = e;
    }
    tiles
}

pub use super::attn_prompt::{attn_groups, attn_params, PromptAttn, PromptPath};

pub use super::decode::{
    split_fits, split_groups, split_params, DecodeKernel, DecodeSplit, SplitPlan, MAX_SPLITS,
};

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
    /// Bytes it reads and writes, and its arithmetic, for profiles (0: not counted).
    pub bytes: u64,
    pub flops: u64,
}

impl Dispatch {
    /// Whether it runs at all (a dispatch of zero workgroups is skipped).
    pub fn runs(&self) -> bool {
        !self.groups.contains(&0)
    }
}

fn record(pass: &mut wgpu::ComputePass<'_>, d: &Dispatch) {
    pass.set_pipeline(&d.pipe);
    pass.set_bind_group(0, &d.bind, &[]);
    pass.dispatch_workgroups(d.groups[0], d.groups[1], d.groups[2]);
}

/// Encodes the dispatches of `list` that run (at most `timer.cap` of them) with a timestamp
/// pair around each: one pass with timestamps inside it where the device allows that, else one
/// pass per dispatch timed at its boundaries; dispatches past the timer's capacity run untimed
/// after them. Returns the indices into `list` of the timed dispatches, in the timer's order;
/// `timer.resolve` then reads them out.
pub fn encode_timed(
    enc: &mut wgpu::CommandEncoder,
    list: &[Dispatch],
    timer: &super::gpu::Timer,
) -> Vec<usize> {
    use super::gpu::Timestamps;
    let timed: Vec<usize> = (0..list.len())
        .filter(|&i| list[i].runs())
        .take(timer.cap)
        .collect();
    // Past the timer's capacity, the rest run untimed after the timed ones.
    let rest = timed.last().map_or(0, |&i| i + 1);
    match timer.mode {
        Timestamps::InsidePasses => {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("quire step (timed)"),
                timestamp_writes: None,
            });
            for (k, &i) in timed.iter().enumerate() {
                pass.write_timestamp(&timer.set, 2 * k as u32);
                record(&mut pass, &list[i]);
                pass.write_timestamp(&timer.set, 2 * k as u32 + 1);
            }
        }
        Timestamps::PassBoundaries | Timestamps::None => {
            for (k, &i) in timed.iter().enumerate() {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some(list[i].name),
                    timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                        query_set: &timer.set,
                        beginning_of_pass_write_index: Some(2 * k as u32),
                        end_of_pass_write_index: Some(2 * k as u32 + 1),
                    }),
                });
                record(&mut pass, &list[i]);
            }
        }
    }
    if rest < list.len() {
        encode(enc, &list[rest..]);
    }
    timed
}

/// Encodes `list` into one compute pass of `enc` (wgpu orders the dispatches' buffer accesses).
pub fn encode(enc: &mut wgpu::CommandEncoder, list: &[Dispatch]) {
    let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
        label: Some("quire step"),
        timestamp_writes: None,
    });
    record_all(&mut pass, list);
}

/// Records the dispatches of `list` that run into `pass`.
pub fn record_all(pass: &mut wgpu::ComputePass<'_>, list: &[Dispatch]) {
    for d in list.iter().filter(|d| d.runs()) {
        record(pass, d);
    }
}
