//! The engine step's guided (structured-output) rows. Their next-token masks depend only on the
//! tokens so far, so a [`MaskJob`] computes them on rayon's threads while the forward pass runs.
//! When every row's pick needs nothing but its logits and its mask, the executor picks on the
//! device with the masks uploaded beside the step (`execute_guided_on_device`: only token ids
//! and 6 KB of mask bits per row cross the bus); otherwise the logits come to the host, and the
//! greedy picks of rows that need nothing else are made in parallel here.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{sync_channel, Receiver};
use std::time::Instant;

use quire_backend::{mask_words, BackendError, SampleParams};
use quire_core::{BlockId, FinishReason, SeqId, TokenId};
use rayon::prelude::*;

use super::{plain_pick, Engine, RequestState};
use crate::constrain::{self, Grammars, GreedyRow, Guide, MaskResult};
use crate::runner::execute_sample;
use crate::sampler::Sampled;
use crate::EngineError;

/// One step's grammar masks, computed on rayon's threads (one task per step, the rows in
/// parallel) while the engine thread runs the forward pass. The guides travel with the task and
/// come back with [`MaskJob::finish`]. Measured against the scoped thread spawned per step that
/// it replaces: see `spawn_cost` in the tests.
pub(super) struct MaskJob {
    rx: Receiver<MaskDone>,
    done: Option<MaskDone>,
    /// The guided requests, in case the task never answers.
    ids: Vec<SeqId>,
    /// Seconds the engine thread waited for the task.
    wait_s: f64,
}

/// What the task hands back.
struct MaskDone {
    /// Per guided row: its request, first logits row, grammar, next-token mask, and how its
    /// grammar ended if its deferred token ended it (`Guide::catch_up`; the mask is then an error).
    rows: Vec<(SeqId, usize, Guide, MaskResult, Option<FinishReason>)>,
    /// The task's own seconds.
    mask_s: f64,
}

impl MaskJob {
    /// Takes the guides of the guided requests among `sampling` (request, first logits row) and
    /// starts computing their masks; `None` when no row is guided.
    pub(super) fn start(
        requests: &mut HashMap<SeqId, RequestState>,
        sampling: &[(SeqId, usize)],
    ) -> Option<Self> {
        let rows: Vec<(SeqId, usize, Guide)> = sampling
            .iter()
            .filter_map(|&(id, row)| Some((id, row, requests.get_mut(&id)?.guide.take()?)))
            .collect();
        if rows.is_empty() {
            return None;
        }
        let ids = rows.iter().map(|r| r.0).collect();
        let (tx, rx) = sync_channel(1);
        rayon::spawn(move || {
            let t0 = Instant::now();
            let rows = rows
                .into_par_iter()
                .map(|(id, row, mut g)| {
                    // The previous step's token first (deferred so the engine thread did not
                    // wait for it); a grammar that panics ends its request, not the engine.
                    let (m, ended) = catch_unwind(AssertUnwindSafe(|| match g.catch_up() {
                        Some(end) => (Err("the grammar has ended".into()), Some(end)),
                        None => (g.mask(), None),
                    }))
                    .unwrap_or_else(|_| (Err("the mask computation panicked".into()), None));
                    (id, row, g, m, ended)
                })
                .collect();
            let mask_s = t0.elapsed().as_secs_f64();
            let _ = tx.send(MaskDone { rows, mask_s });
        });
        Some(Self {
            rx,
            done: None,
            ids,
            wait_s: 0.0,
        })
    }

    /// The task's answer, waited for the first time.
    fn wait(&mut self) -> Option<&MaskDone> {
        if self.done.is_none() {
            let t0 = Instant::now();
            self.done = self.rx.recv().ok();
            self.wait_s += t0.elapsed().as_secs_f64();
        }
        self.done.as_ref()
    }

    /// Writes every guided row's mask into `out` (`[rows, words]`, all bits set on entry: the
    /// unguided rows stay so) and returns the rows whose mask allows nothing or failed (dead
    /// ends).
    pub(super) fn pack(
        &mut self,
        grammars: &Grammars,
        words: usize,
        out: &mut [u32],
    ) -> Vec<usize> {
        let Some(done) = self.wait() else {
            // No answer: no guided row may pick anything.
            return Vec::new();
        };
        let mut dead = Vec::new();
        for (_, row, _, m, _) in &done.rows {
            let Some(w) = out.get_mut(row * words..(row + 1) * words) else {
                // Not the executor's layout: the row may not go unmasked.
                dead.push(*row);
                continue;
            };
            let any = match m {
                Ok(mask) => grammars.pack(mask, w),
                Err(_) => false,
            };
            if !any {
                w.fill(0);
                dead.push(*row);
            }
        }
        dead
    }

