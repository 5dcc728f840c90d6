//! Prometheus metrics (`GET /metrics`), per model label, with `prometheus-client`.
//!
//! Request metrics are recorded by a [`RequestTap`] that rides along with each routed
//! response body: time to first byte/event, duration at the end (or when the client
//! goes away), and tokens from the engine's `usage` (or, for streams without a usage
//! chunk, one token per content chunk).

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use crate::engine_event::EngineEvent;
use bytes::Bytes;
use mlxd_protocol::control::{PrefixStats, SsdStats};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use serde_json::Value;
use tokio::time::Instant;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabel {
    pub model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub model: String,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EvictionLabels {
    pub model: String,
    /// `lru` (room for another model), `ttl` (idle), `admin` (unload).
    pub reason: String,
}

type HistFamily = Family<ModelLabel, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    // 5 ms … ~164 s.
    Histogram::new(exponential_buckets(0.005, 2.0, 16))
}

/// Every metric `mlxd` exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    pub prompt_tokens: Family<ModelLabel, Counter>,
    pub completion_tokens: Family<ModelLabel, Counter>,
    pub ttft: HistFamily,
    pub duration: HistFamily,
    pub load_duration: HistFamily,
    pub queue_depth: Family<ModelLabel, Gauge>,
    pub in_flight: Family<ModelLabel, Gauge>,
    pub loads: Family<ModelLabel, Counter>,
    pub evictions: Family<EvictionLabels, Counter>,
    pub restarts: Family<ModelLabel, Counter>,
    pub memory: Family<ModelLabel, Gauge>,
    pub loaded: Family<ModelLabel, Gauge>,
    pub memory_budget: Gauge,
    pub drafted: Family<ModelLabel, Counter>,
    pub accepted: Family<ModelLabel, Counter>,
    pub acceptance: Family<ModelLabel, Gauge<f64, AtomicU64>>,
    pub ssd_hits: Family<ModelLabel, Counter>,
    pub ssd_restored_tokens: Family<ModelLabel, Counter>,
    pub ssd_writes: Family<ModelLabel, Counter>,
    pub ssd_invalid: Family<ModelLabel, Counter>,
    pub ssd_bytes: Family<ModelLabel, Gauge>,
    pub prefix_lookups: Family<ModelLabel, Counter>,
    pub prefix_hits: Family<ModelLabel, Counter>,
    pub prefix_reused_tokens: Family<ModelLabel, Counter>,
    pub prefix_evictions: Family<ModelLabel, Counter>,
    pub prefix_bytes: Family<ModelLabel, Gauge>,
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let hist = || HistFamily::new_with_constructor(latency_histogram as fn() -> Histogram);
        let m = Self {
            requests: Family::default(),
            prompt_tokens: Family::default(),
            completion_tokens: Family::default(),
            ttft: hist(),
            duration: hist(),
            load_duration: hist(),
            queue_depth: Family::default(),
            in_flight: Family::default(),
            loads: Family::default(),
            evictions: Family::default(),
            restarts: Family::default(),
            memory: Family::default(),
            loaded: Family::default(),
            memory_budget: Gauge::default(),
            drafted: Family::default(),
            accepted: Family::default(),
            acceptance: Family::default(),
            ssd_hits: Family::default(),
            ssd_restored_tokens: Family::default(),
            ssd_writes: Family::default(),
            ssd_invalid: Family::default(),
            ssd_bytes: Family::default(),
            prefix_lookups: Family::default(),
            prefix_hits: Family::default(),
            prefix_reused_tokens: Family::default(),
            prefix_evictions: Family::default(),
            prefix_bytes: Family::default(),
            registry: Registry::default(),
        };
        registry.register(
            "mlxd_requests",
            "Routed requests by model and HTTP status",
            m.requests.clone(),
        );
        registry.register(
            "mlxd_prompt_tokens",
            "Prompt tokens (tokens in), from the engine's usage",
            m.prompt_tokens.clone(),
        );
        registry.register(
            "mlxd_completion_tokens",
            "Completion tokens (tokens out), from usage or counted stream chunks",
            m.completion_tokens.clone(),
        );
        registry.register(
            "mlxd_time_to_first_token_seconds",
            "From request arrival to the first content event (streams) or the first body byte",
            m.ttft.clone(),
        );
        registry.register(
            "mlxd_request_duration_seconds",
            "From request arrival to the end of the response",
            m.duration.clone(),
        );
        registry.register(
            "mlxd_engine_load_duration_seconds",
            "From engine spawn to Ready",
            m.load_duration.clone(),
        );
        registry.register(
            "mlxd_queue_depth",
            "Requests waiting for the model's engine to start",
            m.queue_depth.clone(),
        );
        registry.register(
            "mlxd_requests_in_flight",
            "Requests handed to the model's engine and not yet finished",
            m.in_flight.clone(),
        );
        registry.register("mlxd_engine_loads", "Engine starts", m.loads.clone());
        registry.register(
            "mlxd_engine_evictions",
            "Engines stopped by the pool (lru, ttl, admin)",
            m.evictions.clone(),
        );
        registry.register(
            "mlxd_engine_restarts",
            "Engine restarts after a crash",
            m.restarts.clone(),
        );
        registry.register(
            "mlxd_engine_memory_bytes",
            "Memory counted for the model's engine (reported, or planned while loading)",
            m.memory.clone(),
        );
        registry.register(
            "mlxd_engine_loaded",
            "1 while the model's engine is ready",
            m.loaded.clone(),
        );
        registry.register(
            "mlxd_memory_budget_bytes",
            "Memory all engines together may use",
            m.memory_budget.clone(),
        );
        registry.register(
            "mlxd_draft_tokens",
            "Speculative drafts proposed by the model's engines",
            m.drafted.clone(),
        );
        registry.register(
            "mlxd_draft_accepted_tokens",
            "Speculative drafts the model accepted",
            m.accepted.clone(),
        );
        registry.register(
            "mlxd_draft_acceptance_ratio",
            "Accepted over proposed speculative drafts, since mlxd started",
            m.acceptance.clone(),
        );
        registry.register(
            "mlxd_ssd_hits",
            "Prefix lookups the engines restored from the SSD KV tier",
            m.ssd_hits.clone(),
        );
        registry.register(
            "mlxd_ssd_restored_tokens",
            "Prompt tokens restored from the SSD KV tier instead of prefilled",
            m.ssd_restored_tokens.clone(),
        );
        registry.register(
            "mlxd_ssd_writes",
            "Entries written to the SSD KV tier (prefixes and generation checkpoints)",
            m.ssd_writes.clone(),
        );
        registry.register(
            "mlxd_ssd_invalid_files",
            "SSD KV files found corrupt, truncated or foreign, and deleted",
            m.ssd_invalid.clone(),
        );
        registry.register(
            "mlxd_ssd_bytes",
            "Bytes of the model's SSD KV files, as its running engine reports",
            m.ssd_bytes.clone(),
        );
        registry.register(
            "mlxd_prefix_lookups",
            "Prompts the engines looked up in their prefix caches",
            m.prefix_lookups.clone(),
        );
        registry.register(
            "mlxd_prefix_hits",
            "Prompt lookups that found a cached prefix (in memory or on the SSD tier)",
            m.prefix_hits.clone(),
        );
        registry.register(
            "mlxd_prefix_reused_tokens",
            "Prompt tokens taken from the prefix cache instead of prefilled",
            m.prefix_reused_tokens.clone(),
        );
        registry.register(
            "mlxd_prefix_evictions",
            "Prefix-cache entries evicted to stay within prompt_cache (many, with few hits where prompts repeat: they outgrow it)",
            m.prefix_evictions.clone(),
        );
        registry.register(
            "mlxd_prefix_cache_bytes",
            "Bytes of KV the model's prefix cache holds, as its running engine reports",
            m.prefix_bytes.clone(),
        );
        Self { registry, ..m }
    }

    /// Adds the SSD tier's new counts (deltas between two `Stats` of one engine, whose
    /// counters start at 0) and sets its size.
    pub fn record_ssd(&self, model: &str, before: &SsdStats, now: &SsdStats) {
        if now == &SsdStats::default() {
            return;
        }
        let l = Self::label(model);
        self.ssd_hits
            .get_or_create(&l)
            .inc_by(now.hits.saturating_sub(before.hits));
        self.ssd_restored_tokens
            .get_or_create(&l)
            .inc_by(now.restored_tokens.saturating_sub(before.restored_tokens));
        self.ssd_writes
            .get_or_create(&l)
            .inc_by(now.writes.saturating_sub(before.writes));
        self.ssd_invalid
            .get_or_create(&l)
            .inc_by(now.invalid.saturating_sub(before.invalid));
        self.ssd_bytes.get_or_create(&l).set(now.bytes as i64);
    }

    /// Adds the prefix cache's new counts (deltas between two `Stats` of one engine, whose
    /// counters start at 0) and sets its size.
    pub fn record_prefix(&self, model: &str, before: &PrefixStats, now: &PrefixStats) {
        let l = Self::label(model);
        let counters = [
            (&self.prefix_lookups, now.lookups, before.lookups),
            (&self.prefix_hits, now.hits, before.hits),
            (
                &self.prefix_reused_tokens,
                now.reused_tokens,
                before.reused_tokens,
            ),
            (&self.prefix_evictions, now.evictions, before.evictions),
        ];
        for (family, now, before) in counters {
            family.get_or_create(&l).inc_by(now.saturating_sub(before));
        }
        self.prefix_bytes.get_or_create(&l).set(now.bytes as i64);
    }

    /// Drops the gauges of a model a configuration reload removed (its counters stay: they
    /// are history).
    pub fn forget_model(&self, model: &str) {
        let l = Self::label(model);
        self.queue_depth.remove(&l);
        self.in_flight.remove(&l);
        self.memory.remove(&l);
        self.loaded.remove(&l);
        self.acceptance.remove(&l);
        self.prefix_bytes.remove(&l);
    }

    /// Adds an engine's new drafted and accepted tokens (deltas of its `Stats`).
    pub fn record_drafts(&self, model: &str, drafted: u64, accepted: u64) {
        if drafted == 0 && accepted == 0 {
            return;
        }
        let l = Self::label(model);
        let d = self.drafted.get_or_create(&l);
        let a = self.accepted.get_or_create(&l);
        d.inc_by(drafted);
        a.inc_by(accepted);
        let ratio = a.get() as f64 / d.get().max(1) as f64;
        self.acceptance.get_or_create(&l).set(ratio);
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    pub fn label(model: &str) -> ModelLabel {
        ModelLabel {
            model: model.to_string(),
        }
    }

    /// Records a request that never reached an engine (or failed before a response).
    pub fn record_failure(&self, model: &str, status: u16, started: Instant) {
        self.requests
            .get_or_create(&RequestLabels {
                model: model.to_string(),
                status,
            })
            .inc();
        self.duration
            .get_or_create(&Self::label(model))
            .observe(started.elapsed().as_secs_f64());
        access_log(
            model,
            status,
            started.elapsed(),
            None,
            (None, None),
            None,
            false,
        );
    }
}

