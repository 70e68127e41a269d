//! The step loop, in vLLM v1's three parts: `schedule` (the scheduler decides what to compute),
//! `execute_model` (one forward pass over the mixed batch, then a token for every sequence that
//! reached the end of its known tokens, each with its own sampler) and `update_from_output` (the
//! scheduler records the tokens; stop tokens, stop strings and length limits end requests; new
//! tokens become text deltas). A request's tokens live in the scheduler alone: the sampler's
//! penalties read them from there.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use quire_backend::{Executor, SampleParams};
use quire_core::{BlockId, FinishReason, SamplingParams, SeqId, TokenId};
use quire_kv::KvCacheConfig;
use quire_sched::{Scheduler, SchedulerConfig, SchedulerOutput};
use quire_tokenizer::{StreamDecoder, Tokenizer};

use crate::constrain::{Grammars, Guide};
use crate::draft::DraftModel;
use crate::proposer::{NgramProposer, ProposalRow, Proposer};
use crate::runner::{execute, execute_greedy, execute_sample, BatchBuffers};
use crate::sampler::{argmax, Sampled, Sampler};
use crate::spec::{accept_greedy, accept_sampled, SpecConfig};
use crate::stop::{find_stop, held_back};
use crate::EngineError;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub enable_prefix_caching: bool,
    /// Longest prompt + completion of one request.
    pub max_model_len: usize,
    /// Alternatives reported per token (0 = none).
    pub top_logprobs: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_num_seqs: 64,
            max_num_batched_tokens: 512,
            enable_prefix_caching: true,
            max_model_len: 8192,
            top_logprobs: 0,
        }
    }
}

/// Timing of one finished request.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct RequestTimings {
    /// Arrival to first token.
    pub ttft_ms: f64,
    /// Prompt tokens over time to first token.
    pub prefill_tok_s: f64,
    /// Tokens after the first over the time after the first.
    pub decode_tok_s: f64,
    pub total_ms: f64,
    /// Speculative decoding: tokens proposed for this request and how many the target accepted.
    pub spec_proposed_tokens: usize,
    pub spec_accepted_tokens: usize,
}

/// What one step produced for one request.
#[derive(Debug, Clone)]
pub struct RequestOutput {
    pub id: SeqId,
    pub tokens: Vec<Sampled>,
    pub text_delta: String,
    pub finish_reason: Option<FinishReason>,
    pub num_prompt_tokens: usize,
    pub num_output_tokens: usize,
    pub timings: Option<RequestTimings>,
}

struct RequestState {
    prompt_len: usize,
    sampler: Sampler,
    decoder: StreamDecoder,
    text: String,
    emitted: usize,
    arrival: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    num_output: usize,
    /// The request's grammar state, when it asked for structured output.
    guide: Option<Guide>,
    /// Set when the grammar ends the request after this step's token: `Stop` (complete),
    /// `Grammar` (a dead end: no token allowed).
    grammar_end: Option<FinishReason>,
    /// The grammar ended before this step's pick (its deferred token completed or broke it:
    /// `Guide::catch_up`): the pick is a placeholder, not output.
    grammar_ended_before: bool,
    spec_proposed: usize,
    spec_accepted: usize,
}

#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct EngineStats {
    pub steps: u64,
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks_used: usize,
    pub kv_blocks_total: usize,
    pub preemptions_total: u64,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub computed_tokens_total: u64,
    pub prompt_tokens_last_step: usize,
    pub decode_tokens_last_step: usize,
    /// Speculative decoding: proposed tokens, accepted ones, and verify steps (one per request
    /// and step that carried proposals). Mean tokens per verify step: `1 + accepted / steps`.
    pub spec_proposed_tokens: u64,
    pub spec_accepted_tokens: u64,
    pub spec_verify_steps: u64,
    /// The proposer speculation uses (`"ngram"` or `"draft"`), `"off"` when it is off.
    pub spec_proposer: &'static str,
    /// The draft model's own KV cache (0 without one), and rows that proposed nothing because it
    /// had no room for them.
    pub spec_draft_kv_blocks_used: usize,
    pub spec_draft_kv_blocks_total: usize,
    pub spec_draft_no_room: u64,
    /// Structured outputs, where their time goes: steps that computed grammar masks; seconds
    /// the mask task spent computing them (on rayon's threads, beside the forward pass);
    /// seconds the engine thread then waited for it (masks on the critical path); seconds the
    /// engine thread spent on those steps' rows after the forward and the picks (on the host
    /// path also masking the logits and sampling; always advancing the grammars).
    pub guided_steps: u64,
    pub guided_mask_s: f64,
    pub guided_wait_s: f64,
    pub guided_host_s: f64,
}