    /// Waits for the task if `pack` did not, gives the guides back to their requests, and returns
    /// the masks by request with the task's seconds and the engine thread's wait. A task that
    /// never answered (it cannot, short of a bug) ends its requests (`Grammar`).
    pub(super) fn finish(
        mut self,
        requests: &mut HashMap<SeqId, RequestState>,
    ) -> (HashMap<SeqId, MaskResult>, f64, f64) {
        self.wait();
        let Some(done) = self.done.take() else {
            for id in &self.ids {
                if let Some(r) = requests.get_mut(id) {
                    r.grammar_end = Some(FinishReason::Grammar);
                }
            }
            return (HashMap::new(), 0.0, self.wait_s);
        };
        let mut masks = HashMap::with_capacity(done.rows.len());
        for (id, _, guide, m, ended) in done.rows {
            if let Some(r) = requests.get_mut(&id) {
                r.guide = Some(guide);
                if ended.is_some() {
                    r.grammar_end = ended;
                    r.grammar_ended_before = true;
                }
            }
            masks.insert(id, m);
        }
        (masks, done.mask_s, self.wait_s)
    }
}

impl Engine {
    /// A step whose every row the executor may pick on the device, some of them under grammar
    /// masks (no penalties, log-probabilities or proposals in it): the masks are computed while
    /// the forward pass runs, handed to the executor when it asks for them, and each pick handed
    /// to its grammar to be consumed at the start of the next step's mask task (`Guide::defer`):
    /// a grammar the pick completes ends its request one step later, with a placeholder token
    /// that is not output. A guided row whose mask allows nothing ends its request (`Grammar`)
    /// with a placeholder token.
    ///
    /// `params`: one per logits row.
    pub(super) fn execute_guided_on_device(
        &mut self,
        sampling: &[(SeqId, usize)],
        tables: &[&[BlockId]],
        params: &[SampleParams],
    ) -> Result<Vec<(SeqId, Vec<Sampled>)>, EngineError> {
        let Some(mut job) = MaskJob::start(&mut self.requests, sampling) else {
            return Err(EngineError::InvalidRequest(
                "no guided row in a guided step".into(),
            ));
        };
        let grammars = self.grammars.as_ref().expect("a guided request built them");
        let words = mask_words(self.exec.vocab_size());
        let mut dead = None;
        let ids = {
            let mut fill = |out: &mut [u32]| dead = Some(job.pack(grammars, words, out));
            execute_sample(
                self.exec.as_mut(),
                &self.buf,
                tables,
                params,
                Some(&mut fill),
            )
        };
        let (masks, mask_s, wait_s) = job.finish(&mut self.requests);
        self.stats.guided_steps += 1;
        self.stats.guided_mask_s += mask_s;
        self.stats.guided_wait_s += wait_s;
        let ids = ids?;
        let host_t0 = Instant::now();
        let Some(dead) = dead else {
            return Err(BackendError::Config(
                "the executor sampled without asking for the grammar masks".into(),
            )
            .into());
        };
        let dead_end = self.stop_tokens.first().copied().unwrap_or(TokenId(0));
        let row_of: HashMap<SeqId, usize> = sampling.iter().copied().collect();
        // The guided rows that picked a token hand it to their grammars, to be consumed by the
        // next step's mask task during its forward pass (off this thread's path from one step to
        // the next); dead ends end (a grammar that ended before this step keeps its reason).
        for (id, r) in self.requests.iter_mut() {
            let (Some(&row), Some(guide)) = (row_of.get(id), r.guide.as_mut()) else {
                continue;
            };
            if dead.contains(&row) || masks.get(id).is_none_or(|m| m.is_err()) {
                r.grammar_end.get_or_insert(FinishReason::Grammar);
                continue;
            }
            guide.defer(grammars, TokenId(ids[row]));
        }
        let picks = sampling
            .iter()
            .map(|&(id, row)| {
                let token = if dead.contains(&row) {
                    dead_end
                } else {
                    TokenId(ids[row])
                };
                (id, vec![plain_pick(token)])
            })
            .collect();
        self.stats.guided_host_s += host_t0.elapsed().as_secs_f64();
        Ok(picks)
    }
}

/// The picks of the step's guided greedy rows that need nothing but their logits and mask (no
/// proposals, penalties or log-probabilities), made by [`constrain::greedy_picks`] (rows in
/// parallel). Takes those rows' masks out of `masks`.
///
/// `logits`: ([rows, vocab], vocab).
pub(super) fn guided_greedy_picks(
    requests: &mut HashMap<SeqId, RequestState>,
    grammars: &Grammars,
    masks: &mut HashMap<SeqId, MaskResult>,
    sampling: &[(SeqId, usize)],
    proposals: &HashMap<SeqId, &[TokenId]>,
    logits: (&[f32], usize),
    dead_end: TokenId,
) -> HashMap<SeqId, TokenId> {
    let rows: HashMap<SeqId, usize> = sampling
        .iter()
        .filter(|(id, _)| !proposals.contains_key(id))
        .copied()
        .collect();
    let work: Vec<GreedyRow> = requests
        .iter_mut()
        .filter_map(|(&id, r)| {
            let row = *rows.get(&id)?;
            if !r.sampler.is_greedy_under_mask() {
                return None;
            }
            Some(GreedyRow {
                id,
                row,
                guide: r.guide.as_mut()?,
                end: &mut r.grammar_end,
                mask: masks.remove(&id)?,
            })
        })
        .collect();
    constrain::greedy_picks(work, grammars, logits, dead_end)
}
