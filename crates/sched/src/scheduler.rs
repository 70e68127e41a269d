//! `Scheduler::schedule()`: vLLM v1's token-budget rule over the paged KV cache.
//!
//! Running requests are served first, in admission order, so a request that got in keeps making
//! progress; when blocks run out the *latest* admitted one is preempted (it has the least work to
//! lose) and goes back to the front of the waiting queue so that it is the next one readmitted.
//! Waiting requests are admitted FIFO, only in steps without preemption (memory is tight then),
//! and admission stops at the first one that does not fit (no overtaking, so no starvation).

use std::collections::{HashMap, VecDeque};

use quire_core::{FinishReason, SeqId, TokenId};
use quire_kv::{cdiv, KvCacheConfig, KvCacheManager};

use crate::request::{Request, RequestStatus};
use crate::{SchedError, ScheduledSeq, SchedulerConfig, SchedulerOutput, SchedulerStats};

#[derive(Debug, Clone)]
pub struct Scheduler {
    config: SchedulerConfig,
    kv: KvCacheManager,
    requests: HashMap<SeqId, Request>,
    /// FIFO; preempted requests are put back at the front.
    waiting: VecDeque<SeqId>,
    /// Admission order; the last one is the first to be preempted.
    running: Vec<SeqId>,
    stats: SchedulerStats,
}