pub struct Engine {
    exec: Box<dyn Executor>,
    sched: Scheduler,
    tokenizer: Arc<Tokenizer>,
    stop_tokens: Vec<TokenId>,
    cfg: EngineConfig,
    requests: HashMap<SeqId, RequestState>,
    next_id: u64,
    buf: BatchBuffers,
    row: Vec<f32>,
    stats: EngineStats,
    /// Built the first time a request asks for structured output.
    grammars: Option<Grammars>,
    spec: SpecConfig,
    /// Where speculative guesses come from: prompt lookup unless a draft model was given.
    proposer: Box<dyn Proposer>,
}

impl Engine {
    pub fn new(exec: Box<dyn Executor>, tokenizer: Arc<Tokenizer>, cfg: EngineConfig) -> Self {
        let kv = exec.kv_spec();
        let sched = Scheduler::new(
            SchedulerConfig {
                max_num_seqs: cfg.max_num_seqs,
                max_num_batched_tokens: cfg.max_num_batched_tokens,
                max_model_len: cfg.max_model_len,
                long_prefill_token_threshold: None,
            },
            KvCacheConfig {
                num_blocks: kv.num_blocks,
                block_size: kv.block_size,
                enable_prefix_caching: cfg.enable_prefix_caching,
            },
        );
        let stop_tokens = tokenizer.stop_tokens();
        let proposer = Box::new(NgramProposer::for_backend(exec.backend_name()));
        Self {
            exec,
            sched,
            tokenizer,
            stop_tokens,
            cfg,
            requests: HashMap::new(),
            next_id: 0,
            buf: BatchBuffers::default(),
            row: Vec::new(),
            stats: EngineStats::default(),
            grammars: None,
            spec: SpecConfig::default(),
            proposer,
        }
    }

    /// Makes `draft` (a smaller model of the same vocabulary, on the same backend, with its own
    /// KV cache) the proposer of speculative decoding instead of prompt lookup; `--speculative-tokens`
    /// still sets how many tokens it guesses. Refused when its tokenizer differs from the target's.
    pub fn set_draft_model(
        &mut self,
        draft: Box<dyn Executor>,
        draft_tokenizer: &Tokenizer,
    ) -> Result<(), EngineError> {
        let d = DraftModel::new(
            draft,
            draft_tokenizer,
            &self.tokenizer,
            self.cfg.max_num_batched_tokens,
        )?;
        self.proposer = Box::new(d);
        Ok(())
    }

    /// Turns speculative decoding (n-gram prompt lookup) on or off for requests added from now
    /// on and those running. Greedy outputs are unchanged by it, sampled ones follow the same
    /// distribution; requests with penalties, log-probabilities or a grammar never speculate.
    pub fn set_speculation(&mut self, spec: SpecConfig) -> Result<(), EngineError> {
        spec.validate().map_err(EngineError::InvalidRequest)?;
        self.spec = spec;
        Ok(())
    }

