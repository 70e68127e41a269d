//! An [`Executor`] over a tensor-parallel group: one rank executor per thread, each holding its
//! share of the weights and of every KV block (see `shard`). Every call hands all ranks the same
//! batch; the ranks meet in the all-reduces of the layer sequence and end with identical residual
//! streams, hence identical logits and tokens, and the lead rank's answer is the group's.
//!
//! The lead rank runs on the caller's thread and the others on their own: a decode step is a few
//! milliseconds, and every hop between threads (a blocked thread woken by a channel) adds tens of
//! microseconds to it. For the same reason a GPU group's rank threads spin for a moment on their
//! job channel before they block (`spinning`): the next decode step's job comes within a few
//! hundred microseconds of the last reply.
//!
//! A rank that fails stops the group: its error is returned, the collectives are aborted (so no
//! rank waits for it forever), and every later call answers with the same error.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvError, Sender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use quire_core::BlockId;

use super::{HostReduce, Shard};
use crate::{
    BackendError, Executor, ForwardBatch, KvCacheSpec, MaskFill, OpStat, SampleParams, SeqBatch,
};

/// Stops a group's collectives so that ranks waiting in one return with an error.
pub trait Abort: Send + Sync {
    fn abort(&self, why: &str);
}

impl Abort for HostReduce {
    fn abort(&self, why: &str) {
        HostReduce::abort(self, why)
    }
}

/// Builds rank `shard.rank`'s executor, on that rank's thread.
pub type MakeRank = dyn Fn(Shard) -> Result<Box<dyn Executor>, BackendError> + Send + Sync;

/// A batch the rank threads can share (`ForwardBatch` borrows).
struct OwnedBatch {
    token_ids: Vec<u32>,
    positions: Vec<u32>,
    slot_mapping: Vec<u32>,
    seqs: Vec<(usize, usize, usize, Vec<BlockId>)>,
    logits_indices: Vec<u32>,
}

impl OwnedBatch {
    fn new(b: &ForwardBatch) -> Self {
        Self {
            token_ids: b.token_ids.to_vec(),
            positions: b.positions.to_vec(),
            slot_mapping: b.slot_mapping.to_vec(),
            seqs: b
                .seqs
                .iter()
                .map(|s| {
                    (
                        s.query_start,
                        s.query_len,
                        s.seq_len,
                        s.block_table.to_vec(),
                    )
                })
                .collect(),
            logits_indices: b.logits_indices.to_vec(),
        }
    }

    fn with<R>(&self, f: impl FnOnce(&ForwardBatch) -> R) -> R {
        let seqs: Vec<SeqBatch> = self
            .seqs
            .iter()
            .map(|(query_start, query_len, seq_len, t)| SeqBatch {
                query_start: *query_start,
                query_len: *query_len,
                seq_len: *seq_len,
                block_table: t,
            })
            .collect();
        f(&ForwardBatch {
            token_ids: &self.token_ids,
            positions: &self.positions,
            slot_mapping: &self.slot_mapping,
            seqs: &seqs,
            logits_indices: &self.logits_indices,
        })
    }
}

#[derive(Clone)]
enum Call {
    Logits,
    Greedy,
    Chain(usize),
    Sample(Arc<Vec<SampleParams>>),
}

enum Job {
    Run(Arc<OwnedBatch>, Call),
    Profiling(bool),
    TakeProfile,
    Peak,
}

/// The lead rank's logits, where its executor left them (see `TpExecutor::forward`).
struct LogitsView(*const f32, usize);

// SAFETY: the view is only read by the group's thread, under the rules `TpExecutor::forward`
// states; the rank thread does not touch the buffer meanwhile.
unsafe impl Send for LogitsView {}

enum Reply {
    Ready {
        kv: KvCacheSpec,
        vocab: usize,
        name: &'static str,
    },
    Logits(LogitsView),
    Tokens(Vec<u32>),
    Profile(Vec<OpStat>, Option<u64>),
    Done,
    Failed(BackendError),
}

struct Worker {
    jobs: Sender<Job>,
    thread: Option<JoinHandle<()>>,
}

pub struct TpExecutor {
    name: &'static str,
    /// Rank 0, run on the caller's thread.
    lead: Box<dyn Executor>,
    /// Ranks 1.., each on its own thread.
    ranks: Vec<Worker>,
    /// How long the rank threads and the gathering of their replies spin before blocking.
    spin: Arc<AtomicU64>,
    /// Every rank's replies, tagged with the rank, in the order they come.
    replies: Receiver<(usize, Reply)>,
    abort: Arc<dyn Abort>,
    kv: KvCacheSpec,
    vocab: usize,
    /// The largest rank's device memory peak seen by `take_profile`.
    peak: Option<u64>,
    failed: Option<String>,
}

