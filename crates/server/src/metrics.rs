//! Prometheus metrics, owned by the engine thread (no locks): gauges read from the engine's stats
//! at scrape time, counters and latency histograms updated as outputs are delivered. `/metrics`
//! asks the engine thread for the rendered text over the command channel.

use std::fmt::Write;

use quire_core::FinishReason;
use quire_engine::EngineStats;

/// A cumulative histogram with fixed upper bounds, in seconds.
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    /// counts[i]: observations <= bounds[i] and > bounds[i-1]; the last entry is +Inf.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        let i = self.bounds.partition_point(|&b| b < v);
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cum = 0;
        for (i, b) in self.bounds.iter().enumerate() {
            cum += self.counts[i];
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        cum += self.counts[self.bounds.len()];
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cum}");
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

// Bucket bounds as vLLM's (seconds).
const TTFT_BOUNDS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const ITL_BOUNDS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const E2E_BOUNDS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

#[derive(Debug, Clone)]
pub struct Metrics {
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    /// Finished requests by reason: stop, length, abort.
    pub finished: [u64; 4],
    /// Requests refused because the waiting queue was full.
    pub rejected_queue_full: u64,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            prompt_tokens: 0,
            generation_tokens: 0,
            finished: [0; 4],
            rejected_queue_full: 0,
            ttft: Histogram::new(TTFT_BOUNDS),
            itl: Histogram::new(ITL_BOUNDS),
            e2e: Histogram::new(E2E_BOUNDS),
        }
    }
}

fn reason_index(r: FinishReason) -> usize {
    match r {
        FinishReason::Stop => 0,
        FinishReason::Length => 1,
        FinishReason::Abort => 2,
        FinishReason::Grammar => 3,
    }
}

impl Metrics {
    pub fn finish(&mut self, reason: FinishReason) {
        self.finished[reason_index(reason)] += 1;
    }