    pub fn speculation(&self) -> SpecConfig {
        self.spec
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    pub fn executor(&mut self) -> &mut dyn Executor {
        self.exec.as_mut()
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Queues a request; its first output comes from a later `step`.
    pub fn add_request(
        &mut self,
        prompt: Vec<TokenId>,
        params: SamplingParams,
    ) -> Result<SeqId, EngineError> {
        params.validate().map_err(EngineError::InvalidRequest)?;
        if params.max_tokens == 0 {
            return Err(EngineError::InvalidRequest(
                "max_tokens must be at least 1".into(),
            ));
        }
        let vocab = self.exec.vocab_size();
        if let Some(t) = prompt.iter().find(|t| t.as_usize() >= vocab) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {} is outside the vocabulary",
                t.0
            )));
        }
        let guide = match &params.constraint {
            Some(c) => Some(self.grammars()?.compile(c)?),
            None => None,
        };
        let id = SeqId(self.next_id);
        let prompt_len = prompt.len();
        self.sched.add_request(id, prompt, params.max_tokens)?;
        self.next_id += 1;
        self.requests.insert(
            id,
            RequestState {
                prompt_len,
                sampler: Sampler::new(params),
                decoder: StreamDecoder::new(),
                text: String::new(),
                emitted: 0,
                arrival: Instant::now(),
                first_token: None,
                last_token: None,
                num_output: 0,
                guide,
                grammar_end: None,
                grammar_ended_before: false,
                spec_proposed: 0,
                spec_accepted: 0,
            },
        );
        Ok(id)
    }

    /// The grammar compiler for this engine's tokenizer, built on first use.
    pub fn grammars(&mut self) -> Result<&Grammars, EngineError> {
        if self.grammars.is_none() {
            self.grammars = Some(Grammars::new(&self.tokenizer)?);
        }
        Ok(self.grammars.as_ref().expect("built above"))
    }

    /// Stops a request at once and frees its KV blocks. False if it is unknown or finished.
    pub fn abort(&mut self, id: SeqId) -> bool {
        self.proposer.release(id);
        let known = self.requests.remove(&id).is_some();
        self.sched.abort(id) || known
    }

    pub fn has_unfinished(&self) -> bool {
        self.sched.has_unfinished()
    }

    pub fn stats(&self) -> EngineStats {
        let s = self.sched.stats();
        let kv = self.sched.kv();
        let p = self.proposer.stats();
        EngineStats {
            running: self.sched.num_running(),
            waiting: self.sched.num_waiting(),
            kv_blocks_used: kv.num_used_blocks(),
            kv_blocks_total: kv.num_blocks(),
            preemptions_total: s.num_preemptions,
            prefix_cache_queries: s.prefix_cache_queries,
            prefix_cache_hits: s.prefix_cache_hits,
            computed_tokens_total: s.total_computed_tokens,
            spec_proposer: if self.spec.num_tokens > 0 {
                self.proposer.name()
            } else {
                "off"
            },
            spec_draft_kv_blocks_used: p.kv_blocks_used,
            spec_draft_kv_blocks_total: p.kv_blocks_total,
            spec_draft_no_room: p.no_room,
            ..self.stats
        }
    }

    /// Runs one engine step, as vLLM v1 does: `schedule` what to compute, `execute_model` (one
    /// forward pass over the mixed batch, then a token for every sequence that samples), and
    /// `update_from_output` (the scheduler's bookkeeping, stop checks, detokenizing).
    pub fn step(&mut self) -> Result<Vec<RequestOutput>, EngineError> {
        self.propose()?;
        let out = self.sched.schedule();
        self.stats.steps += 1;
        if out.scheduled.is_empty() {
            return Ok(Vec::new());
        }
        let picks = self.execute_model(&out)?;
        Ok(self.update_from_output(&out, picks, Instant::now()))
    }

    /// Asks the proposer for guesses for every running request in decode that may speculate and
    /// attaches them; first lets it forget requests that are no longer running (finished,
    /// aborted or preempted), freeing a draft model's blocks.
    fn propose(&mut self) -> Result<(), EngineError> {
        let running = self.sched.running_seq_ids().to_vec();
        self.proposer.retain(&running);
        let k = self.spec.num_tokens;
        if k == 0 || self.cfg.top_logprobs > 0 {
            return Ok(());
        }
        let mut rows = Vec::new();
        for &id in &running {
            let speculates = self.requests.get(&id).is_some_and(|r| {
                r.sampler.params.speculative && r.sampler.is_plain() && r.guide.is_none()
            });
            if !speculates {
                continue;
            }
            let (Some(tokens), Some(done)) = (
                self.sched.all_token_ids(id),
                self.sched.num_computed_tokens(id),
            ) else {
                continue;
            };
            if done + 1 == tokens.len() {
                rows.push(ProposalRow { id, tokens }); // in decode, not in its prompt
            }
        }
        if rows.is_empty() {
            return Ok(());
        }
        let proposals = self.proposer.propose(&rows, &self.spec)?;
        let ids: Vec<SeqId> = rows.iter().map(|r| r.id).collect();
        let vocab = self.exec.vocab_size();
        for (id, mut p) in ids.into_iter().zip(proposals) {
            // A guess outside the target's logits (a draft with a padded vocabulary) ends it.
            if let Some(at) = p.iter().position(|t| t.as_usize() >= vocab) {
                p.truncate(at);
            }
            p.truncate(k);
            if !p.is_empty() {
                self.sched.set_spec_tokens(id, p);
            }
        }
        Ok(())
    }

    /// Runs the scheduled batch and picks the next tokens of every sequence that samples this
    /// step, each with its own sampler: one token, or for a sequence verifying proposals the
    /// accepted ones plus the target's own. Changes no request state beyond the samplers' random
    /// streams.
    fn execute_model(
        &mut self,
        out: &SchedulerOutput,
    ) -> Result<Vec<(SeqId, Vec<Sampled>)>, EngineError> {
        let block_size = self.exec.kv_spec().block_size;
        let rows = self.buf.fill(out, block_size);
        let requests = &self.requests;
        self.stats.decode_tokens_last_step = out
            .scheduled
            .iter()
            .filter(|s| {
                requests
                    .get(&s.seq_id)
                    .is_some_and(|r| s.num_computed_tokens >= r.prompt_len)
            })
            .map(|s| s.num_new_tokens)
            .sum();
        self.stats.prompt_tokens_last_step =
            out.num_batched_tokens - self.stats.decode_tokens_last_step;
        let tables: Vec<&[BlockId]> = out.scheduled.iter().map(|s| &s.block_table[..]).collect();
        // The scheduled sequences that sample, with their first row of logits.
        let sampling: Vec<(SeqId, usize)> = out
            .scheduled
            .iter()
            .zip(&rows)
            .filter_map(|(s, row)| Some((s.seq_id, (*row)?)))
            .filter(|(id, _)| self.requests.contains_key(id))
            .collect();
        // Proposals under verification, per sequence (only plain requests carry any).
        let proposals: HashMap<SeqId, &[TokenId]> = out
            .scheduled
            .iter()
            .filter(|s| s.num_spec_tokens > 0)
            .map(|s| {
                (
                    s.seq_id,
                    &s.token_ids[s.token_ids.len() - s.num_spec_tokens..],
                )
            })
            .collect();
        // When every sampling row wants the plain argmax, the backend may pick on the device;
        // when every row's pick depends on its logits (and its grammar's mask) alone (no
        // penalties, no log-probabilities), it may sample on the device.
        let all_rows = |plain: fn(&Sampler) -> bool| {
            self.cfg.top_logprobs == 0
                && sampling
                    .iter()
                    .all(|(id, _)| plain(&self.requests[id].sampler))
        };
        let greedy = all_rows(Sampler::is_plain_greedy);
        // Sampled verification needs whole logits rows: the host does it.
        let device = !greedy && all_rows(Sampler::is_plain_under_mask) && proposals.is_empty();
        if greedy {
            let ids = execute_greedy(self.exec.as_mut(), &self.buf, &tables)?;
            let mut picks = Vec::with_capacity(sampling.len());
            for &(id, row) in &sampling {
                let props = proposals.get(&id).copied().unwrap_or_default();
                let toks = accept_greedy(props, &ids[row..row + 1 + props.len()]);
                if let (false, Some(req)) = (props.is_empty(), self.requests.get_mut(&id)) {
                    count_spec(&mut self.stats, req, props.len(), toks.len());
                }
                picks.push((id, toks.into_iter().map(plain_pick).collect()));
            }
            return Ok(picks);
        }
        let guided = sampling
            .iter()
            .any(|(id, _)| self.requests.get(id).is_some_and(|r| r.guide.is_some()));
        if device {
            // One row's parameters each, with this step's uniform draw from its own stream.
            let mut params = vec![SampleParams::GREEDY; self.buf.logits_indices.len()];
            for &(id, row) in &sampling {
                if let Some(req) = self.requests.get_mut(&id) {
                    params[row] = req
                        .sampler
                        .device_params()
                        .expect("checked above: every sampling row is plain");
                }
            }
            if guided {
                return self.execute_guided_on_device(&sampling, &tables, &params);
            }
            let ids = execute_sample(self.exec.as_mut(), &self.buf, &tables, &params, None)?;
            return Ok(sampling
                .iter()
                .map(|&(id, row)| (id, vec![plain_pick(TokenId(ids[row]))]))
                .collect());
        }
        let vocab = self.exec.vocab_size();
        // Grammar masks depend only on the tokens so far: they are computed on rayon's threads
        // while the forward pass runs, off its critical path.
        let job = MaskJob::start(&mut self.requests, &sampling);
        let logits = execute(self.exec.as_mut(), &self.buf, &tables);
        let mut masks = HashMap::new();
        if let Some(job) = job {
            let mask_s;
            let wait_s;
            (masks, mask_s, wait_s) = job.finish(&mut self.requests);
            self.stats.guided_steps += 1;
            self.stats.guided_mask_s += mask_s;
            self.stats.guided_wait_s += wait_s;
        }
        let host_t0 = Instant::now();
        let logits = logits?;
        let mut picks = Vec::with_capacity(sampling.len());
        // Guided greedy rows take the argmax of their allowed logits and advance their grammars
        // in parallel; the rest go one by one below.
        let mut greedy_guided = match (&self.grammars, guided) {
            (Some(grammars), true) if self.cfg.top_logprobs == 0 => guided_greedy_picks(
                &mut self.requests,
                grammars,
                &mut masks,
                &sampling,
                &proposals,
                (logits, vocab),
                self.stop_tokens.first().copied().unwrap_or(TokenId(0)),
            ),
            _ => HashMap::new(),
        };
        for &(id, row) in &sampling {
            if let Some(token) = greedy_guided.remove(&id) {
                picks.push((id, vec![plain_pick(token)]));
                continue;
            }
            if let Some(props) = proposals.get(&id) {
                let Some(req) = self.requests.get_mut(&id) else {
                    continue;
                };
                let rows: Vec<&[f32]> = (row..=row + props.len())
                    .map(|r| &logits[r * vocab..(r + 1) * vocab])
                    .collect();
                let toks = if req.sampler.params.is_greedy() {
                    let ids: Vec<u32> = rows.iter().map(|r| argmax(r)).collect();
                    accept_greedy(props, &ids)
                } else {
                    accept_sampled(&mut req.sampler, props, &rows)
                };
                count_spec(&mut self.stats, req, props.len(), toks.len());
                picks.push((id, toks.into_iter().map(plain_pick).collect()));
                continue;
            }
            let Some(req) = self.requests.get_mut(&id) else {
                continue;
            };
            // The sampler's history (penalties) is the scheduler's token list: prompt and outputs.
            let history = self.sched.all_token_ids(id).unwrap_or_default();
            self.row.clear();
            self.row
                .extend_from_slice(&logits[row * vocab..(row + 1) * vocab]);
            if req.guide.is_some() {
                let mask = masks
                    .remove(&id)
                    .unwrap_or_else(|| Err("the mask computation failed".into()));
                let grammars = self.grammars.as_ref().expect("a guided request built them");
                let allowed = match &mask {
                    Ok(m) => grammars.apply(m, &mut self.row),
                    Err(_) => 0,
                };
                if allowed == 0 {
                    // A dead end: finish the request instead of sampling from nothing (a grammar
                    // that ended before this step keeps its reason).
                    req.grammar_end.get_or_insert(FinishReason::Grammar);
                    let token = self.stop_tokens.first().copied().unwrap_or(TokenId(0));
                    picks.push((id, vec![plain_pick(token)]));
                    continue;
                }
            }
            let n_top = self.cfg.top_logprobs.max(req.sampler.params.top_logprobs);
            let pick = req.sampler.sample(&mut self.row, history, n_top);
            if let (Some(guide), Some(grammars)) = (req.guide.as_mut(), self.grammars.as_ref()) {
                guide.advance(grammars, &mut req.grammar_end, pick.token);
            }
            picks.push((id, vec![pick]));
        }
        if guided {
            self.stats.guided_host_s += host_t0.elapsed().as_secs_f64();
        }
        Ok(picks)
    }

    /// Hands the step's tokens to the scheduler (which appends them to each request's tokens and
    /// finishes those at their length limit), then turns each into its request's output: stop
    /// tokens and stop strings, the text delta, and timings for finished requests. A request that
    /// got several tokens (accepted proposals) takes them in order and stops at the first that
    /// ends it.
    fn update_from_output(
        &mut self,
        out: &SchedulerOutput,
        mut picks: Vec<(SeqId, Vec<Sampled>)>,
        now: Instant,
    ) -> Vec<RequestOutput> {
        // Nothing after a stop token is output: the scheduler never sees it either.
        for (id, toks) in &mut picks {
            let ignore_eos = self
                .requests
                .get(id)
                .is_some_and(|r| r.sampler.params.ignore_eos);
            if !ignore_eos {
                if let Some(at) = toks
                    .iter()
                    .position(|p| self.stop_tokens.contains(&p.token))
                {
                    toks.truncate(at + 1);
                }
            }
        }
        let sampled: Vec<(SeqId, Vec<TokenId>)> = picks
            .iter()
            .map(|(id, p)| (*id, p.iter().map(|s| s.token).collect()))
            .collect();
        let length_done: HashMap<SeqId, FinishReason> = self
            .sched
            .update_from_output_multi(out, &sampled)
            .into_iter()
            .collect();
        let mut outputs = Vec::with_capacity(picks.len());
        for (id, toks) in picks {
            let Some(req) = self.requests.get_mut(&id) else {
                continue;
            };
            let n = toks.len();
            let mut merged: Option<RequestOutput> = None;
            for (i, pick) in toks.into_iter().enumerate() {
                // The scheduler's length verdict is about the last token it took.
                let length = if i + 1 == n {
                    length_done.get(&id).copied()
                } else {
                    None
                };
                let o = req.take_token(id, pick, &self.tokenizer, &self.stop_tokens, length, now);
                let done = o.finish_reason.is_some();
                merged = Some(match merged {
                    None => o,
                    Some(mut m) => {
                        m.tokens.extend(o.tokens);
                        m.text_delta.push_str(&o.text_delta);
                        RequestOutput {
                            tokens: m.tokens,
                            text_delta: m.text_delta,
                            ..o
                        }
                    }
                });
                if done {
                    break;
                }
            }
            let Some(output) = merged else { continue };
            if let Some(reason) = output.finish_reason {
                if !length_done.contains_key(&id) {
                    self.sched.finish(id, reason);
                }
                self.requests.remove(&id);
                self.proposer.release(id);
            }
            outputs.push(output);
        }
        outputs
    }
}

