//! The wgpu executor: loads a Llama-family model (dense or Qwen3-MoE) onto the device (see
//! `weights`), keeps an f16 paged KV cache per layer, and runs each step as a few command
//! buffers, each submitted as soon as it is encoded (the layer sequence is `crate::forward`'s;
//! the kernels are `step`'s). Only logits, or only token ids for greedy steps (argmax on the
//! device), come back to the host.
//!
//! A one-token step fuses its small ops into its GEMVs (`step`'s header: the RMSNorms, RoPE,
//! the SwiGLU; 5 dispatches per Llama layer instead of 8); `set_fusions(false)` turns that off,
//! for the tests that compare the two forms.

use std::time::Instant;

use quire_core::ModelConfig;

use super::gpu::{Gpu, Timer, Timestamps};
use super::kernels::{self, HeadShape, Kernels};
use super::moe::{DMoe, MoeKernels};
use super::step::{Binder, Bufs, Step};
use super::weights::{DMatrix, DVec};
use super::WgpuOptions;
use crate::cpu::ops::RopeTable;
use crate::forward::{Ffn, Layer};
use crate::{BackendError, Executor, FfnWeights, ForwardBatch, KvCacheSpec, ModelWeights, OpStat};
use timing::OMISSION_ROUNDS;

mod timing;

pub struct WgpuExecutor {
    gpu: Gpu,
    k: Kernels,
    cfg: ModelConfig,
    shape: HeadShape,
    kv: KvCacheSpec,
    embed: DMatrix,
    /// `None`: tied to the embedding.
    output: Option<DMatrix>,
    output_norm: DVec,
    layers: Vec<Layer<DMatrix, DVec, DMoe>>,
    cache: Vec<(wgpu::Buffer, wgpu::Buffer)>,
    rope: RopeTable,
    dummy: wgpu::Buffer,
    binder: Binder,
    bufs: Option<Bufs>,
    list: Vec<kernels::Dispatch>,
    logits: Vec<f32>,
    profiling: bool,
    profile: Vec<OpStat>,
    /// The decode attention's scratch, grown to the largest decode step seen.
    scratch: Option<Scratch>,
    /// Timestamp queries for profiled steps, made on the first one (never when not profiling).
    timer: Option<Timer>,
    /// The last profiled step: its device time (timestamps at its start and end), its wall
    /// time and the host's time to upload, record and encode it (both without the profile's
    /// timing passes).
    step_device_ns: Option<u64>,
    step_wall_ns: Option<u64>,
    step_host_ns: Option<u64>,
    /// What `list` was recorded for: a step of the same shape runs it again as it is (its
    /// parameters too) instead of recording it anew.
    recorded: Option<Recorded>,
    /// Whether a one-token step fuses its small ops into its GEMVs (on by default; off only to
    /// compare the two forms), and whether the model lets the QKV GEMV apply RoPE (adjacent
    /// pairs, no bias or QK-norm before it).
    fuse: bool,
    rope_in_gemv: bool,
}

/// The decode attention's scratch: every range's partial (V sums, then from `ml_off` the maxima
/// and sums) and the per-(row, KV head) counters of finished ranges, for up to `rows` rows.
struct Scratch {
    part: wgpu::Buffer,
    done: wgpu::Buffer,
    ml_off: usize,
    rows: usize,
}

/// Dispatches per submission of an unprofiled step: small enough that the device starts early
/// and the host's encoding of the rest overlaps the device's work, large enough that the cost of
/// a submission (tens of microseconds) stays a small part of a step. The first submission is
/// shorter, so the device starts on the first layer's work while the host encodes the rest.
const SUBMIT_EVERY: usize = 64;
const SUBMIT_FIRST: usize = 8;

/// What a step's dispatches depend on besides its inputs' values (which live in buffers): its
/// token and logits rows, the argmax, the decode attention's split, the prompt attention's
/// tiles, the fusions, and the bind groups' generation (`Binder::generation`: buffers regrown).
/// The profile's byte counts depend on the keys too, so profiled steps always record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Recorded {
    n: usize,
    nl: usize,
    argmax: bool,
    plan: Option<kernels::SplitPlan>,
    tiles: usize,
    fuse: bool,
    generation: u64,
}

