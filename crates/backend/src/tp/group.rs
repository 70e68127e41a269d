//! An [`Executor`] over a tensor-parallel group: one rank executor per thread, each holding its
//! share of the weights and of every KV block (see `shard`). Every call hands all ranks the same
//! batch; the ranks meet in the all-reduces of the layer sequence and end with identical residual
//! streams, hence identical logits and tokens, and the lead rank's answer is the group's.
//!
//! A rank that fails stops the group: its error is returned, the collectives are aborted (so no
//! rank waits for it forever), and every later call answers with the same error.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use quire_core::BlockId;

use super::{HostReduce, Shard};
use crate::{BackendError, Executor, ForwardBatch, KvCacheSpec, OpStat, SampleParams, SeqBatch};

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
    ranks: Vec<Worker>,
    /// Every rank's replies, tagged with the rank, in the order they come.
    replies: Receiver<(usize, Reply)>,
    abort: Arc<dyn Abort>,
    kv: KvCacheSpec,
    vocab: usize,
    /// The largest rank's device memory peak seen by `take_profile`.
    peak: Option<u64>,
    failed: Option<String>,
}

/// Runs one rank: builds its executor, then answers jobs until the group drops its sender.
fn rank_loop(shard: Shard, make: Arc<MakeRank>, jobs: Receiver<Job>, out: Sender<(usize, Reply)>) {
    let reply = |r: Reply| {
        let _ = out.send((shard.rank, r));
    };
    let run = || -> Result<(), BackendError> {
        let mut ex = make(shard)?;
        reply(Reply::Ready {
            kv: ex.kv_spec(),
            vocab: ex.vocab_size(),
            name: ex.backend_name(),
        });
        for job in jobs.iter() {
            let reply_to_job = match job {
                Job::Run(b, call) => b.with(|b| run_call(ex.as_mut(), b, &call, shard.is_lead())),
                Job::Profiling(on) => {
                    ex.set_profiling(on);
                    Reply::Done
                }
                Job::TakeProfile => Reply::Profile(ex.take_profile(), ex.device_memory_peak()),
                Job::Peak => Reply::Profile(Vec::new(), ex.device_memory_peak()),
            };
            reply(reply_to_job);
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
        Call::Logits => ex.forward(b).map(|l| {
            if lead {
                Reply::Logits(LogitsView(l.as_ptr(), l.len()))
            } else {
                Reply::Done
            }
        }),
        Call::Greedy => ex.forward_greedy(b).map(Reply::Tokens),
        Call::Chain(steps) => ex.forward_greedy_chain(b, *steps).map(Reply::Tokens),
        Call::Sample(rows) => ex.forward_sample(b, rows).map(Reply::Tokens),
    };
    out.unwrap_or_else(Reply::Failed)
}

impl TpExecutor {
    /// Starts `size` rank threads, each building its executor with `make`; `abort` stops the
    /// collectives those executors share. Fails, with every rank stopped, when any rank fails or
    /// the ranks disagree on the KV block size or vocabulary. The group's KV pool is the
    /// smallest rank's.
    pub fn new(
        size: usize,
        abort: Arc<dyn Abort>,
        make: Arc<MakeRank>,
    ) -> Result<Self, BackendError> {
        let mut ranks = Vec::with_capacity(size);
        let (replies_tx, replies) = channel();
        for rank in 0..size {
            let (jobs, jobs_rx) = channel();
            let replies_tx = replies_tx.clone();
            let make = make.clone();
            let thread = std::thread::Builder::new()
                .name(format!("quire-tp-rank-{rank}"))
                .spawn(move || rank_loop(Shard { rank, size }, make, jobs_rx, replies_tx))
                .map_err(|e| BackendError::Config(format!("cannot start rank {rank}: {e}")))?;
            ranks.push(Worker {
                jobs,
                thread: Some(thread),
            });
        }
        drop(replies_tx);
        let mut me = Self {
            name: "cpu",
            ranks,
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
        let mut seen = vec![None; size];
        for reply in me.gather(size)? {
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

    /// Records rank `rank`'s failure, aborts the collectives so no rank waits for it, and
    /// returns the error every later call gets.
    fn fail(&mut self, rank: usize, e: BackendError) -> BackendError {
        let why = format!("rank {rank} of {} failed: {e}", self.ranks.len());
        self.abort.abort(&why);
        self.failed = Some(why.clone());
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

    /// Gathers `n` replies, in the order they come, sorted by rank. The first failure stops the
    /// group at once (aborting the collectives, so ranks waiting in one return too); the other
    /// replies are still gathered, then that failure is returned.
    fn gather(&mut self, n: usize) -> Result<Vec<(usize, Reply)>, BackendError> {
        let mut got = Vec::with_capacity(n);
        let mut first_err = None;
        for _ in 0..n {
            match self.replies.recv() {
                Ok((rank, Reply::Failed(e))) => {
                    if first_err.is_none() {
                        first_err = Some(self.fail(rank, e));
                    }
                }
                Ok(r) => got.push(r),
                Err(_) => {
                    if first_err.is_none() {
                        let e = BackendError::Config("its thread ended".into());
                        first_err = Some(self.fail(got.len(), e));
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

    /// Sends `job` to every rank and gathers the replies, the lead's first.
    fn all(&mut self, job: impl Fn() -> Job) -> Result<Vec<Reply>, BackendError> {
        self.stopped()?;
        let mut sent = 0;
        for r in &self.ranks {
            if r.jobs.send(job()).is_err() {
                break;
            }
            sent += 1;
        }
        let got = self.gather(sent)?;
        if sent < self.ranks.len() {
            return Err(self.fail(sent, BackendError::Config("its thread ended".into())));
        }
        Ok(got.into_iter().map(|(_, r)| r).collect())
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

    fn forward_sample(
        &mut self,
        batch: &ForwardBatch,
        rows: &[SampleParams],
    ) -> Result<Vec<u32>, BackendError> {
        crate::check_sample_rows(batch, rows)?;
        self.tokens(batch, Call::Sample(Arc::new(rows.to_vec())))
    }

    /// The largest rank's peak (each rank has its own device).
    fn device_memory_peak(&self) -> Option<u64> {
        if self.failed.is_some() {
            return self.peak;
        }
        let mut peak = self.peak;
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

impl Drop for TpExecutor {
    fn drop(&mut self) {
        // Closing the job channels ends every rank loop; a rank stuck in a collective is freed by
        // the abort a failure already sent.
        for r in &mut self.ranks {
            let (dead, _) = channel();
            r.jobs = dead;
        }
        for r in &mut self.ranks {
            if let Some(t) = r.thread.take() {
                let _ = t.join();
            }
        }
    }
}
