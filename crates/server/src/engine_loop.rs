//! The engine thread. It owns the `Engine` (scheduler, KV cache, executor) and the metrics, and is
//! the only thread that touches them: handlers send commands over a channel and receive each
//! request's outputs over that request's own channel. Between steps it drains new commands and
//! aborts requests whose receiver is gone (the client disconnected), which frees their KV blocks
//! before the next step is scheduled. When nothing is running it sleeps on the command channel.

use std::collections::HashMap;
use std::io::Write;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use quire_core::{FinishReason, SamplingParams, SeqId, TokenId};
use quire_engine::{Engine, EngineError, EngineStats, RequestOutput};
use quire_sched::SchedError;
use tokio::sync::{mpsc, oneshot};

use crate::error::ApiError;
use crate::metrics::Metrics;

/// What a request's receiver gets.
#[derive(Debug)]
pub enum Event {
    Output(RequestOutput),
    /// The engine failed; the request ends here.
    Error(String),
}

/// One sequence of an HTTP request (one prompt, one choice).
pub struct AddRequest {
    pub prompt: Vec<TokenId>,
    pub params: SamplingParams,
    /// When the HTTP request arrived (the start of TTFT and end-to-end latency).
    pub arrival: Instant,
    pub events: mpsc::UnboundedSender<Event>,
}

pub enum Cmd {
    /// All sequences of one HTTP request (prompts x n), admitted together or not at all.
    Add {
        requests: Vec<AddRequest>,
        reply: oneshot::Sender<Result<(), ApiError>>,
    },
    /// Prometheus text of the current metrics.
    Metrics(oneshot::Sender<String>),
    Stats(oneshot::Sender<EngineStats>),
    /// End every request now (finish_reason "abort"): the shutdown grace period ran out.
    AbortAll,
    /// Leave the loop once nothing is running.
    Shutdown,
}

pub struct LoopConfig {
    /// Most requests waiting to be scheduled before new ones get 429.
    pub max_waiting: usize,
    /// One JSON line per step.
    pub step_log: Option<Box<dyn Write + Send>>,
    pub model_name: String,
}

struct Subscriber {
    events: mpsc::UnboundedSender<Event>,
    arrival: Instant,
    last_token: Option<Instant>,
}

pub fn spawn(engine: Engine, cfg: LoopConfig) -> (Sender<Cmd>, JoinHandle<()>) {
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = std::thread::Builder::new()
        .name("quire-engine".into())
        .spawn(move || EngineLoop::new(engine, cfg).run(rx))
        .expect("spawning the engine thread");
    (tx, handle)
}