/// Records one verify step's proposals and accepted tokens (all but the target's own).
fn count_spec(stats: &mut EngineStats, req: &mut RequestState, proposed: usize, emitted: usize) {
    let accepted = emitted.saturating_sub(1);
    stats.spec_proposed_tokens += proposed as u64;
    stats.spec_accepted_tokens += accepted as u64;
    stats.spec_verify_steps += 1;
    req.spec_proposed += proposed;
    req.spec_accepted += accepted;
}

/// A token without log-probabilities (device picks and verified proposals: such requests asked
/// for none).
fn plain_pick(token: TokenId) -> Sampled {
    Sampled {
        token,
        logprob: None,
        top: Vec::new(),
    }
}

impl RequestState {
    /// Applies one sampled token: a stop token ends the request; any other is decoded into the
    /// text, where a stop string may end it; else the scheduler's length verdict stands. Returns
    /// the visible text added (held back while it might still begin a stop string).
    fn take_token(
        &mut self,
        id: SeqId,
        pick: Sampled,
        tokenizer: &Tokenizer,
        stop_tokens: &[TokenId],
        length_done: Option<FinishReason>,
        now: Instant,
    ) -> RequestOutput {
        self.first_token.get_or_insert(now);
        self.last_token = Some(now);
        let is_stop_token = !self.sampler.params.ignore_eos && stop_tokens.contains(&pick.token);
        let mut finish = None;
        let mut cut = false;
        let mut tokens = Vec::new();
        if self.grammar_end == Some(FinishReason::Grammar) || self.grammar_ended_before {
            // No token was allowed, or the grammar had already ended: the pick is a
            // placeholder, not output.
            finish = self.grammar_end.take().or(Some(FinishReason::Grammar));
        } else if is_stop_token {
            finish = Some(FinishReason::Stop);
        } else {
            self.num_output += 1;
            self.text
                .push_str(&self.decoder.push(tokenizer, pick.token, true));
            tokens.push(pick);
            if let Some(at) = find_stop(&self.text, &self.sampler.params.stop, self.emitted) {
                self.text.truncate(at);
                finish = Some(FinishReason::Stop);
                cut = true;
            }
        }
        if finish.is_none() {
            // The grammar is complete: nothing but an end token could follow.
            finish = self.grammar_end.take();
        }
        if finish.is_none() {
            finish = length_done;
        }
        if finish.is_some() && !cut {
            // The text ends here: release bytes the detokenizer held for an unfinished character.
            let tail = self.decoder.flush();
            self.text.push_str(&tail);
        }
        let visible = if finish.is_some() {
            self.text.len()
        } else {
            self.text.len() - held_back(&self.text, &self.sampler.params.stop)
        };
        let mut visible = visible.max(self.emitted);
        while !self.text.is_char_boundary(visible) {
            visible -= 1;
        }
        let text_delta = self.text[self.emitted..visible].to_string();
        self.emitted = visible;
        RequestOutput {
            id,
            tokens,
            text_delta,
            finish_reason: finish,
            num_prompt_tokens: self.prompt_len,
            num_output_tokens: self.num_output,
            timings: finish.map(|_| timings_of(self, now)),
        }
    }
}

fn timings_of(req: &RequestState, now: Instant) -> RequestTimings {
    let first = req.first_token.unwrap_or(now);
    let last = req.last_token.unwrap_or(now);
    let ttft = first.duration_since(req.arrival).as_secs_f64();
    let decode = last.duration_since(first).as_secs_f64();
    RequestTimings {
        ttft_ms: ttft * 1e3,
        prefill_tok_s: if ttft > 0.0 {
            req.prompt_len as f64 / ttft
        } else {
            0.0
        },
        decode_tok_s: if decode > 0.0 && req.num_output > 1 {
            (req.num_output - 1) as f64 / decode
        } else {
            0.0
        },
        total_ms: now.duration_since(req.arrival).as_secs_f64() * 1e3,
        spec_proposed_tokens: req.spec_proposed,
        spec_accepted_tokens: req.spec_accepted,
    }
}

#[path = "engine_guided.rs"]
mod guided;
use guided::{guided_greedy_picks, MaskJob};

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;