/// What a step hands back.
enum Want {
    Logits,
    Ids,
}

impl WgpuExecutor {
    pub fn new(
        w: &ModelWeights,
        kv: KvCacheSpec,
        opts: &WgpuOptions,
    ) -> Result<WgpuExecutor, BackendError> {
        w.check()?;
        let c = &w.config;
        if !kv.block_size.is_power_of_two() || kv.block_size > 128 || kv.num_blocks == 0 {
            return Err(BackendError::Config(format!(
                "block size must be a power of two up to 128 and the cache non-empty (got {} blocks of {})",
                kv.num_blocks, kv.block_size
            )));
        }
        let shape = HeadShape {
            q_heads: c.num_heads,
            kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
        };
        shape.check()?;
        if c.rope_dim > c.head_dim || !c.rope_dim.is_multiple_of(2) {
            return Err(BackendError::Config(format!(
                "rope_dim {} must be even and at most head_dim {}",
                c.rope_dim, c.head_dim
            )));
        }
        let mut gpu = Gpu::new(opts.adapter.as_deref())?;
        let mut k = Kernels::new(&gpu)?;
        k.attention.prepare(&gpu, &shape)?;
        if c.moe.is_some() {
            k.moe = Some(MoeKernels::new(&gpu)?);
        }
        let (hd, inter) = (c.hidden_size, c.intermediate_size);
        let embed = DMatrix::stack(&mut gpu, "token_embd", &[&w.tok_embd], hd)?;
        let output = match &w.output {
            Some(t) => Some(DMatrix::stack(&mut gpu, "output", &[t], hd)?),
            None => None,
        };
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in &w.layers {
            let ffn = match &l.ffn {
                FfnWeights::Dense {
                    w_gate,
                    w_up,
                    w_down,
                } => Ffn::Dense {
                    gate_up: DMatrix::stack(&mut gpu, "gate_up", &[w_gate, w_up], hd)?,
                    down: DMatrix::stack(&mut gpu, "down", &[w_down], inter)?,
                },
                FfnWeights::Moe(m) => Ffn::Moe(DMoe::new(&mut gpu, m, c)?),
            };
            let bqkv = match (&l.bq, &l.bk, &l.bv) {
                (Some(q), Some(k), Some(v)) => {
                    let mut b = q.to_f32()?;
                    b.extend(k.to_f32()?);
                    b.extend(v.to_f32()?);
                    Some(DVec::new(&mut gpu, "bqkv", &b)?)
                }
                _ => None,
            };
            let vec = |g: &mut Gpu, t: &Option<crate::HostTensor>| {
                t.as_ref()
                    .map(|t| DVec::from_tensor(g, t, c.head_dim))
                    .transpose()
            };
            layers.push(Layer {
                attn_norm: DVec::from_tensor(&mut gpu, &l.attn_norm, hd)?,
                wqkv: DMatrix::stack(&mut gpu, "wqkv", &[&l.wq, &l.wk, &l.wv], hd)?,
                bqkv,
                q_norm: vec(&mut gpu, &l.q_norm)?,
                k_norm: vec(&mut gpu, &l.k_norm)?,
                wo: DMatrix::stack(&mut gpu, "wo", &[&l.wo], c.q_size())?,
                ffn_norm: DVec::from_tensor(&mut gpu, &l.ffn_norm, hd)?,
                ffn,
            });
        }
        let cache_bytes = (kv.num_blocks * kv.block_size * c.kv_size() * 2) as u64;
        let mut cache = Vec::with_capacity(c.num_layers);
        for li in 0..c.num_layers {
            let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC;
            let what = format!(
                "KV cache of layer {li} ({} blocks of {})",
                kv.num_blocks, kv.block_size
            );
            cache.push((
                gpu.buffer(&what, cache_bytes, usage)?,
                gpu.buffer(&what, cache_bytes, usage)?,
            ));
        }
        let dummy = gpu.upload("dummy", &[0u8; 16])?;
        let parts: usize = layers
            .iter()
            .map(|l| {
                let ffn = match &l.ffn {
                    Ffn::Dense { gate_up, down } => gate_up.parts.len() + down.parts.len(),
                    // The router, gate, up and down, and the layer's route, SwiGLU and sum.
                    Ffn::Moe(e) => {
                        1 + e.gate.parts.len() + e.up.parts.len() + e.down.parts.len() + 3
                    }
                };
                l.wqkv.parts.len() + l.wo.parts.len() + ffn
            })
            .sum();
        // Each matmul part has a bind group per kernel it runs, the one-token GEMV's (plain or
        // with the norm fused), the multi-token GEMV's, each GEMM path's and the split GEMM's
        // reduce (pipelines of their own; the down projection's GEMVs read silu(gate) · up
        // instead, or not, for the executor's life), counted with room to spare; an embedding
        // part one more: the lookup's, when the output matrix is tied to it.
        let slots = 16
            + (5 + k.gemm.paths().len()) * parts
            + 8 * c.num_layers
            + 5 * embed.parts.len()
            + 4 * output.as_ref().map_or(0, |o| o.parts.len());
        let rope_in_gemv = c.rope_style == quire_core::RopeStyle::Normal
            && layers
                .iter()
                .all(|l| l.bqkv.is_none() && l.q_norm.is_none() && l.k_norm.is_none());
        let binder = Binder::new(&mut gpu, slots)?;
        gpu.submit_wait(
            gpu.device
                .create_command_encoder(&Default::default())
                .finish(),
        )?;
        Ok(WgpuExecutor {
            rope: RopeTable::new(c.rope_dim, c.rope_theta, w.rope_freqs.as_deref()),
            output_norm: DVec::from_tensor(&mut gpu, &w.output_norm, hd)?,
            cfg: c.clone(),
            shape,
            kv,
            embed,
            output,
            layers,
            cache,
            dummy,
            binder,
            bufs: None,
            list: Vec::new(),
            recorded: None,
            logits: Vec::new(),
            profiling: false,
            profile: Vec::new(),
            timer: None,
            step_device_ns: None,
            step_wall_ns: None,
            step_host_ns: None,
            scratch: None,
            fuse: true,
            rope_in_gemv,
            k,
            gpu,
        })
    }

