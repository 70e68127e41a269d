//! Sampling on the device: `sample_rows` (kernels/sample.cu) picks each logits row's token with
//! that row's [`SampleParams`] the way [`crate::sample_row`] does (top-k, top-p, min-p,
//! temperature, the caller's uniform draw), so a sampled step copies token ids to the host
//! instead of `[rows, vocab]` logits. Devices without the kernel's ~120 KB of shared memory per
//! CTA sample on the host instead. Structured outputs' allowed-token masks ride along: staged in
//! page-locked memory, uploaded on the stream behind the forward pass, and read by the kernel,
//! which treats a disallowed logit as −∞ ([`crate::sample_row_masked`]).

use std::sync::Arc;

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaFunction, CudaModule, LaunchConfig, PushKernelArg};

use super::gpu::{cuda_err, DBuf, Gpu, HostBuf};
use super::llama::CudaExecutor;
use crate::{
    check_sample_rows, mask_words, sample_on_host, BackendError, ForwardBatch, MaskFill,
    SampleParams,
};

/// Threads per CTA of `sample_rows` (`S_THREADS`); one CTA per row.
pub const SAMPLE_THREADS: u32 = 1024;
/// Dynamic shared memory of `sample_rows`: two u64 sums and a u32 count per bucket
/// (`S_BUCKETS` = 4096) and a u64 sort key per gathered element (`S_CAP` = 4096).
pub const SAMPLE_SMEM: u32 = (2 * 4096 + 4096) * 8 + 4096 * 4;
/// `i32` words of one row's parameters on the device.
pub const PARAM_WORDS: usize = 6;

/// `sample_rows` with its parameter buffer.
pub struct SampleKernel {
    f: CudaFunction,
    /// Host staging of the parameters: `[rows, PARAM_WORDS]`.
    words: Vec<i32>,
    /// `[rows, PARAM_WORDS]`, grown to the most rows seen.
    params: Option<DBuf<i32>>,
    /// Allowed-token masks, `[rows, mask_words(vocab)]`: page-locked staging the caller fills
    /// (so the upload is a DMA that does not hold up the host), and its device copy.
    mask_host: HostBuf<u32>,
    mask_dev: Option<DBuf<u32>>,
}

impl SampleKernel {
    /// `sample_rows` from the compiled sample.cu `module`; `None` when the device cannot give one
    /// CTA the kernel's shared memory.
    pub fn new(gpu: &Gpu, module: &Arc<CudaModule>) -> Result<Option<Self>, BackendError> {
        let f = Gpu::function(module, "sample_rows")?;
        gpu.ctx
            .bind_to_thread()
            .map_err(cuda_err("binding the context"))?;
        let opt_in = gpu
            .ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(cuda_err("shared memory per block"))?;
        let fixed = f
            .shared_size_bytes()
            .map_err(cuda_err("sample_rows shared memory"))?;
        if i64::from(opt_in) < i64::from(fixed) + i64::from(SAMPLE_SMEM) {
            return Ok(None);
        }
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            SAMPLE_SMEM as i32,
        )
        .map_err(cuda_err(
            "sample_rows: setting the dynamic shared memory size",
        ))?;
        Ok(Some(Self {
            f,
            words: Vec::new(),
            params: None,
            mask_host: HostBuf::default(),
            mask_dev: None,
        }))
    }

    /// The device layout of `rows`: temperature, top_k, top_p and min_p as 32-bit words, then
    /// u's 64 bits, low word first.
    pub fn pack(rows: &[SampleParams], words: &mut Vec<i32>) {
        words.clear();
        for p in rows {
            let u = p.u.to_bits();
            words.extend([
                p.temperature.to_bits() as i32,
                p.top_k as i32,
                p.top_p.to_bits() as i32,
                p.min_p.to_bits() as i32,
                u as u32 as i32,
                (u >> 32) as u32 as i32,
            ]);
        }
    }

    /// Has `fill` write the masks of `rows` logits rows of `vocab` tokens (all bits set on entry;
    /// see `Executor::forward_sample`) into page-locked staging and enqueues their upload.
    /// Returns the device address of the masks, for `launch`. The staging is written again only
    /// by the next call: callers synchronize the stream (reading the tokens) before that.
    pub fn stage_masks(
        &mut self,
        gpu: &Gpu,
        rows: usize,
        vocab: usize,
        fill: &mut MaskFill,
    ) -> Result<u64, BackendError> {
        let n = rows * mask_words(vocab);
        let host = self.mask_host.slice_mut(n)?;
        host.fill(u32::MAX);
        fill(host);
        if self.mask_dev.as_ref().is_none_or(|b| b.len < n) {
            self.mask_dev = Some(gpu.alloc(n.next_power_of_two())?);
        }
        let dev = self.mask_dev.as_mut().expect("allocated above");
        gpu.htod(self.mask_host.slice(n), dev, 0)?;
        Ok(dev.ptr)
    }

    /// Uploads `rows` and enqueues the kernel: token `i` of `out` from row `i` of `logits`, only
    /// among the tokens row `i` of `mask` allows when `mask` is not 0.
    // logits: [rows.len(), stride] f32 (the first `vocab` of each row); out: [rows.len()] i32;
    // mask: [rows.len(), mask_words(vocab)] u32 or 0
    ///
    /// # Safety
    ///
    /// `logits` (`rows.len() · stride` f32, `vocab <= stride`), `out` (`rows.len()` i32) and a
    /// non-zero `mask` (`rows.len() · mask_words(vocab)` u32) are live device allocations on
    /// `gpu`'s context, not freed before the stream has finished the kernel, and `out` overlaps
    /// neither of the others.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch(
        &mut self,
        gpu: &Gpu,
        logits: u64,
        stride: usize,
        vocab: usize,
        rows: &[SampleParams],
        mask: u64,
        out: u64,
    ) -> Result<(), BackendError> {
        if rows.is_empty() {
            return Ok(());
        }
        if vocab == 0 || vocab > i32::MAX as usize || rows.len() > i32::MAX as usize {
            return Err(BackendError::InvalidBatch(format!(
                "cannot sample {} rows of {vocab} logits",
                rows.len()
            )));
        }
        Self::pack(rows, &mut self.words);
        if self
            .params
            .as_ref()
            .is_none_or(|b| b.len < self.words.len())
        {
            self.params = Some(gpu.alloc(self.words.len().next_power_of_two())?);
        }
        let params = self.params.as_mut().expect("allocated above");
        gpu.htod(&self.words, params, 0)?;
        let cfg = LaunchConfig {
            grid_dim: (rows.len() as u32, 1, 1),
            block_dim: (SAMPLE_THREADS, 1, 1),
            shared_mem_bytes: SAMPLE_SMEM,
        };
        let (stride, vocab) = (stride as i64, vocab as i32);
        let mut b = gpu.stream.launch_builder(&self.f);
        b.arg(&logits)
            .arg(&stride)
            .arg(&vocab)
            .arg(&params.ptr)
            .arg(&mask)
            .arg(&out);
        // SAFETY: the arguments match sample_rows' signature; `logits` holds `rows` rows of
        // `stride` floats, `out` `rows` ints and `mask` (if not 0) `rows` masks (this fn's
        // contract), `params` `rows · PARAM_WORDS` words (grown above).
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(cuda_err("sample_rows launch"))
    }
}