/// Waits for a message, spinning for up to `spin` microseconds before blocking.
fn recv_soon<T>(rx: &Receiver<T>, spin: u64) -> Result<T, RecvError> {
    if spin == 0 {
        return rx.recv();
    }
    let t0 = Instant::now();
    let spin = Duration::from_micros(spin);
    loop {
        match rx.try_recv() {
            Ok(v) => return Ok(v),
            Err(TryRecvError::Disconnected) => return Err(RecvError),
            Err(TryRecvError::Empty) if t0.elapsed() >= spin => return rx.recv(),
            Err(TryRecvError::Empty) => std::hint::spin_loop(),
        }
    }
}

/// What one rank answers to `job`.
fn answer(ex: &mut dyn Executor, job: Job, lead: bool) -> Reply {
    match job {
        Job::Run(b, call) => b.with(|b| run_call(ex, b, &call, lead)),
        Job::Profiling(on) => {
            ex.set_profiling(on);
            Reply::Done
        }
        Job::TakeProfile => Reply::Profile(ex.take_profile(), ex.device_memory_peak()),
        Job::Peak => Reply::Profile(Vec::new(), ex.device_memory_peak()),
    }
}

/// Runs one rank: builds its executor, then answers jobs until the group drops its sender.
fn rank_loop(
    shard: Shard,
    make: Arc<MakeRank>,
    jobs: Receiver<Job>,
    out: Sender<(usize, Reply)>,
    spin: Arc<AtomicU64>,
    abort: Arc<dyn Abort>,
) {
    // A failing rank stops the collectives itself: the lead, which would otherwise notice the
    // failure, may be waiting in one of them on the group's thread.
    let reply = |r: Reply| {
        if let Reply::Failed(e) = &r {
            abort.abort(&format!(
                "rank {} of {} failed: {e}",
                shard.rank, shard.size
            ));
        }
        let _ = out.send((shard.rank, r));
    };
    let run = || -> Result<(), BackendError> {
        let mut ex = make(shard)?;
        reply(Reply::Ready {
            kv: ex.kv_spec(),
            vocab: ex.vocab_size(),
            name: ex.backend_name(),
        });
        let spin_us = || spin.load(Ordering::Relaxed);
        while let Ok(job) = recv_soon(&jobs, spin_us()) {
            reply(answer(ex.as_mut(), job, shard.is_lead()));
        }
        Ok(())
    };
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run));
    let err = match out {
        Ok(Ok(())) => return,
        Ok(Err(e)) => e,
        Err(p) => BackendError::Config(format!(
            "rank {} panicked: {}",
            shard.rank,
            p.downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| p.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)")
        )),
    };
    reply(Reply::Failed(err));
}

fn run_call(ex: &mut dyn Executor, b: &ForwardBatch, call: &Call, lead: bool) -> Reply {
    let out = match call {
        Call::Logits if lead => ex
            .forward(b)
            .map(|l| Reply::Logits(LogitsView(l.as_ptr(), l.len()))),
        // Only the lead's logits are returned: the others skip the copy to the host.
        Call::Logits => ex.forward_discard(b).map(|()| Reply::Done),
        Call::Greedy => ex.forward_greedy(b).map(Reply::Tokens),
        Call::Chain(steps) => ex.forward_greedy_chain(b, *steps).map(Reply::Tokens),
        Call::Sample(rows) => ex.forward_sample(b, rows, None).map(Reply::Tokens),
    };
    out.unwrap_or_else(Reply::Failed)
}