    /// Turns the fusions that cut a one-token step's dispatches (the RMSNorms and RoPE into the
    /// GEMVs after them, the SwiGLU into the down GEMV) on or off; the output is the same either
    /// way, within f32 rounding.
    pub fn set_fusions(&mut self, on: bool) {
        self.fuse = on;
    }

    /// Dispatches the last recorded step ran (zero-sized ones skipped): the count a fusion cuts.
    pub fn last_dispatches(&self) -> usize {
        self.list.iter().filter(|d| d.runs()).count()
    }

    /// The adapter this executor runs on.
    pub fn adapter(&self) -> &super::AdapterSummary {
        &self.gpu.info
    }

    /// Work buffers for `n` tokens, `nl` logits rows and `tables` block-table entries.
    fn ensure(&mut self, n: usize, nl: usize, tables: usize) -> Result<(), BackendError> {
        if let Some(b) = &self.bufs {
            if b.cap >= n && b.cap_logits >= nl && b.cap_tables >= tables {
                return Ok(());
            }
        }
        let grow = |want: usize, had: usize| want.max(had).max(16).next_power_of_two();
        let (c, l, t) = match &self.bufs {
            Some(b) => (b.cap, b.cap_logits, b.cap_tables),
            None => (0, 0, 0),
        };
        if let Some(old) = self.bufs.take() {
            for b in old.all() {
                self.gpu.release(b);
            }
        }
        self.binder.clear();
        let bufs = Bufs::new(
            &mut self.gpu,
            &self.cfg,
            grow(n, c),
            grow(nl, l),
            grow(tables, t),
            self.k.gemm.scratch_floats(),
        )?;
        self.bufs = Some(bufs);
        Ok(())
    }