/// Decode speed: tokens after the first, over the time after the first token.
pub fn decode_rate(completion_tokens: u64, total: Duration, first: Duration) -> Option<f64> {
    let decode = total.checked_sub(first)?.as_secs_f64();
    (completion_tokens > 1 && decode > 0.0).then(|| (completion_tokens - 1) as f64 / decode)
}

/// The decode speed the access log reports: a stream's only. A whole (non-streamed) response
/// arrives at once, so the time after its "first token" is the time its body took to pass,
/// not decoding (it logged ~200 000 tok/s for 16 tokens decoded in 7 s).
pub fn logged_rate(
    streamed: bool,
    completion_tokens: Option<u64>,
    total: Duration,
    first: Option<Duration>,
) -> Option<f64> {
    match (streamed, completion_tokens, first) {
        (true, Some(n), Some(f)) => decode_rate(n, total, f).map(|r| (r * 10.0).round() / 10.0),
        _ => None,
    }
}

/// The status logged for a stream the client left before its end (nginx's "client closed
/// request").
pub const CLIENT_CLOSED: u16 = 499;

/// The access log: one line per model request, at target `mlxd::access` (so
/// `RUST_LOG=mlxd::access=off` silences it), with the model, status, token counts, time to
/// first token and decode speed; `--log-format json` makes each line a JSON object. A stream
/// the client left early (`cancelled`) is logged as such, with status [`CLIENT_CLOSED`].
fn access_log(
    model: &str,
    status: u16,
    duration: Duration,
    first: Option<Duration>,
    (prompt, completion): (Option<u64>, Option<u64>),
    rate: Option<f64>,
    cancelled: bool,
) {
    let ms = |d: Duration| (d.as_secs_f64() * 1e4).round() / 10.0;
    if cancelled {
        tracing::info!(
            target: "mlxd::access",
            model,
            status = CLIENT_CLOSED,
            completion_tokens = completion,
            ttft_ms = first.map(ms),
            duration_ms = ms(duration),
            "request cancelled by the client"
        );
        return;
    }
    tracing::info!(
        target: "mlxd::access",
        model,
        status,
        prompt_tokens = prompt,
        completion_tokens = completion,
        ttft_ms = first.map(ms),
        duration_ms = ms(duration),
        tokens_per_s = rate,
        "request"
    );
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Largest non-streaming body kept to read `usage` from.
const USAGE_BODY_MAX: usize = 1 << 20;

/// Accounting for one routed response; records everything when dropped.
pub struct RequestTap {
    metrics: std::sync::Arc<Metrics>,
    model: String,
    status: u16,
    started: Instant,
    first: Option<Duration>,
    sse: bool,
    body: Vec<u8>,
    chunks: u64,
    usage: Option<(u64, u64)>,
    /// The stream's last event went by (`[DONE]`, `message_stop`, an error event).
    ended: bool,
}

impl RequestTap {
    pub fn new(
        metrics: std::sync::Arc<Metrics>,
        model: &str,
        status: u16,
        started: Instant,
        sse: bool,
    ) -> Self {
        Self {
            metrics,
            model: model.to_string(),
            status,
            started,
            first: None,
            sse,
            body: Vec::new(),
            chunks: 0,
            usage: None,
            ended: false,
        }
    }

    /// A piece of a non-streaming body.
    pub fn data(&mut self, b: &Bytes) {
        self.mark_first();
        if self.body.len() + b.len() <= USAGE_BODY_MAX {
            self.body.extend_from_slice(b);
        }
    }

    /// A whole body already read by the resume record, with the usage that reading found
    /// (`None`: the tap reads the body itself when the request ends).
    pub fn whole(&mut self, b: &Bytes, usage: Option<(u64, u64)>) {
        match usage {
            Some(u) => {
                self.mark_first();
                self.usage = Some(u);
            }
            None => self.data(b),
        }
    }

    /// One whole SSE event. An event with a meta line is a choice chunk (never usage or an
    /// error), so its tokens are counted from the line without reading the chunk; another
    /// is read from the event's one JSON parse, which the resume record shares.
    pub fn event(&mut self, ev: &EngineEvent) {
        if let Some(Ok(meta)) = ev.meta() {
            if !meta.token_ids.is_empty() {
                // The first token, not a role-only or metadata chunk.
                self.mark_first();
                self.chunks += meta.token_ids.len() as u64;
            }
            return;
        }
        if ev.is_last() {
            self.ended = true;
        }
        let Some(v) = ev.json() else { return };
        if v.get("error").is_some() {
            self.ended = true;
        }
        if let Some(u) = usage_of(v) {
            self.usage = Some(u);
        }
        let has_content = v["choices"].as_array().is_some_and(|cs| {
            cs.iter().any(|c| {
                c["delta"]["content"]
                    .as_str()
                    .is_some_and(|s| !s.is_empty())
                    || c["text"].as_str().is_some_and(|s| !s.is_empty())
            })
        }) || v["delta"]["text"].as_str().is_some_and(|s| !s.is_empty());
        if has_content {
            // The first token, not a role-only or metadata chunk.
            self.mark_first();
            self.chunks += 1;
        }
    }

    fn mark_first(&mut self) {
        if self.first.is_none() {
            self.first = Some(self.started.elapsed());
        }
    }
}

impl Drop for RequestTap {
    fn drop(&mut self) {
        let m = &self.metrics;
        let label = Metrics::label(&self.model);
        m.requests
            .get_or_create(&RequestLabels {
                model: self.model.clone(),
                status: self.status,
            })
            .inc();
        m.duration
            .get_or_create(&label)
            .observe(self.started.elapsed().as_secs_f64());
        if let Some(first) = self.first {
            if self.status < 400 {
                m.ttft.get_or_create(&label).observe(first.as_secs_f64());
            }
        }
        // A stream without `usage` is counted by its content chunks; its prompt is unknown
        // (0 in the counters, left out of the log line).
        let prompt_known = !self.sse || self.usage.is_some();
        let usage = if self.sse {
            self.usage.or((self.chunks > 0).then_some((0, self.chunks)))
        } else {
            // Read by the resume record already, or read here.
            self.usage.or_else(|| {
                serde_json::from_slice::<Value>(&self.body)
                    .ok()
                    .as_ref()
                    .and_then(usage_of)
            })
        };
        if let Some((prompt, completion)) = usage {
            m.prompt_tokens.get_or_create(&label).inc_by(prompt);
            m.completion_tokens.get_or_create(&label).inc_by(completion);
        }
        let elapsed = self.started.elapsed();
        access_log(
            &self.model,
            self.status,
            elapsed,
            self.first,
            (
                usage.map(|u| u.0).filter(|_| prompt_known),
                usage.map(|u| u.1),
            ),
            logged_rate(self.sse, usage.map(|u| u.1), elapsed, self.first),
            self.sse && self.status < 400 && !self.ended,
        );
    }
}

/// Whether `ev` ends a stream: OpenAI's `data: [DONE]`, Anthropic's `message_stop`, or an
/// error event (after which the stream closes).
/// `(prompt, completion)` from an OpenAI `usage` or an Anthropic one.
fn usage_of(v: &Value) -> Option<(u64, u64)> {
    let u = v.get("usage").filter(|u| u.is_object())?;
    let get = |a: &str, b: &str| u[a].as_u64().or_else(|| u[b].as_u64());
    let prompt = get("prompt_tokens", "input_tokens");
    let completion = get("completion_tokens", "output_tokens");
    (prompt.is_some() || completion.is_some())
        .then(|| (prompt.unwrap_or(0), completion.unwrap_or(0)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn prefix_counters_add_each_engines_deltas_and_the_size_is_the_last_report() {
        let m = Metrics::new();
        let first = PrefixStats {
            lookups: 3,
            hits: 2,
            reused_tokens: 100,
            evictions: 1,
            entries: 2,
            bytes: 500,
        };
        m.record_prefix("a", &PrefixStats::default(), &first);
        let later = PrefixStats {
            lookups: 5,
            hits: 3,
            reused_tokens: 140,
            bytes: 400,
            ..first
        };
        m.record_prefix("a", &first, &later);
        // A restarted engine counts from 0 again: its first report adds whole.
        let restarted = PrefixStats {
            lookups: 1,
            hits: 1,
            reused_tokens: 10,
            evictions: 0,
            entries: 1,
            bytes: 50,
        };
        m.record_prefix("a", &PrefixStats::default(), &restarted);
        let text = m.encode();
        for line in [
            "mlxd_prefix_lookups_total{model=\"a\"} 6",
            "mlxd_prefix_hits_total{model=\"a\"} 4",
            "mlxd_prefix_reused_tokens_total{model=\"a\"} 150",
            "mlxd_prefix_evictions_total{model=\"a\"} 1",
            "mlxd_prefix_cache_bytes{model=\"a\"} 50",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in:\n{text}");
        }
        m.forget_model("a");
        assert!(!m.encode().contains("mlxd_prefix_cache_bytes{"));
    }

    #[test]
    fn decode_rates() {
        let s = Duration::from_secs;
        assert_eq!(decode_rate(11, s(3), s(1)), Some(5.0));
        assert_eq!(decode_rate(1, s(3), s(1)), None);
        assert_eq!(decode_rate(5, s(1), s(1)), None);
        assert_eq!(decode_rate(5, s(1), s(2)), None);
        // A whole response: no decode speed, however its body's arrival was timed.
        assert_eq!(logged_rate(true, Some(11), s(3), Some(s(1))), Some(5.0));
        assert_eq!(
            logged_rate(false, Some(16), s(7), Some(Duration::from_millis(6999))),
            None
        );
        assert_eq!(logged_rate(true, None, s(3), Some(s(1))), None);
    }

    #[test]
    fn a_stream_without_its_last_event_was_cancelled() {
        let m = Arc::new(Metrics::new());
        let chunk =
            Bytes::from_static(b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n");
        for (last, ended) in [
            (None, false),
            (Some(&b"data: [DONE]\n\n"[..]), true),
            (
                Some(b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"),
                true,
            ),
            (
                Some(b"data: {\"error\":{\"message\":\"engine died\"}}\n\n"),
                true,
            ),
        ] {
            let mut t = RequestTap::new(m.clone(), "a", 200, Instant::now(), true);
            t.event(&EngineEvent::new(chunk.clone()));
            if let Some(l) = last {
                t.event(&EngineEvent::new(Bytes::copy_from_slice(l)));
            }
            assert_eq!(t.ended, ended, "{last:?}");
        }
    }

    #[tokio::test]
    async fn a_whole_body_read_by_the_resume_record_is_not_read_again() {
        let m = Arc::new(Metrics::new());
        {
            // The record's reading is used: bytes the tap could not parse still count.
            let mut t = RequestTap::new(m.clone(), "c", 200, Instant::now(), false);
            t.whole(&Bytes::from_static(b"not json"), Some((4, 5)));
            assert!(t.body.is_empty(), "nothing kept to parse");
        }
        {
            // Not read by the record: the tap reads the body itself.
            let mut t = RequestTap::new(m.clone(), "d", 200, Instant::now(), false);
            t.whole(
                &Bytes::from_static(br#"{"usage":{"prompt_tokens":1,"completion_tokens":2}}"#),
                None,
            );
        }
        let text = m.encode();
        for line in [
            "mlxd_prompt_tokens_total{model=\"c\"} 4",
            "mlxd_completion_tokens_total{model=\"c\"} 5",
            "mlxd_completion_tokens_total{model=\"d\"} 2",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
    }

    #[tokio::test]
    async fn taps_count_tokens_from_usage_or_chunks() {
        let m = Arc::new(Metrics::new());
        {
            let mut t = RequestTap::new(m.clone(), "a", 200, Instant::now(), false);
            t.data(&Bytes::from_static(
                br#"{"choices":[],"usage":{"prompt_tokens":7,"#,
            ));
            t.data(&Bytes::from_static(br#""completion_tokens":3}}"#));
        }
        {
            let mut t = RequestTap::new(m.clone(), "a", 200, Instant::now(), true);
            for _ in 0..4 {
                t.event(&EngineEvent::new(Bytes::from_static(
                    b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n",
                )));
            }
            t.event(&EngineEvent::new(Bytes::from_static(b"data: [DONE]\n\n")));
        }
        {
            let mut t = RequestTap::new(m.clone(), "b", 200, Instant::now(), true);
            t.event(&EngineEvent::new(Bytes::from_static(
                b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n",
            )));
            t.event(&EngineEvent::new(Bytes::from_static(                 b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":9}}\n\n",             )));
        }
        m.record_failure("b", 503, Instant::now());
        let text = m.encode();
        assert!(
            text.contains("mlxd_prompt_tokens_total{model=\"a\"} 7"),
            "{text}"
        );
        assert!(
            text.contains("mlxd_completion_tokens_total{model=\"a\"} 7"),
            "{text}"
        );
        assert!(
            text.contains("mlxd_completion_tokens_total{model=\"b\"} 9"),
            "{text}"
        );
        assert!(
            text.contains("mlxd_requests_total{model=\"a\",status=\"200\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("mlxd_requests_total{model=\"b\",status=\"503\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("mlxd_time_to_first_token_seconds_count{model=\"a\"} 2"),
            "{text}"
        );
    }
}