impl TpExecutor {
    /// Starts ranks 1.. on threads of their own, each building its executor with `make`, and
    /// builds rank 0 on this thread meanwhile; `abort` stops the collectives those executors
    /// share. Fails, with every rank stopped, when any rank fails or the ranks disagree on the KV
    /// block size or vocabulary. The group's KV pool is the smallest rank's.
    pub fn new(
        size: usize,
        abort: Arc<dyn Abort>,
        make: Arc<MakeRank>,
    ) -> Result<Self, BackendError> {
        let spin = Arc::new(AtomicU64::new(0));
        let mut ranks = Vec::with_capacity(size.saturating_sub(1));
        let (replies_tx, replies) = channel();
        for rank in 1..size {
            let (jobs, jobs_rx) = channel();
            let replies_tx = replies_tx.clone();
            let (make, spin, abort) = (make.clone(), spin.clone(), abort.clone());
            let shard = Shard { rank, size };
            let thread = std::thread::Builder::new()
                .name(format!("quire-tp-rank-{rank}"))
                .spawn(move || rank_loop(shard, make, jobs_rx, replies_tx, spin, abort))
                .map_err(|e| BackendError::Config(format!("cannot start rank {rank}: {e}")))?;
            ranks.push(Worker {
                jobs,
                thread: Some(thread),
            });
        }
        drop(replies_tx);
        let lead = match make(Shard { rank: 0, size }) {
            Ok(e) => e,
            Err(e) => {
                let why = format!("rank 0 of {size} failed: {e}");
                abort.abort(&why);
                drop(ranks); // ends and joins the other ranks
                return Err(BackendError::Config(why));
            }
        };
        let mut seen = vec![None; size];
        seen[0] = Some((lead.kv_spec(), lead.vocab_size(), lead.backend_name()));
        let mut me = Self {
            name: "cpu",
            lead,
            ranks,
            spin,
            replies,
            abort,
            kv: KvCacheSpec {
                num_blocks: 0,
                block_size: 0,
            },
            vocab: 0,
            peak: None,
            failed: None,
        };
        for reply in me.gather(size - 1)? {
            if let (rank, Reply::Ready { kv, vocab, name }) = reply {
                seen[rank] = Some((kv, vocab, name));
            }
        }
        let seen: Vec<_> = seen
            .into_iter()
            .map(|s| s.expect("every rank replied"))
            .collect();
        let (kv, vocab, name) = seen[0];
        if let Some(r) = seen
            .iter()
            .position(|&(k, v, _)| k.block_size != kv.block_size || v != vocab)
        {
            let e = BackendError::Config(format!(
                "its KV blocks ({} tokens) or vocabulary ({}) differ from rank 0's ({}, {vocab})",
                seen[r].0.block_size, seen[r].1, kv.block_size
            ));
            return Err(me.fail(r, e));
        }
        // Ranks that sized their pools from their own free memory may differ by a few blocks:
        // the group hands out only the ids every rank holds.
        let kv = KvCacheSpec {
            num_blocks: seen.iter().map(|s| s.0.num_blocks).min().unwrap_or(0),
            ..kv
        };
        (me.kv, me.vocab, me.name) = (kv, vocab, name);
        Ok(me)
    }

    /// Lets the rank threads (and the gathering of their replies) spin for up to `micros` on
    /// their channel before blocking: for GPU ranks, whose threads wait while the GPU works, so
    /// a spinning thread costs no compute. CPU ranks leave it at 0 (a spinning thread would take
    /// a core from the ranks' own compute threads).
    pub fn spinning(self, micros: u64) -> Self {
        self.spin.store(micros, Ordering::Relaxed);
        self
    }

    /// Records rank `rank`'s failure (the first one stays), aborts the collectives so no rank
    /// waits for it, and returns the error every later call gets.
    fn fail(&mut self, rank: usize, e: BackendError) -> BackendError {
        let why = format!("rank {rank} of {} failed: {e}", self.ranks.len() + 1);
        self.abort.abort(&why);
        let why = self.failed.get_or_insert(why).clone();
        BackendError::Config(why)
    }

    fn stopped(&self) -> Result<(), BackendError> {
        match &self.failed {
            Some(why) => Err(BackendError::Config(format!(
                "the tensor-parallel group stopped earlier: {why}"
            ))),
            None => Ok(()),
        }
    }