    /// The split of decode attention for a step of decode rows only (`None` for other steps),
    /// with its scratch grown to fit.
    fn plan_split(
        &mut self,
        batch: &ForwardBatch,
        max_keys: usize,
    ) -> Result<Option<kernels::SplitPlan>, BackendError> {
        if batch.seqs.iter().any(|s| s.query_len != 1) {
            return Ok(None);
        }
        let n = batch.num_tokens();
        let d = self.k.attn_split.kernel(&self.shape);
        let plan = kernels::SplitPlan::new(&d, &self.shape, n, max_keys, self.kv.block_size);
        let fits = self.scratch.as_ref().is_some_and(|s| s.rows >= n);
        if !fits {
            if let Some(s) = self.scratch.take() {
                self.gpu.release(&s.part);
                self.gpu.release(&s.done);
            }
            // Room for the most ranges of twice these rows, so growing stays rare.
            let rows = (2 * n).max(16);
            let most = kernels::SplitPlan {
                splits: kernels::MAX_SPLITS,
                split_keys: 0,
            };
            let (pw, mw) = most.scratch_words(&self.shape, rows);
            let usage = wgpu::BufferUsages::STORAGE;
            let part = self
                .gpu
                .buffer("attention partials", ((pw + mw) * 4) as u64, usage)?;
            // Zero on creation (wgpu clears new buffers); each dispatch leaves it zero.
            let done = self.gpu.buffer(
                "attention range counters",
                (rows * self.shape.kv_heads * 4) as u64,
                usage,
            )?;
            self.scratch = Some(Scratch {
                part,
                done,
                ml_off: pw,
                rows,
            });
            self.binder.clear();
        }
        Ok(Some(plan))
    }

    /// Writes the step's inputs: token ids, the attention kernel's token table, block tables,
    /// RoPE angles and the logits rows. Returns the keys its tokens attend over, in all.
    fn upload_step(&mut self, batch: &ForwardBatch) -> Result<usize, BackendError> {
        let (tok, tables, rope) = self.inputs(batch);
        self.ensure(batch.num_tokens(), batch.logits_indices.len(), tables.len())?;
        let b = self.bufs.as_ref().expect("ensured");
        let q = &self.gpu.queue;
        let put = |buf: &wgpu::Buffer, words: &[u32]| {
            if !words.is_empty() {
                q.write_buffer(buf, 0, &words_bytes(words));
            }
        };
        put(&b.tokens, batch.token_ids);
        put(&b.tok, &tok);
        put(&b.tables, &tables);
        put(&b.rope, &rope);
        put(&b.lidx, batch.logits_indices);
        let window = self.cfg.sliding_window.unwrap_or(usize::MAX);
        Ok(batch
            .positions
            .iter()
            .map(|&p| (p as usize + 1).min(window))
            .sum())
    }