/// Most CTAs `argmax_split` gives a row; see `argmax_ctas`.
pub const ARGMAX_MAX_CTAS: usize = 64;

/// CTAs per row of `argmax_split`: slices of about 4096 logits (a 128K vocabulary takes 32).
pub fn argmax_ctas(vocab: usize) -> usize {
    vocab.div_ceil(4096).clamp(1, ARGMAX_MAX_CTAS)
}

impl CudaExecutor {
    /// The greedy pick of the first `rows` logits rows into `out` (`rows` i32 on the device).
    ///
    /// # Safety
    ///
    /// `out` is a live device allocation of at least `rows` i32 on this executor's context, not
    /// freed before the stream has finished the kernel; `rows` is at most the logits rows.
    pub(super) unsafe fn launch_argmax(&self, rows: usize, out: u64) -> Result<(), BackendError> {
        use super::gpu::KArg::{I, P};
        let s = &self.s;
        let vocab = self.cfg.vocab_size;
        // SAFETY: argmax_split's list; `logits`, `argmax_part` and `argmax_counters` are scratch
        // sized at load for the largest batch's rows, `out` the caller's (this fn's contract).
        unsafe {
            self.gpu.launch(
                &self.k.argmax,
                (argmax_ctas(vocab) as u32, rows as u32, 1),
                (256, 1, 1),
                &[
                    P(s.logits.ptr),
                    I(vocab as i32),
                    P(out),
                    P(s.argmax_part.ptr),
                    P(s.argmax_counters.ptr),
                ],
            )
        }?;
        self.gpu.trace_end();
        Ok(())
    }

    /// Runs the batch and leaves one token per logits row in `host_ids`, picked on the device
    /// (on the host when the device has no `sample_rows`), among the allowed tokens when `masks`
    /// is given (see `Executor::forward_sample`: it is called once the forward is enqueued).
    pub(super) fn forward_sample_inner(
        &mut self,
        batch: &ForwardBatch,
        rows: &[SampleParams],
        masks: Option<&mut MaskFill>,
    ) -> Result<(), BackendError> {
        check_sample_rows(batch, rows)?;
        let vocab = self.cfg.vocab_size;
        if self.k.sample.is_none() {
            self.forward_inner(batch)?;
            let ids = sample_on_host(self.logits_on_host(), vocab, rows, masks);
            self.host_ids = ids.into_iter().map(|t| t as i32).collect();
            return Ok(());
        }
        self.run(batch, false)?;
        let nl = rows.len();
        let ids = &self.s.ids;
        if let Some(k) = self.k.sample.as_mut() {
            let logits = self.s.logits.ptr;
            // The host waits here (if at all) for masks computed during the forward, which the
            // stream is running meanwhile.
            let mask = match masks {
                Some(fill) => k.stage_masks(&self.gpu, nl, vocab, fill)?,
                None => 0,
            };
            // SAFETY: `logits` holds the step's `rows.len()` rows of `vocab` f32 (checked by
            // `check_sample_rows`) and `ids` scratch grown by `run` for as many i32, both alive
            // for the executor's life; `mask` is 0 or `stage_masks`' buffer of `nl` rows, which
            // the kernel owns until the next call.
            unsafe { k.launch(&self.gpu, logits, vocab, vocab, rows, mask, ids.ptr) }?;
        }
        // Bytes: the rows are read a few times (a histogram pass, gathers), mostly from L2.
        self.prof
            .mark(&self.gpu, "sample", None, 4 * nl * vocab, 0)?;
        self.host_ids.resize(nl, 0);
        self.gpu.dtoh(ids, &mut self.host_ids)?;
        self.prof.finish(&self.gpu)
    }
}