    /// Gathers `n` replies of ranks 1.., in the order they come, sorted by rank. The first
    /// failure stops the group at once (aborting the collectives, so ranks waiting in one return
    /// too); the other replies are still gathered, then that failure is returned.
    fn gather(&mut self, n: usize) -> Result<Vec<(usize, Reply)>, BackendError> {
        let mut got = Vec::with_capacity(n);
        let mut first_err = None;
        let spin = self.spin.load(Ordering::Relaxed);
        for _ in 0..n {
            match recv_soon(&self.replies, spin) {
                Ok((rank, Reply::Failed(e))) => {
                    if first_err.is_none() {
                        first_err = Some(self.fail(rank, e));
                    }
                }
                Ok(r) => got.push(r),
                Err(_) => {
                    if first_err.is_none() {
                        let e = BackendError::Config("its thread ended".into());
                        first_err = Some(self.fail(got.len() + 1, e));
                    }
                    break;
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => {
                got.sort_by_key(|r| r.0);
                Ok(got)
            }
        }
    }

    /// Sends `job` to ranks 1.., answers it on rank 0 here, and gathers the replies, the lead's
    /// first.
    fn all(&mut self, job: impl Fn() -> Job) -> Result<Vec<Reply>, BackendError> {
        let lead_job = job();
        self.all_with(job, |ex| answer(ex, lead_job, true))
    }

    /// `all`, with rank 0's answer given by `lead` (run here, after the others have their jobs).
    fn all_with(
        &mut self,
        job: impl Fn() -> Job,
        lead: impl FnOnce(&mut dyn Executor) -> Reply,
    ) -> Result<Vec<Reply>, BackendError> {
        self.stopped()?;
        let mut sent = 0;
        for r in &self.ranks {
            if r.jobs.send(job()).is_err() {
                break;
            }
            sent += 1;
        }
        let lead = lead(self.lead.as_mut());
        if let Reply::Failed(e) = lead {
            let err = self.fail(0, e);
            let _ = self.gather(sent);
            return Err(err);
        }
        let got = self.gather(sent)?;
        if sent < self.ranks.len() {
            let e = BackendError::Config("its thread ended".into());
            return Err(self.fail(sent + 1, e));
        }
        Ok(std::iter::once(lead)
            .chain(got.into_iter().map(|(_, r)| r))
            .collect())
    }

    fn run(&mut self, b: &ForwardBatch, call: Call) -> Result<Reply, BackendError> {
        let batch = Arc::new(OwnedBatch::new(b));
        let mut replies = self.all(|| Job::Run(batch.clone(), call.clone()))?;
        Ok(replies.swap_remove(0))
    }

    fn tokens(&mut self, b: &ForwardBatch, call: Call) -> Result<Vec<u32>, BackendError> {
        match self.run(b, call)? {
            Reply::Tokens(t) => Ok(t),
            _ => Err(BackendError::Config("rank 0 answered out of turn".into())),
        }
    }
}

impl Executor for TpExecutor {
    fn backend_name(&self) -> &'static str {
        self.name
    }

    fn kv_spec(&self) -> KvCacheSpec {
        self.kv
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// The lead rank's logits in place (64 rows of a 128k vocabulary are 33 MB: no copy).
    fn forward(&mut self, batch: &ForwardBatch) -> Result<&[f32], BackendError> {
        match self.run(batch, Call::Logits)? {
            // SAFETY: the view points into the lead rank's executor's logits, which its thread
            // leaves untouched until its next job; every job is sent through `&mut self`, which
            // the returned slice borrows, and the executor lives until `self` is dropped (its
            // thread is joined then).
            Reply::Logits(LogitsView(p, n)) => Ok(unsafe { std::slice::from_raw_parts(p, n) }),
            _ => Err(BackendError::Config("rank 0 answered out of turn".into())),
        }
    }

    fn forward_greedy(&mut self, batch: &ForwardBatch) -> Result<Vec<u32>, BackendError> {
        self.tokens(batch, Call::Greedy)
    }

    fn forward_greedy_chain(
        &mut self,
        batch: &ForwardBatch,
        steps: usize,
    ) -> Result<Vec<u32>, BackendError> {
        self.tokens(batch, Call::Chain(steps))
    }

    /// With `masks`, the lead rank samples under them; the other ranks sample without (their
    /// tokens are not read: the lead's are the group's), so the masks stay on this thread.
    fn forward_sample(
        &mut self,
        batch: &ForwardBatch,
        rows: &[SampleParams],
        masks: Option<&mut MaskFill>,
    ) -> Result<Vec<u32>, BackendError> {
        crate::check_sample_rows(batch, rows)?;
        let call = Call::Sample(Arc::new(rows.to_vec()));
        let Some(fill) = masks else {
            return self.tokens(batch, call);
        };
        let owned = Arc::new(OwnedBatch::new(batch));
        let mut replies = self.all_with(
            || Job::Run(owned.clone(), call.clone()),
            |ex| {
                ex.forward_sample(batch, rows, Some(fill))
                    .map_or_else(Reply::Failed, Reply::Tokens)
            },
        )?;
        match replies.swap_remove(0) {
            Reply::Tokens(t) => Ok(t),
            _ => Err(BackendError::Config("rank 0 answered out of turn".into())),
        }
    }

    /// The largest rank's peak (each rank has its own device).
    fn device_memory_peak(&self) -> Option<u64> {
        if self.failed.is_some() {
            return self.peak;
        }
        let mut peak = self.peak.max(self.lead.device_memory_peak());
        let sent = self
            .ranks
            .iter()
            .filter(|r| r.jobs.send(Job::Peak).is_ok())
            .count();
        for _ in 0..sent {
            if let Ok((_, Reply::Profile(_, p))) = self.replies.recv() {
                peak = peak.max(p);
            }
        }
        peak
    }

    fn set_profiling(&mut self, on: bool) {
        let _ = self.all(|| Job::Profiling(on));
    }

    /// The lead rank's op statistics (every rank runs the same ops on its share).
    fn take_profile(&mut self) -> Vec<OpStat> {
        let Ok(replies) = self.all(|| Job::TakeProfile) else {
            return Vec::new();
        };
        let mut lead = Vec::new();
        for (i, r) in replies.into_iter().enumerate() {
            if let Reply::Profile(stats, peak) = r {
                self.peak = self.peak.max(peak);
                if i == 0 {
                    lead = stats;
                }
            }
        }
        lead
    }
}

impl Drop for Worker {
    /// Closing the job channel ends the rank loop; a rank stuck in a collective is freed by the
    /// abort a failure already sent.
    fn drop(&mut self) {
        let (dead, _) = channel();
        self.jobs = dead;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