    /// The attention kernels' token table, the block tables and the RoPE angles (f32 bits) of
    /// `batch`.
    fn inputs(&self, batch: &ForwardBatch) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
        let n = batch.num_tokens();
        let mut tok = vec![0u32; n * kernels::TOK_WORDS];
        let mut tables = Vec::new();
        for s in batch.seqs {
            let off = tables.len() as u32;
            tables.extend(s.block_table.iter().map(|b| b.0));
            let first_new = (s.seq_len - s.query_len) as u32;
            for t in s.query_start..s.query_start + s.query_len {
                let row = &mut tok[t * kernels::TOK_WORDS..][..5];
                row.copy_from_slice(&[
                    batch.positions[t],
                    batch.slot_mapping[t],
                    first_new,
                    s.query_start as u32,
                    off,
                ]);
            }
        }
        kernels::fill_tiles(&mut tok, self.k.attention.tile_tokens(&self.shape));
        let mut rope = Vec::with_capacity(n * self.cfg.rope_dim);
        let mut cs = Vec::new();
        for &pos in batch.positions {
            self.rope.angles(pos, &mut cs);
            rope.extend(cs.iter().flat_map(|&(c, s)| [c.to_bits(), s.to_bits()]));
        }
        (tok, tables, rope)
    }

    /// Records the step's dispatches for `batch` (its inputs uploaded; `keys` attended in all)
    /// into `self.list`, with the argmax when `argmax`, and writes their parameters. `ahead`:
    /// steps a chain runs past this one (the decode attention's split covers their keys too).
    fn record(
        &mut self,
        batch: &ForwardBatch,
        keys: usize,
        ahead: usize,
        argmax: bool,
    ) -> Result<(), BackendError> {
        let (n, nl) = (batch.num_tokens(), batch.logits_indices.len());
        let window = self.cfg.sliding_window.unwrap_or(usize::MAX);
        let max_keys = batch
            .positions
            .iter()
            .map(|&p| (p as usize + 1 + ahead).min(window))
            .max();
        let plan = self.plan_split(batch, max_keys.unwrap_or(1))?;
        let tiles = attn_tiles(batch, self.k.attention.tile_tokens(&self.shape));
        let sig = Recorded {
            n,
            nl,
            argmax,
            plan,
            tiles,
            fuse: self.fuse,
            generation: self.binder.generation,
        };
        if !self.profiling && self.recorded == Some(sig) {
            // Decode steps of one shape: the same dispatches and parameters as the last one.
            return Ok(());
        }
        self.recorded = None;
        self.list.clear();
        let bufs = self.bufs.as_ref().expect("ensured");
        let mut st = Step {
            gpu: &self.gpu,
            k: &self.k,
            cfg: &self.cfg,
            shape: self.shape,
            kv: self.kv,
            bufs,
            binder: &mut self.binder,
            list: &mut self.list,
            cache: &self.cache,
            embed: &self.embed,
            dummy: &self.dummy,
            n,
            nl,
            keys,
            tiles,
            fuse: self.fuse,
            swiglu_pending: false,
            norm_pending: None,
            rope_in_gemv: self.rope_in_gemv,
            rope_done: false,
            split: plan.map(|p| {
                let s = self.scratch.as_ref().expect("planned");
                (p, &s.part, &s.done, s.ml_off)
            }),
        };
        let output = self.output.as_ref().unwrap_or(&self.embed);
        crate::forward::forward(&mut st, &self.layers, &self.output_norm, output)?;
        if argmax {
            st.argmax()?;
        }
        // Steps of one shape with another split have the same parameters but the attention's:
        // write them only when they change.
        if self.binder.words != self.binder.written {
            self.gpu
                .queue
                .write_buffer(&self.binder.buf, 0, &words_bytes(&self.binder.words));
            self.binder.written.clone_from(&self.binder.words);
        }
        self.recorded = Some(sig);
        Ok(())
    }

    /// Runs one step; reads back what `want` names into `self.logits` or the returned ids.
    fn step(&mut self, batch: &ForwardBatch, want: Want) -> Result<Vec<u32>, BackendError> {
        batch.check(self.kv, self.cfg.vocab_size)?;
        let (n, nl) = (batch.num_tokens(), batch.logits_indices.len());
        if n == 0 {
            self.logits.clear();
            return Ok(Vec::new());
        }
        let t0 = Instant::now();
        let keys = self.upload_step(batch)?;
        self.record(batch, keys, 0, matches!(want, Want::Ids))?;
        // The profile's own runs are left out of the step's wall time.
        let t_prof = Instant::now();
        if self.profiling {
            if self.gpu.caps.timestamps == Timestamps::None {
                self.time_each()?;
            } else {
                self.time_by_omission()?;
            }
        }
        let profiling_ns = t_prof.elapsed().as_nanos() as u64;
        let bufs = self.bufs.as_ref().expect("ensured");
        let mut enc = self.gpu.device.create_command_encoder(&Default::default());
        // All but the last chunk go to the device as soon as they are encoded, so it starts on
        // the first layers while the host encodes the rest (wgpu costs the host microseconds
        // per dispatch, and a step has hundreds).
        let mut at = 0;
        let mut size = SUBMIT_FIRST;
        while at < self.list.len() {
            let end = (at + size).min(self.list.len());
            if end == self.list.len() {
                kernels::encode(&mut enc, &self.list[at..]);
            } else {
                let mut e = self.gpu.device.create_command_encoder(&Default::default());
                kernels::encode(&mut e, &self.list[at..end]);
                self.gpu.queue.submit([e.finish()]);
            }
            (at, size) = (end, SUBMIT_EVERY);
        }
        let (src, dst, bytes) = match want {
            Want::Logits => (
                &bufs.logits,
                &bufs.read_logits,
                nl * self.cfg.vocab_size * 4,
            ),
            Want::Ids => (&bufs.ids, &bufs.read_ids, nl * 4),
        };
        if bytes > 0 {
            enc.copy_buffer_to_buffer(src, 0, dst, 0, bytes as u64);
        }
        let cmd = enc.finish();
        let host_ns = (t0.elapsed().as_nanos() as u64).saturating_sub(profiling_ns);
        // Logits go straight from the mapped buffer into `self.logits` (kept between steps).
        let logits = &mut self.logits;
        let ids = self.gpu.submit_read_with(cmd, dst, bytes as u64, |raw| {
            let words = raw.chunks_exact(4).map(|b| [b[0], b[1], b[2], b[3]]);
            match want {
                Want::Logits => {
                    logits.clear();
                    logits.extend(words.map(f32::from_le_bytes));
                    Vec::new()
                }
                Want::Ids => words.map(u32::from_le_bytes).collect(),
            }
        })?;
        if self.profiling {
            let wall = t0.elapsed().as_nanos() as u64;
            self.step_wall_ns = Some(wall.saturating_sub(profiling_ns));
            self.step_host_ns = Some(host_ns);
        }
        Ok(ids)
    }
}

