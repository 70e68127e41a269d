//! The request loop: arrivals scheduled from the clock (open loop), the optional in-flight cap,
//! the drain, the progress bar.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand::rngs::StdRng;
use rand::SeedableRng;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::sleep_until;

use super::client::{stream_request, HttpClient, Outcome, Target};
use super::report::Phase;
use super::workload::{arrival_times, Workload};

/// One request as measured. Times are seconds since the benchmark start.
#[derive(Debug, Clone)]
pub struct RequestRecord {
    pub index: usize,
    /// When it was scheduled to arrive.
    pub arrival_s: f64,
    /// When it was sent (later than the arrival only while waiting for a --concurrency slot).
    pub send_s: f64,
    pub prompt_words: usize,
    pub max_tokens: usize,
    pub o: Outcome,
}

impl RequestRecord {
    pub fn ok(&self) -> bool {
        self.o.error.is_none()
    }
    /// Send to the end of the stream.
    pub fn e2e_ms(&self) -> f64 {
        (self.o.done_s - self.send_s) * 1e3
    }
    /// Scheduled arrival to send: the wait for a --concurrency slot.
    pub fn queue_ms(&self) -> f64 {
        (self.send_s - self.arrival_s).max(0.0) * 1e3
    }
    /// (e2e − ttft) / (output tokens − 1), for outputs of two tokens or more.
    pub fn tpot_ms(&self) -> Option<f64> {
        let ttft = self.o.ttft_ms?;
        (self.o.output_tokens > 1)
            .then(|| (self.e2e_ms() - ttft) / (self.o.output_tokens - 1) as f64)
    }
    /// Prompt tokens from `usage`, else the prompt's word count.
    pub fn input_tokens(&self) -> u64 {
        self.o.prompt_tokens.unwrap_or(self.prompt_words as u64)
    }
}

pub struct LoadConfig {
    /// Requests/s; infinite = closed loop (needs `concurrency`).
    pub rate: f64,
    pub burstiness: f64,
    pub concurrency: Option<usize>,
    pub ramp_s: f64,
    pub duration_s: f64,
    pub drain_timeout_s: f64,
    pub request_timeout_s: f64,
    pub seed: u64,
    pub progress: bool,
}

pub struct LoadResult {
    /// Every issued request in index order; those unfinished at the drain timeout as failed
    /// records; those unfinished at Ctrl-C left out.
    pub records: Vec<RequestRecord>,
    /// Requests sent (or queued for a --concurrency slot).
    pub issued: usize,
    /// Requests still running when the drain timed out or the run was interrupted.
    pub aborted: usize,
    pub interrupted: bool,
    /// Seconds from the start to the end of the drain.
    pub end_s: f64,
    /// Unix time of the start (to align with the server's step log).
    pub t0_unix: f64,
}

#[derive(Default)]
struct Live {
    queued: AtomicUsize,
    in_flight: AtomicUsize,
    done: AtomicUsize,
    failed: AtomicUsize,
    tokens: AtomicU64,
}

#[derive(Clone)]
struct Ctx {
    client: HttpClient,
    target: Arc<Target>,
    live: Arc<Live>,
    sem: Option<Arc<Semaphore>>,
    t0: Instant,
    timeout: Duration,
}

struct Pending {
    index: usize,
    arrival_s: f64,
    prompt_words: usize,
    max_tokens: usize,
    handle: JoinHandle<RequestRecord>,
}

fn spawn_request(
    ctx: &Ctx,
    index: usize,
    arrival_s: f64,
    workload: &mut Workload,
    permit: Option<OwnedSemaphorePermit>,
) -> Pending {
    let spec = workload.next_spec();
    let (prompt_words, max_tokens) = (spec.prompt_words, spec.max_tokens);
    let ctx = ctx.clone();
    let handle = tokio::spawn(async move {
        let _permit = match (permit, &ctx.sem) {
            (Some(p), _) => Some(p),
            (None, Some(sem)) => {
                ctx.live.queued.fetch_add(1, Ordering::Relaxed);
                let p = sem.clone().acquire_owned().await.ok();
                ctx.live.queued.fetch_sub(1, Ordering::Relaxed);
                p
            }
            (None, None) => None,
        };
        ctx.live.in_flight.fetch_add(1, Ordering::Relaxed);
        let send_s = ctx.t0.elapsed().as_secs_f64();
        let o = stream_request(
            &ctx.client,
            &ctx.target,
            &spec.prompt,
            spec.max_tokens,
            ctx.t0,
            ctx.timeout,
            &ctx.live.tokens,
        )
        .await;
        ctx.live.in_flight.fetch_sub(1, Ordering::Relaxed);
        if o.error.is_some() {
            ctx.live.failed.fetch_add(1, Ordering::Relaxed);
        }
        ctx.live.done.fetch_add(1, Ordering::Relaxed);
        RequestRecord {
            index,
            arrival_s,
            send_s,
            prompt_words: spec.prompt_words,
            max_tokens: spec.max_tokens,
            o,
        }
    });
    Pending {
        index,
        arrival_s,
        prompt_words,
        max_tokens,
        handle,
    }
}

/// Open loop: each request is spawned at its scheduled arrival whatever the others are doing.
async fn open_loop(ctx: &Ctx, cfg: &LoadConfig, workload: &mut Workload, out: &mut Vec<Pending>) {
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let arrivals = arrival_times(
        cfg.rate,
        cfg.burstiness,
        cfg.ramp_s,
        cfg.duration_s,
        &mut rng,
    );
    for (i, &a) in arrivals.iter().enumerate() {
        sleep_until((ctx.t0 + Duration::from_secs_f64(a)).into()).await;
        out.push(spawn_request(ctx, i, a, workload, None));
    }
}