    /// The Prometheus text exposition format (version 0.0.4).
    pub fn render(&self, s: &EngineStats, model: &str) -> String {
        let mut out = String::with_capacity(8192);
        let gauge = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} gauge");
            let _ = writeln!(out, "{name} {v}");
        };
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} counter");
            let _ = writeln!(out, "{name} {v}");
        };
        let _ = writeln!(
            out,
            "# HELP quire_model_info The model this server runs.\n# TYPE quire_model_info gauge\nquire_model_info{{model=\"{}\"}} 1",
            model.replace('\\', "\\\\").replace('"', "\\\"")
        );
        gauge(
            &mut out,
            "quire_requests_running",
            "Requests in the running batch.",
            s.running as u64,
        );
        gauge(
            &mut out,
            "quire_requests_waiting",
            "Requests waiting to be scheduled.",
            s.waiting as u64,
        );
        gauge(
            &mut out,
            "quire_kv_blocks_used",
            "KV-cache blocks held by requests.",
            s.kv_blocks_used as u64,
        );
        gauge(
            &mut out,
            "quire_kv_blocks_total",
            "KV-cache blocks in the pool.",
            s.kv_blocks_total as u64,
        );
        counter(
            &mut out,
            "quire_engine_steps_total",
            "Engine steps run.",
            s.steps,
        );
        counter(
            &mut out,
            "quire_preemptions_total",
            "Requests preempted (their KV freed, to be recomputed).",
            s.preemptions_total,
        );
        counter(
            &mut out,
            "quire_prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queries,
        );
        counter(
            &mut out,
            "quire_prefix_cache_hits_total",
            "Prompt tokens found in the prefix cache.",
            s.prefix_cache_hits,
        );
        counter(
            &mut out,
            "quire_spec_proposed_tokens_total",
            "Speculative decoding: tokens proposed for verification.",
            s.spec_proposed_tokens,
        );
        counter(
            &mut out,
            "quire_spec_accepted_tokens_total",
            "Speculative decoding: proposed tokens the model accepted.",
            s.spec_accepted_tokens,
        );
        counter(
            &mut out,
            "quire_spec_verify_steps_total",
            "Speculative decoding: request steps that verified proposals.",
            s.spec_verify_steps,
        );
        let proposer = if s.spec_proposer.is_empty() {
            "off"
        } else {
            s.spec_proposer
        };
        let _ = writeln!(
            out,
            "# HELP quire_spec_proposer Where speculative guesses come from (ngram: prompt lookup; \
             draft: a draft model; off).\n# TYPE quire_spec_proposer gauge\n\
             quire_spec_proposer{{proposer=\"{proposer}\"}} 1"
        );
        gauge(
            &mut out,
            "quire_spec_draft_kv_blocks_used",
            "Speculative decoding: blocks of the draft model's own KV cache in use (0 without one).",
            s.spec_draft_kv_blocks_used as u64,
        );
        gauge(
            &mut out,
            "quire_spec_draft_kv_blocks_total",
            "Speculative decoding: blocks of the draft model's own KV cache (0 without one).",
            s.spec_draft_kv_blocks_total as u64,
        );
        counter(
            &mut out,
            "quire_spec_draft_no_room_total",
            "Speculative decoding: request steps that proposed nothing because the draft's KV cache was full.",
            s.spec_draft_no_room,
        );
        let mean_len = if s.spec_verify_steps > 0 {
            1.0 + s.spec_accepted_tokens as f64 / s.spec_verify_steps as f64
        } else {
            0.0
        };
        let _ = writeln!(
            out,
            "# HELP quire_spec_mean_accepted_length Tokens emitted per verify step (1 + accepted / \
             steps; 0 before any).\n# TYPE quire_spec_mean_accepted_length gauge\n\
             quire_spec_mean_accepted_length {mean_len}"
        );
        counter(
            &mut out,
            "quire_prompt_tokens_total",
            "Prompt tokens of admitted requests.",
            self.prompt_tokens,
        );
        counter(
            &mut out,
            "quire_generation_tokens_total",
            "Tokens generated.",
            self.generation_tokens,
        );
        counter(
            &mut out,
            "quire_requests_rejected_total",
            "Requests refused with 429 because the waiting queue was full.",
            self.rejected_queue_full,
        );
        let _ = writeln!(
            out,
            "# HELP quire_requests_total Finished requests by finish reason.\n# TYPE quire_requests_total counter"
        );
        for r in [
            FinishReason::Stop,
            FinishReason::Length,
            FinishReason::Abort,
            FinishReason::Grammar,
        ] {
            let _ = writeln!(
                out,
                "quire_requests_total{{finish_reason=\"{}\"}} {}",
                r.as_str(),
                self.finished[reason_index(r)]
            );
        }
        self.ttft.render(
            &mut out,
            "quire_time_to_first_token_seconds",
            "Arrival to first generated token.",
        );
        self.itl.render(
            &mut out,
            "quire_inter_token_latency_seconds",
            "Time between successive generated tokens of a request.",
        );
        self.e2e.render(
            &mut out,
            "quire_e2e_request_latency_seconds",
            "Arrival to the end of a request.",
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        for v in [0.05, 0.1, 0.5, 2.0] {
            h.observe(v);
        }
        let mut s = String::new();
        h.render(&mut s, "x", "help");
        assert!(s.contains("x_bucket{le=\"0.1\"} 2\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"1\"} 3\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"+Inf\"} 4\n"), "{s}");
        assert!(s.contains("x_count 4\n") && s.contains("x_sum 2.65"), "{s}");
    }

    #[test]
    fn renders_every_required_family() {
        let mut m = Metrics::default();
        m.finish(FinishReason::Length);
        let text = m.render(&EngineStats::default(), "m\"x");
        for name in [
            "quire_requests_running",
            "quire_requests_waiting",
            "quire_kv_blocks_used",
            "quire_kv_blocks_total",
            "quire_preemptions_total",
            "quire_prefix_cache_queries_total",
            "quire_prefix_cache_hits_total",
            "quire_spec_proposed_tokens_total",
            "quire_spec_accepted_tokens_total",
            "quire_spec_mean_accepted_length 0",
            "quire_spec_proposer{proposer=\"off\"} 1",
            "quire_spec_draft_kv_blocks_used",
            "quire_spec_draft_no_room_total",
            "quire_prompt_tokens_total",
            "quire_generation_tokens_total",
            "quire_requests_total{finish_reason=\"length\"} 1",
            "quire_time_to_first_token_seconds_bucket",
            "quire_inter_token_latency_seconds_count",
            "quire_e2e_request_latency_seconds_sum",
        ] {
            assert!(text.contains(name), "{name} missing");
        }
        assert!(text.contains("model=\"m\\\"x\""));
    }
}