impl WgpuExecutor {
    /// Chain decode in one submission: step 0's inputs are uploaded as for any step; the token
    /// tables and RoPE angles of steps 1..K are uploaded together up front and copied into
    /// place between the steps; each step's argmax is copied into the next step's token ids on
    /// the device, and into the output that comes back once, at the end. The dispatches are
    /// recorded once (their parameters do not change along a chain: the decode attention's
    /// split is planned for the chain's last position).
    fn chain(&mut self, batch: &ForwardBatch, steps: usize) -> Result<Vec<u32>, BackendError> {
        let bs = self.kv.block_size;
        crate::chain::check(batch, steps, bs)?;
        batch.check(self.kv, self.cfg.vocab_size)?;
        let n = batch.num_tokens();
        let keys = self.upload_step(batch)?;
        self.record(batch, keys, steps - 1, true)?;
        // Steps 1..K: [token table | RoPE angles] each.
        let mut cur = crate::chain::Stepped::new(batch);
        let mut ahead: Vec<u32> = Vec::new();
        let mut per = 0;
        for _ in 1..steps {
            let toks = cur.tokens.clone();
            cur.advance(bs, &toks);
            let (tok, _, rope) = self.inputs(&cur.batch());
            per = tok.len() + rope.len();
            ahead.extend(tok);
            ahead.extend(rope);
        }
        use wgpu::BufferUsages as U;
        let src = self.gpu.buffer(
            "chain inputs",
            (ahead.len() * 4) as u64,
            U::COPY_SRC | U::COPY_DST,
        )?;
        if !ahead.is_empty() {
            self.gpu.queue.write_buffer(&src, 0, &words_bytes(&ahead));
        }
        let out_bytes = (steps * n * 4) as u64;
        let out = self
            .gpu
            .buffer("chain tokens", out_bytes, U::COPY_SRC | U::COPY_DST)?;
        let read = self
            .gpu
            .buffer("chain readback", out_bytes, U::MAP_READ | U::COPY_DST)?;
        let b = self.bufs.as_ref().expect("ensured");
        let tok_bytes = (n * kernels::TOK_WORDS * 4) as u64;
        let row = (n * 4) as u64;
        // One command buffer per step, each submitted once encoded: the device runs step k while
        // the host encodes step k + 1 (the queue keeps them in order).
        let mut enc = self.gpu.device.create_command_encoder(&Default::default());
        for k in 0..steps {
            if k > 0 {
                let done = std::mem::replace(
                    &mut enc,
                    self.gpu.device.create_command_encoder(&Default::default()),
                );
                self.gpu.queue.submit([done.finish()]);
                let at = ((k - 1) * per * 4) as u64;
                enc.copy_buffer_to_buffer(&src, at, &b.tok, 0, tok_bytes);
                let rope_bytes = (per * 4) as u64 - tok_bytes;
                if rope_bytes > 0 {
                    enc.copy_buffer_to_buffer(&src, at + tok_bytes, &b.rope, 0, rope_bytes);
                }
                enc.copy_buffer_to_buffer(&b.ids, 0, &b.tokens, 0, row);
            }
            kernels::encode(&mut enc, &self.list);
            enc.copy_buffer_to_buffer(&b.ids, 0, &out, k as u64 * row, row);
        }
        enc.copy_buffer_to_buffer(&out, 0, &read, 0, out_bytes);
        let raw = self.gpu.submit_read(enc.finish(), &read, out_bytes);
        for buf in [&src, &out, &read] {
            self.gpu.release(buf);
        }
        Ok(raw?
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }
}

/// The prompt attention's query tiles in `batch` (as `kernels::fill_tiles` cuts them).
fn attn_tiles(batch: &ForwardBatch, qt: usize) -> usize {
    batch.seqs.iter().map(|q| q.query_len.div_ceil(qt)).sum()
}

fn words_bytes(w: &[u32]) -> Vec<u8> {
    w.iter().flat_map(|x| x.to_le_bytes()).collect()
}

impl Executor for WgpuExecutor {
    fn backend_name(&self) -> &'static str {
        "wgpu"
    }