/// Closed loop (`--rate inf`): keeps `n` requests in flight, the cap rising linearly from 1 to
/// `n` over the ramp.
async fn closed_loop(
    ctx: &Ctx,
    cfg: &LoadConfig,
    n: usize,
    workload: &mut Workload,
    out: &mut Vec<Pending>,
) {
    let sem = ctx.sem.clone().expect("closed loop has a semaphore");
    let end = ctx.t0 + Duration::from_secs_f64(cfg.duration_s);
    loop {
        let t = ctx.t0.elapsed().as_secs_f64();
        if t >= cfg.duration_s {
            return;
        }
        let allowed = if cfg.ramp_s > 0.0 && t < cfg.ramp_s {
            ((n as f64 * t / cfg.ramp_s).ceil() as usize).clamp(1, n)
        } else {
            n
        };
        if allowed < n && n - sem.available_permits() >= allowed {
            // The ramp allows no more yet.
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        }
        let permit = tokio::select! {
            p = sem.clone().acquire_owned() => p.expect("semaphore never closed"),
            _ = sleep_until(end.into()) => return,
        };
        let t = ctx.t0.elapsed().as_secs_f64();
        let i = out.len();
        out.push(spawn_request(ctx, i, t, workload, Some(permit)));
    }
}

/// Runs the whole benchmark: arrival window, then the drain.
pub async fn run_load(
    client: HttpClient,
    target: Target,
    mut workload: Workload,
    cfg: &LoadConfig,
) -> LoadResult {
    let t0_unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let t0 = Instant::now();
    let live = Arc::new(Live::default());
    let ctx = Ctx {
        client,
        target: Arc::new(target),
        live: live.clone(),
        sem: cfg.concurrency.map(|n| Arc::new(Semaphore::new(n))),
        t0,
        timeout: Duration::from_secs_f64(cfg.request_timeout_s),
    };
    let pb = progress_bar(cfg.progress);
    let ticker = tokio::spawn(tick(
        pb.clone(),
        live.clone(),
        t0,
        cfg.ramp_s,
        cfg.duration_s,
    ));

    let mut pending = Vec::new();
    let window_end = t0 + Duration::from_secs_f64(cfg.duration_s);
    let arrivals = async {
        match (cfg.rate.is_finite(), cfg.concurrency) {
            (false, Some(n)) => closed_loop(&ctx, cfg, n, &mut workload, &mut pending).await,
            _ => open_loop(&ctx, cfg, &mut workload, &mut pending).await,
        }
        sleep_until(window_end.into()).await;
    };
    let mut interrupted = tokio::select! {
        _ = arrivals => false,
        _ = tokio::signal::ctrl_c() => true,
    };

    // The tail: no new arrivals; wait for what is in flight.
    let deadline = Instant::now() + Duration::from_secs_f64(cfg.drain_timeout_s);
    if !interrupted {
        let issued = pending.len();
        let all_done = async {
            while live.done.load(Ordering::Relaxed) < issued {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        interrupted = tokio::select! {
            _ = all_done => false,
            _ = sleep_until(deadline.into()) => false,
            _ = tokio::signal::ctrl_c() => true,
        };
    }
    let end_s = t0.elapsed().as_secs_f64();
    ticker.abort();
    pb.finish_and_clear();

    let why = format!(
        "unfinished when the drain ended (--drain-timeout {} s)",
        cfg.drain_timeout_s
    );
    let issued = pending.len();
    let mut records = Vec::with_capacity(pending.len());
    let mut aborted = 0;
    for p in pending {
        if !p.handle.is_finished() {
            p.handle.abort();
        }
        match p.handle.await {
            Ok(r) => records.push(r),
            // After Ctrl-C, unfinished requests are left out: the server did not fail them.
            Err(_) if interrupted => aborted += 1,
            Err(_) => {
                aborted += 1;
                records.push(RequestRecord {
                    index: p.index,
                    arrival_s: p.arrival_s,
                    send_s: p.arrival_s,
                    prompt_words: p.prompt_words,
                    max_tokens: p.max_tokens,
                    o: Outcome {
                        error: Some(why.clone()),
                        done_s: end_s,
                        ..Outcome::default()
                    },
                });
            }
        }
    }
    LoadResult {
        records,
        issued,
        aborted,
        interrupted,
        end_s,
        t0_unix,
    }
}

fn progress_bar(show: bool) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template("{spinner} {elapsed_precise} {msg}") {
        pb.set_style(style);
    }
    pb.enable_steady_tick(Duration::from_millis(200));
    pb
}

/// Updates the progress line: phase, done/in flight/queued, streamed tokens/s over ~2 s.
async fn tick(pb: ProgressBar, live: Arc<Live>, t0: Instant, ramp_s: f64, duration_s: f64) {
    let mut window: VecDeque<(f64, u64)> = VecDeque::new();
    loop {
        let t = t0.elapsed().as_secs_f64();
        let tokens = live.tokens.load(Ordering::Relaxed);
        window.push_back((t, tokens));
        while window.len() > 2 && t - window[0].0 > 2.0 {
            window.pop_front();
        }
        let (t_a, n_a) = window[0];
        let tok_s = if t > t_a {
            (tokens - n_a) as f64 / (t - t_a)
        } else {
            0.0
        };
        let phase = Phase::at(t, ramp_s, duration_s);
        pb.set_message(format!(
            "{:<6} done {} ({} failed) | in flight {} | queued {} | {:.0} tok/s",
            phase.name(),
            live.done.load(Ordering::Relaxed),
            live.failed.load(Ordering::Relaxed),
            live.in_flight.load(Ordering::Relaxed),
            live.queued.load(Ordering::Relaxed),
            tok_s
        ));
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