impl Scheduler {
    /// # Panics
    /// If either config is invalid; see [`Scheduler::try_new`].
    pub fn new(config: SchedulerConfig, kv_config: KvCacheConfig) -> Self {
        Self::try_new(config, kv_config).unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn try_new(config: SchedulerConfig, kv_config: KvCacheConfig) -> Result<Self, SchedError> {
        config.validate()?;
        Ok(Self {
            config,
            kv: KvCacheManager::try_new(kv_config)?,
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            stats: SchedulerStats::default(),
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    pub fn kv(&self) -> &KvCacheManager {
        &self.kv
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn has_unfinished(&self) -> bool {
        !self.requests.is_empty()
    }

    /// Running requests in admission order.
    pub fn running_seq_ids(&self) -> &[SeqId] {
        &self.running
    }

    /// Waiting requests, next to be admitted first.
    pub fn waiting_seq_ids(&self) -> Vec<SeqId> {
        self.waiting.iter().copied().collect()
    }

    pub fn status(&self, seq_id: SeqId) -> Option<RequestStatus> {
        self.requests.get(&seq_id).map(|r| r.status)
    }

    /// Prompt plus outputs so far of an unfinished request.
    pub fn all_token_ids(&self, seq_id: SeqId) -> Option<&[TokenId]> {
        self.requests.get(&seq_id).map(|r| &r.all_token_ids[..])
    }

    pub fn num_computed_tokens(&self, seq_id: SeqId) -> Option<usize> {
        self.requests.get(&seq_id).map(|r| r.num_computed_tokens)
    }

    pub fn stats(&self) -> SchedulerStats {
        let kv = self.kv.stats();
        SchedulerStats {
            prefix_cache_queries: kv.prefix_cache_queries,
            prefix_cache_hits: kv.prefix_cache_hits,
            ..self.stats
        }
    }

    /// Most tokens whose KV a request can ever need: all known tokens while unfinished, i.e. the
    /// prompt plus all outputs but the last (the last is sampled, never fed), capped by
    /// `max_model_len` (reaching it finishes the request).
    fn max_kv_tokens(&self, prompt_len: usize, max_tokens: usize) -> usize {
        let grown = (prompt_len + max_tokens - 1).min(self.config.max_model_len - 1);
        prompt_len.max(grown)
    }

    /// Queues a request at the back of the waiting queue.
    pub fn add_request(
        &mut self,
        seq_id: SeqId,
        prompt_tokens: Vec<TokenId>,
        max_tokens: usize,
    ) -> Result<(), SchedError> {
        if self.requests.contains_key(&seq_id) {
            return Err(SchedError::DuplicateSeq(seq_id));
        }
        if prompt_tokens.is_empty() {
            return Err(SchedError::EmptyPrompt(seq_id));
        }
        if max_tokens == 0 {
            return Err(SchedError::ZeroMaxTokens(seq_id));
        }
        let prompt_len = prompt_tokens.len();
        if prompt_len > self.config.max_model_len {
            return Err(SchedError::PromptTooLong {
                seq_id,
                prompt_len,
                max_model_len: self.config.max_model_len,
            });
        }
        let num_tokens = self.max_kv_tokens(prompt_len, max_tokens);
        if cdiv(num_tokens, self.kv.block_size()) > self.kv.num_blocks() {
            return Err(SchedError::NeverFits {
                seq_id,
                num_tokens,
                num_slots: self.kv.config().num_slots(),
            });
        }
        self.requests
            .insert(seq_id, Request::new(prompt_tokens, max_tokens));
        self.waiting.push_back(seq_id);
        Ok(())
    }

    /// Decides this step's batch; see the crate docs for the rules.
    pub fn schedule(&mut self) -> SchedulerOutput {
        let mut budget = self.config.max_num_batched_tokens;
        let mut out = SchedulerOutput::default();

        // 1. Running requests, in admission order.
        let mut idx = 0;
        while idx < self.running.len() && budget > 0 {
            let seq_id = self.running[idx];
            let req = &self.requests[&seq_id];
            let num_spec = self.num_spec(req, budget);
            let num_new = self.chunk(req.num_uncomputed_tokens(), budget) + num_spec;
            if num_new == 0 {
                // Waiting for a sampled token the engine has not reported.
                idx += 1;
                continue;
            }
            let mut scheduled = false;
            loop {
                let req = &self.requests[&seq_id];
                if self.kv.allocate_slots(
                    seq_id,
                    &req.all_token_ids,
                    req.num_computed_tokens,
                    num_new,
                    &[],
                ) {
                    scheduled = true;
                    break;
                }
                // Victims come from the end, at or after `idx`: never an already scheduled one.
                let victim = self.running.pop().expect("seq_id itself is running");
                self.preempt(victim);
                out.preempted.push(victim);
                if victim == seq_id {
                    break;
                }
            }
            if !scheduled {
                break;
            }
            out.scheduled
                .push(self.scheduled_seq(seq_id, num_new, num_spec, false));
            budget -= num_new;
            idx += 1;
        }

        // 2. Waiting requests, FIFO, unless memory was short this step.
        if out.preempted.is_empty() {
            while budget > 0 && self.running.len() < self.config.max_num_seqs {
                let Some(&seq_id) = self.waiting.front() else {
                    break;
                };
                let req = &self.requests[&seq_id];
                let (hits, num_hit) = self.kv.get_computed_blocks(&req.all_token_ids);
                let num_new = self.chunk(req.num_tokens() - num_hit, budget);
                if !self
                    .kv
                    .allocate_slots(seq_id, &req.all_token_ids, 0, num_new, &hits)
                {
                    break;
                }
                self.waiting.pop_front();
                self.running.push(seq_id);
                let req = self.requests.get_mut(&seq_id).expect("waiting request");
                req.status = RequestStatus::Running;
                req.num_computed_tokens = num_hit;
                let resumed = std::mem::take(&mut req.preempted);
                req.spec_token_ids.clear();
                out.scheduled
                    .push(self.scheduled_seq(seq_id, num_new, 0, resumed));
                budget -= num_new;
            }
        }

        out.num_batched_tokens = self.config.max_num_batched_tokens - budget;
        self.stats.num_steps += 1;
        self.stats.total_computed_tokens += out.num_batched_tokens as u64;
        out
    }

    /// Tokens a request computes this step: its uncomputed ones, capped by the long-prefill
    /// threshold and the remaining budget.
    fn chunk(&self, uncomputed: usize, budget: usize) -> usize {
        let capped = match self.config.long_prefill_token_threshold {
            Some(t) => uncomputed.min(t),
            None => uncomputed,
        };
        capped.min(budget)
    }

    /// Proposals a request verifies this step: only in decode (one uncomputed token), leaving
    /// room for that token in the budget, and never so many that accepting them all plus the
    /// engine's own token would pass `max_tokens` or `max_model_len`.
    fn num_spec(&self, req: &Request, budget: usize) -> usize {
        if req.num_uncomputed_tokens() != 1 || req.spec_token_ids.is_empty() {
            return 0;
        }
        let outputs_left = req.max_tokens.saturating_sub(req.num_output_tokens() + 1);
        let len_left = self
            .config
            .max_model_len
            .saturating_sub(req.num_tokens() + 1);
        req.spec_token_ids
            .len()
            .min(budget.saturating_sub(1))
            .min(outputs_left)
            .min(len_left)
    }

    /// Attaches proposed tokens to a running request in decode, replacing earlier ones; they are
    /// verified in its next scheduled step. Ignored (false) for other requests.
    pub fn set_spec_tokens(&mut self, seq_id: SeqId, tokens: Vec<TokenId>) -> bool {
        match self.requests.get_mut(&seq_id) {
            Some(req)
                if req.status == RequestStatus::Running && req.num_uncomputed_tokens() == 1 =>
            {
                req.spec_token_ids = tokens;
                true
            }
            _ => false,
        }
    }

    fn scheduled_seq(
        &self,
        seq_id: SeqId,
        num_new: usize,
        num_spec: usize,
        resumed: bool,
    ) -> ScheduledSeq {
        let req = &self.requests[&seq_id];
        let start = req.num_computed_tokens;
        let num_known = num_new - num_spec;
        let mut token_ids = req.all_token_ids[start..start + num_known].to_vec();
        token_ids.extend_from_slice(&req.spec_token_ids[..num_spec]);
        ScheduledSeq {
            seq_id,
            num_computed_tokens: start,
            num_new_tokens: num_new,
            token_ids,
            num_spec_tokens: num_spec,
            block_table: self.kv.block_table(seq_id).to_vec(),
            samples: start + num_known == req.num_tokens(),
            resumed_from_preemption: resumed,
        }
    }

    /// Frees a running request's blocks and puts it at the front of the waiting queue, to be
    /// recomputed from scratch (the caller has already removed it from `running`).
    fn preempt(&mut self, seq_id: SeqId) {
        // Cannot fail: every running request holds a block table.
        let _ = self.kv.free(seq_id);
        let req = self.requests.get_mut(&seq_id).expect("running request");
        req.status = RequestStatus::Waiting;
        req.num_computed_tokens = 0;
        req.spec_token_ids.clear();
        req.preempted = true;
        self.waiting.push_front(seq_id);
        self.stats.num_preemptions += 1;
    }

    /// Applies a step's results: every scheduled request advances by its `num_new_tokens`, then
    /// each `(seq, token)` in `sampled` is appended to a request that now has all its known tokens
    /// computed (other entries — unknown, finished, mid-prompt, or a second token for the same
    /// request — are ignored). Requests that reach `max_tokens` outputs or `max_model_len` tokens
    /// finish with `Length` and their blocks are freed; they are returned.
    ///
    /// Stop tokens and stop strings are the engine's business: it calls [`Scheduler::finish`].
    pub fn update_from_output(
        &mut self,
        out: &SchedulerOutput,
        sampled: &[(SeqId, TokenId)],
    ) -> Vec<(SeqId, FinishReason)> {
        let multi: Vec<(SeqId, Vec<TokenId>)> =
            sampled.iter().map(|&(s, t)| (s, vec![t])).collect();
        self.update_from_output_multi(out, &multi)
    }

    /// [`Scheduler::update_from_output`] for speculative steps: each entry carries the accepted
    /// proposals followed by the engine's own next token. Accepted proposals count as computed
    /// (their KV was written this step); the KV blocks past the computed tokens are given back.
    /// Tokens that disagree with the proposals, or come after a `Length` finish, are dropped.
    pub fn update_from_output_multi(
        &mut self,
        out: &SchedulerOutput,
        sampled: &[(SeqId, Vec<TokenId>)],
    ) -> Vec<(SeqId, FinishReason)> {
        let mut spec: HashMap<SeqId, Vec<TokenId>> = HashMap::new();
        for s in &out.scheduled {
            let Some(req) = self.requests.get_mut(&s.seq_id) else {
                continue; // finished or aborted since
            };
            let num_known = s.num_new_tokens - s.num_spec_tokens;
            // Guards against a stale or repeated output.
            if req.status == RequestStatus::Running
                && req.num_computed_tokens == s.num_computed_tokens
                && s.num_computed_tokens + num_known <= req.num_tokens()
            {
                req.num_computed_tokens += num_known;
                req.spec_token_ids.clear();
                if s.num_spec_tokens > 0 {
                    spec.insert(s.seq_id, s.token_ids[num_known..].to_vec());
                }
            }
        }
        let mut finished = Vec::new();
        for (seq_id, tokens) in sampled {
            let Some(req) = self.requests.get_mut(seq_id) else {
                continue;
            };
            if req.status != RequestStatus::Running || req.num_uncomputed_tokens() != 0 {
                continue;
            }
            let proposals = spec.remove(seq_id).unwrap_or_default();
            for (i, &token) in tokens.iter().enumerate() {
                req.all_token_ids.push(token);
                let done = req.num_output_tokens() >= req.max_tokens
                    || req.num_tokens() >= self.config.max_model_len;
                if done {
                    finished.push((*seq_id, FinishReason::Length));
                }
                // An accepted proposal: its KV is in the cache.
                if done || proposals.get(i) != Some(&token) {
                    break;
                }
                req.num_computed_tokens += 1;
            }
        }
        // Give back the blocks of rejected proposals (and of unreported ones).
        for s in out.scheduled.iter().filter(|s| s.num_spec_tokens > 0) {
            if let Some(req) = self.requests.get(&s.seq_id) {
                if req.status == RequestStatus::Running {
                    self.kv.truncate(s.seq_id, req.num_computed_tokens);
                }
            }
        }
        for &(seq_id, reason) in &finished {
            self.finish(seq_id, reason);
        }
        finished
    }

    /// Removes an unfinished request (running or waiting) and frees its blocks at once.
    /// Returns whether it existed. The reason is the engine's to report; it does not change what
    /// is freed.
    pub fn finish(&mut self, seq_id: SeqId, _reason: FinishReason) -> bool {
        let Some(req) = self.requests.remove(&seq_id) else {
            return false;
        };
        match req.status {
            RequestStatus::Running => {
                self.running.retain(|&s| s != seq_id);
                // Cannot fail: every running request holds a block table.
                let _ = self.kv.free(seq_id);
            }
            RequestStatus::Waiting => self.waiting.retain(|&s| s != seq_id),
        }
        true
    }

    /// [`Scheduler::finish`] with [`FinishReason::Abort`].
    pub fn abort(&mut self, seq_id: SeqId) -> bool {
        self.finish(seq_id, FinishReason::Abort)
    }

    /// The KV manager's invariants plus the scheduler's own: every request is in exactly one of
    /// the queues, matching its status; only running requests hold blocks, enough for their
    /// computed tokens; at most `max_num_seqs` run.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.kv.check_invariants()?;
        if self.running.len() + self.waiting.len() != self.requests.len() {
            return Err(format!(
                "{} running + {} waiting != {} requests",
                self.running.len(),
                self.waiting.len(),
                self.requests.len()
            ));
        }
        if self.running.len() > self.config.max_num_seqs {
            return Err(format!("{} running > max_num_seqs", self.running.len()));
        }
        if self.kv.num_seqs() != self.running.len() {
            return Err(format!(
                "{} sequences hold blocks but {} run",
                self.kv.num_seqs(),
                self.running.len()
            ));
        }
        let mut seen = std::collections::HashSet::new();
        if let Some(dup) = self
            .running
            .iter()
            .chain(&self.waiting)
            .find(|id| !seen.insert(**id))
        {
            return Err(format!("{dup} is queued twice"));
        }
        let bs = self.kv.block_size();
        for (queue, status) in [
            (
                self.running.iter().collect::<Vec<_>>(),
                RequestStatus::Running,
            ),
            (self.waiting.iter().collect(), RequestStatus::Waiting),
        ] {
            for id in queue {
                let req = self
                    .requests
                    .get(id)
                    .ok_or_else(|| format!("{id} queued but unknown"))?;
                if req.status != status {
                    return Err(format!("{id} is {:?} but queued as {status:?}", req.status));
                }
                if req.num_computed_tokens > req.num_tokens() {
                    return Err(format!("{id} computed more tokens than it knows"));
                }
                let slots = self.kv.block_table(*id).len() * bs;
                match status {
                    RequestStatus::Running if slots < req.num_computed_tokens => {
                        return Err(format!("{id}: {slots} slots < computed tokens"));
                    }
                    RequestStatus::Waiting
                        if req.num_computed_tokens != 0 || self.kv.contains_seq(*id) =>
                    {
                        return Err(format!("{id} waits but holds KV"));
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }
}