    fn kv_spec(&self) -> KvCacheSpec {
        self.kv
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<&[f32], BackendError> {
        self.step(batch, Want::Logits)?;
        Ok(&self.logits)
    }

    fn forward_greedy(&mut self, batch: &ForwardBatch) -> Result<Vec<u32>, BackendError> {
        self.step(batch, Want::Ids)
    }

    fn forward_greedy_chain(
        &mut self,
        batch: &ForwardBatch,
        steps: usize,
    ) -> Result<Vec<u32>, BackendError> {
        // A profiled chain runs step by step, so each step's dispatches are timed.
        if self.profiling || steps == 1 {
            return crate::chain::by_steps(self, batch, steps);
        }
        self.chain(batch, steps)
    }

    fn device_memory_peak(&self) -> Option<u64> {
        Some(self.gpu.peak)
    }

    fn set_profiling(&mut self, on: bool) {
        self.profiling = on;
    }

    fn take_profile(&mut self) -> Vec<OpStat> {
        std::mem::take(&mut self.profile)
    }

    fn profiled_step_ns(&self) -> Option<u64> {
        self.step_wall_ns
    }

    fn profile_note(&self) -> Option<String> {
        let dev = self.step_device_ns?;
        let host = self.step_host_ns.unwrap_or(0);
        Some(format!(
            "wgpu: each op's time is what leaving its dispatches out saves the step on the device \
             (GPU timestamps at the step's start and end, medians of {OMISSION_ROUNDS}); the whole \
             step took {:.3} ms on the device; the step time above is its wall time without the \
             profile's timing runs, so \"(outside ops)\" is host work and dispatch gaps; the \
             host took {:.3} ms of it to upload, record and encode the step ({} dispatches, \
             submitted as they were encoded, so the device ran meanwhile)",
            dev as f64 / 1e6,
            host as f64 / 1e6,
            self.last_dispatches(),
        ))
    }
}