struct EngineLoop {
    engine: Engine,
    cfg: LoopConfig,
    subs: HashMap<SeqId, Subscriber>,
    metrics: Metrics,
    shutting_down: bool,
    t0: Instant,
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl EngineLoop {
    fn new(engine: Engine, cfg: LoopConfig) -> Self {
        Self {
            engine,
            cfg,
            subs: HashMap::new(),
            metrics: Metrics::default(),
            shutting_down: false,
            t0: Instant::now(),
        }
    }

    fn run(mut self, rx: Receiver<Cmd>) {
        loop {
            if self.subs.is_empty() && !self.engine.has_unfinished() {
                if self.shutting_down {
                    return;
                }
                // Idle: wait for work (a timeout so a dropped channel is noticed promptly).
                match rx.recv_timeout(Duration::from_millis(500)) {
                    Ok(cmd) => self.handle(cmd),
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.shutting_down = true;
                        break;
                    }
                }
            }
            self.reap_disconnected();
            if self.engine.has_unfinished() {
                self.step();
            }
        }
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Add { requests, reply } => {
                let res = self.add_all(requests);
                let _ = reply.send(res);
            }
            Cmd::Metrics(reply) => {
                let text = self
                    .metrics
                    .render(&self.engine.stats(), &self.cfg.model_name);
                let _ = reply.send(text);
            }
            Cmd::Stats(reply) => {
                let _ = reply.send(self.engine.stats());
            }
            Cmd::AbortAll => {
                let ids: Vec<SeqId> = self.subs.keys().copied().collect();
                for id in ids {
                    self.abort(id, true);
                }
            }
            Cmd::Shutdown => self.shutting_down = true,
        }
    }

    /// Admits every sequence of one HTTP request, or none. Requests whose client went away are
    /// cleaned up first, so their places in the queue count as free.
    fn add_all(&mut self, requests: Vec<AddRequest>) -> Result<(), ApiError> {
        if self.shutting_down {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        self.reap_disconnected();
        let (fan_out, max) = (requests.len(), self.cfg.max_waiting);
        if fan_out > max {
            self.metrics.rejected_queue_full += 1;
            return Err(ApiError::bad_request(format!(
                "this request fans out to {fan_out} sequences (prompts x n) but the server \
                 queues at most {max}; send fewer prompts or a smaller `n`"
            ))
            .param("n"));
        }
        let waiting = self.engine.stats().waiting;
        if waiting + fan_out > max {
            self.metrics.rejected_queue_full += 1;
            return Err(ApiError::queue_full(waiting, fan_out, max));
        }
        let mut added = Vec::with_capacity(fan_out);
        for r in requests {
            match self.add(r.prompt, r.params, r.arrival, r.events) {
                Ok(id) => added.push(id),
                Err(e) => {
                    for id in added {
                        self.abort(id, false);
                    }
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    fn add(
        &mut self,
        prompt: Vec<TokenId>,
        params: SamplingParams,
        arrival: Instant,
        events: mpsc::UnboundedSender<Event>,
    ) -> Result<SeqId, ApiError> {
        let n = prompt.len() as u64;
        let id = self
            .engine
            .add_request(prompt, params)
            .map_err(|e| match e {
                EngineError::InvalidRequest(m) => ApiError::bad_request(m),
                e @ EngineError::Constraint { field, .. } => {
                    ApiError::bad_request(e.to_string()).param(field)
                }
                EngineError::Sched(e @ SchedError::PromptTooLong { .. }) => {
                    ApiError::bad_request(e.to_string()).code("context_length_exceeded")
                }
                EngineError::Sched(e) => ApiError::bad_request(e.to_string()),
                other => ApiError::internal(other.to_string()),
            })?;
        self.metrics.prompt_tokens += n;
        self.subs.insert(
            id,
            Subscriber {
                events,
                arrival,
                last_token: None,
            },
        );
        Ok(id)
    }

    /// Ends a request and frees its blocks; tells the client when `notify`.
    fn abort(&mut self, id: SeqId, notify: bool) {
        self.engine.abort(id);
        if let Some(sub) = self.subs.remove(&id) {
            self.metrics.finish(FinishReason::Abort);
            if notify {
                let _ = sub.events.send(Event::Output(RequestOutput {
                    id,
                    tokens: Vec::new(),
                    text_delta: String::new(),
                    finish_reason: Some(FinishReason::Abort),
                    num_prompt_tokens: 0,
                    num_output_tokens: 0,
                    timings: None,
                }));
            }
        }
    }

    fn reap_disconnected(&mut self) {
        let gone: Vec<SeqId> = self
            .subs
            .iter()
            .filter(|(_, s)| s.events.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.abort(id, false);
        }
    }

    fn step(&mut self) {
        let preempted_before = self
            .cfg
            .step_log
            .is_some()
            .then(|| self.engine.stats().preemptions_total);
        let start_unix = unix_now();
        let start = Instant::now();
        let result = self.engine.step();
        let now = Instant::now();
        let duration = now.duration_since(start);
        match result {
            Ok(outputs) => {
                for o in outputs {
                    self.deliver(o, now);
                }
            }
            Err(e) => {
                // A failed forward pass leaves the batch's state unknown: end every request.
                eprintln!("engine step failed: {e}");
                let ids: Vec<SeqId> = self.subs.keys().copied().collect();
                for id in ids {
                    self.engine.abort(id);
                    if let Some(sub) = self.subs.remove(&id) {
                        self.metrics.finish(FinishReason::Abort);
                        let _ = sub.events.send(Event::Error(format!("engine error: {e}")));
                    }
                }
            }
        }
        if let Some(log) = self.cfg.step_log.as_mut() {
            let s = self.engine.stats();
            let line = serde_json::json!({
                "step": s.steps,
                "start": start_unix,
                "end": start_unix + duration.as_secs_f64(),
                "t": start.duration_since(self.t0).as_secs_f64(),
                "duration_ms": duration.as_secs_f64() * 1e3,
                "prompt_tokens": s.prompt_tokens_last_step,
                "decode_tokens": s.decode_tokens_last_step,
                "preemptions": s.preemptions_total - preempted_before.unwrap_or(0),
                "running": s.running,
                "waiting": s.waiting,
                "kv_blocks_used": s.kv_blocks_used,
            });
            if writeln!(log, "{line}").and_then(|_| log.flush()).is_err() {
                eprintln!("cannot write the step log; it is turned off");
                self.cfg.step_log = None;
            }
        }
    }

    fn deliver(&mut self, o: RequestOutput, now: Instant) {
        let Some(sub) = self.subs.get_mut(&o.id) else {
            return;
        };
        if !o.tokens.is_empty() {
            self.metrics.generation_tokens += o.tokens.len() as u64;
            match sub.last_token {
                None => self
                    .metrics
                    .ttft
                    .observe(now.duration_since(sub.arrival).as_secs_f64()),
                Some(t) => self
                    .metrics
                    .itl
                    .observe(now.duration_since(t).as_secs_f64()),
            }
            sub.last_token = Some(now);
        }
        let (id, finish) = (o.id, o.finish_reason);
        let delivered = sub.events.send(Event::Output(o)).is_ok();
        if let Some(reason) = finish {
            // The engine already released the request; account for it once.
            if let Some(sub) = self.subs.remove(&id) {
                self.metrics.finish(reason);
                self.metrics
                    .e2e
                    .observe(now.duration_since(sub.arrival).as_secs_f64());
            }
        } else if !delivered {
            self.abort(id, false);
        }
    }
}
