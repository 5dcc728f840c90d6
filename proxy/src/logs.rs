//! Recent log lines per model — its engines' stderr and the supervisor's lifecycle
//! notes — for `GET /logs/{model}`, with live followers (`?follow=1`); and an engine's log
//! events re-emitted in the proxy's own log format ([`reemit`]).

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, RwLock};

use serde_json::Value;
use tokio::sync::broadcast;
use tracing::Level;

/// The target engine events are re-emitted under (`RUST_LOG=mlxd::engine=warn` quiets them).
pub const ENGINE_TARGET: &str = "mlxd::engine";

/// Fields that hold paths: shown at debug only, as the proxy's own paths are.
const PATH_FIELDS: &[&str] = &["socket", "dir", "path", "bin", "runtime_dir", "file"];

/// One event an engine logged: a line of its JSON log (tracing-subscriber's JSON format:
/// `level`, `target`, `fields.message` and the other fields).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineEvent {
    pub level: Level,
    /// The engine's module (`mlxd_engine::app`).
    pub target: String,
    pub message: String,
    /// The other fields in the engine's order, values as text.
    pub fields: Vec<(String, String)>,
}

impl EngineEvent {
    /// Parses one stderr line; `None` for anything that is not such a JSON event (a panic
    /// message, a C++ library's own output).
    pub fn parse(line: &str) -> Option<Self> {
        let v: Value = serde_json::from_str(line.trim()).ok()?;
        let level = v.get("level")?.as_str()?.parse().ok()?;
        let fields = v.get("fields")?.as_object()?;
        let message = match fields.get("message") {
            Some(Value::String(m)) => m.clone(),
            Some(other) => other.to_string(),
            None => String::new(),
        };
        Some(Self {
            level,
            target: v
                .get("target")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
            message,
            fields: fields
                .iter()
                .filter(|(k, _)| *k != "message")
                .map(|(k, v)| {
                    let text = match v {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    (k.clone(), text)
                })
                .collect(),
        })
    }

    /// A request's own event (it carries a `request_id`): the proxy's access line already
    /// says it, once per request, so the engine's goes to debug.
    pub fn per_request(&self) -> bool {
        self.fields.iter().any(|(k, _)| k == "request_id")
    }

    /// The level to re-emit at: a request's info events at debug, others as logged.
    pub fn reemit_level(&self) -> Level {
        match self.level {
            Level::INFO if self.per_request() => Level::DEBUG,
            l => l,
        }
    }

    /// `message k=v k=v`, as the proxy's text log writes fields (a value with spaces or
    /// quotes quoted); without the path fields unless `paths`.
    pub fn render(&self, paths: bool) -> String {
        let mut out = self.message.clone();
        for (k, v) in &self.fields {
            if !paths && PATH_FIELDS.contains(&k.as_str()) {
                continue;
            }
            let quote = v.is_empty() || v.contains(|c: char| c.is_whitespace() || c == '"');
            if !out.is_empty() {
                out.push(' ');
            }
            // Writing to a String cannot fail.
            let _ = match quote {
                true => write!(out, "{k}={v:?}"),
                false => write!(out, "{k}={v}"),
            };
        }
        out
    }

    /// Whether the event has path fields (left out of its info line).
    pub fn has_paths(&self) -> bool {
        self.fields
            .iter()
            .any(|(k, _)| PATH_FIELDS.contains(&k.as_str()))
    }
}

/// An engine's load progress as log lines: one when a phase starts, one at each quarter of
/// it, and one when it is done, so that a load on demand shows in the log as the one at
/// start-up does, without a line per report.
#[derive(Debug, Default)]
pub struct LoadLog {
    last: Option<(&'static str, u32)>,
}

impl LoadLog {
    /// The line for a report of `phase` at `progress` (`0.0..=1.0`), if it says something new.
    pub fn line(&mut self, phase: &'static str, progress: f32) -> Option<String> {
        let quarter = (progress.clamp(0.0, 1.0) * 4.0).floor() as u32;
        if let Some((p, q)) = self.last {
            if p == phase && q >= quarter {
                return None;
            }
        }
        self.last = Some((phase, quarter));
        Some(match phase {
            "starting" => "loading: starting".to_string(),
            other => format!("loading: {other} {}%", quarter * 25),
        })
    }

    /// The line for the load's end: its last phase at 100% when no report said so (the
    /// engine's last report can come before the end of a phase).
    pub fn done(&mut self) -> Option<String> {
        match self.last {
            Some((p, 4)) if p != "starting" => None,
            Some((p, _)) if p != "starting" => self.line(p, 1.0),
            _ => None,
        }
    }
}

/// Emits `text` at `level` under [`ENGINE_TARGET`], with the engine's module as a field.
fn emit(level: Level, module: &str, text: &str) {
    macro_rules! at {
        ($l:expr) => {
            tracing::event!(target: ENGINE_TARGET, $l, module = %module, "{text}")
        };
    }
    match level {
        Level::ERROR => at!(Level::ERROR),
        Level::WARN => at!(Level::WARN),
        Level::INFO => at!(Level::INFO),
        Level::DEBUG => at!(Level::DEBUG),
        Level::TRACE => at!(Level::TRACE),
    }
}

/// Re-emits one engine stderr line through this process's subscriber (inside the engine's
/// span, which names the model): a JSON event at its level, in the proxy's format, its paths
/// at debug, a request's own events at debug; any other text as it is, at info.
pub fn reemit(line: &str) {
    let Some(event) = EngineEvent::parse(line) else {
        emit(Level::INFO, "stderr", line);
        return;
    };
    let level = event.reemit_level();
    emit(level, &event.target, &event.render(false));
    if event.has_paths() && level < Level::DEBUG {
        emit(Level::DEBUG, &event.target, &event.render(true));
    }
}

/// Lines kept per model.
pub const LOG_LINES: usize = 1000;

/// One model's log: a ring of recent lines plus a broadcast for followers.
#[derive(Debug)]
pub struct ModelLog {
    lines: Mutex<VecDeque<String>>,
    live: broadcast::Sender<String>,
}

impl Default for ModelLog {
    fn default() -> Self {
        Self {
            lines: Mutex::new(VecDeque::with_capacity(64)),
            live: broadcast::channel(256).0,
        }
    }
}

impl ModelLog {
    pub fn push(&self, line: impl Into<String>) {
        let line = line.into();
        {
            // A poisoned lock only means a panic mid-push; the ring is still usable.
            let mut l = self.lines.lock().unwrap_or_else(|p| p.into_inner());
            if l.len() == LOG_LINES {
                l.pop_front();
            }
            l.push_back(line.clone());
        }
        // No followers is fine.
        let _ = self.live.send(line);
    }

    /// The last `n` lines, oldest first.
    pub fn recent(&self, n: usize) -> Vec<String> {
        let l = self.lines.lock().unwrap_or_else(|p| p.into_inner());
        l.iter().skip(l.len().saturating_sub(n)).cloned().collect()
    }

    /// The last `n` lines and a receiver for every line after them (none lost between).
    pub fn follow(&self, n: usize) -> (Vec<String>, broadcast::Receiver<String>) {
        let l = self.lines.lock().unwrap_or_else(|p| p.into_inner());
        let rx = self.live.subscribe();
        let backlog = l.iter().skip(l.len().saturating_sub(n)).cloned().collect();
        (backlog, rx)
    }
}

/// Every configured model's log: those configured at start, and those a configuration
/// reload adds.
#[derive(Debug, Default, Clone)]
pub struct Logs(Arc<RwLock<BTreeMap<String, Arc<ModelLog>>>>);

impl Logs {
    pub fn new<'a>(ids: impl IntoIterator<Item = &'a str>) -> Self {
        Self(Arc::new(RwLock::new(
            ids.into_iter()
                .map(|id| (id.to_string(), Arc::default()))
                .collect(),
        )))
    }

    pub fn get(&self, id: &str) -> Option<Arc<ModelLog>> {
        // A poisoned lock only means a panic mid-insert; the map is still usable.
        let map = self.0.read().unwrap_or_else(|p| p.into_inner());
        map.get(id).cloned()
    }

    /// The log of `id`, made empty if it has none yet.
    pub fn get_or_create(&self, id: &str) -> Arc<ModelLog> {
        let mut map = self.0.write().unwrap_or_else(|p| p.into_inner());
        map.entry(id.to_string()).or_default().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_lines_per_phase_and_quarter_ending_at_100() {
        let mut l = LoadLog::default();
        let mut lines: Vec<String> = [
            ("starting", 0.0),
            ("starting", 0.0),
            ("converting", 0.0),
            ("converting", 1.0),
            ("weights", 0.0),
            ("weights", 0.1),
            ("weights", 0.3),
            ("weights", 0.49),
            ("weights", 0.77),
        ]
        .into_iter()
        .filter_map(|(phase, p)| l.line(phase, p))
        .collect();
        lines.extend(l.done());
        assert_eq!(
            lines,
            [
                "loading: starting",
                "loading: converting 0%",
                "loading: converting 100%",
                "loading: weights 0%",
                "loading: weights 25%",
                "loading: weights 75%",
                "loading: weights 100%",
            ]
        );
        assert_eq!(l.done(), None);
        let mut only_started = LoadLog::default();
        only_started.line("starting", 0.0);
        assert_eq!(only_started.done(), None);
    }

    #[test]
    fn engine_events_in_the_proxy_format() {
        let line = r#"{"timestamp":"2026-12-02T13:18:56.5Z","level":"INFO","fields":{"message":"loaded","model":"smollm2-135m","weight_bytes":115156224,"dir":"/h/models/x"},"target":"mlxd_engine::app"}"#;
        let e = EngineEvent::parse(line).unwrap();
        assert_eq!(
            (e.level, e.target.as_str()),
            (Level::INFO, "mlxd_engine::app")
        );
        assert_eq!(
            e.render(false),
            "loaded model=smollm2-135m weight_bytes=115156224"
        );
        assert_eq!(
            e.render(true),
            "loaded model=smollm2-135m weight_bytes=115156224 dir=/h/models/x"
        );
        assert!(e.has_paths() && !e.per_request());
        assert_eq!(e.reemit_level(), Level::INFO);

        let line = r#"{"level":"INFO","fields":{"message":"request finished","request_id":"c-1","finish_reason":"length","note":"two words"},"target":"mlxd_engine::server::routes"}"#;
        let e = EngineEvent::parse(line).unwrap();
        assert!(e.per_request());
        assert_eq!(e.reemit_level(), Level::DEBUG);
        assert_eq!(
            e.render(false),
            r#"request finished request_id=c-1 finish_reason=length note="two words""#
        );
        let warn =
            r#"{"level":"WARN","fields":{"message":"slow","request_id":"c-2"},"target":"t"}"#;
        assert_eq!(
            EngineEvent::parse(warn).unwrap().reemit_level(),
            Level::WARN
        );

        for not_an_event in [
            "thread 'main' panicked at src/x.rs:1:1",
            r#"{"level":"info","msg":"fake engine ready"}"#,
            r#"{"level":"LOUD","fields":{}}"#,
            "",
        ] {
            assert_eq!(EngineEvent::parse(not_an_event), None, "{not_an_event}");
        }
    }

    #[tokio::test]
    async fn ring_and_follow() {
        let log = ModelLog::default();
        for i in 0..LOG_LINES + 5 {
            log.push(format!("l{i}"));
        }
        let r = log.recent(3);
        assert_eq!(r, ["l1002", "l1003", "l1004"]);
        assert_eq!(log.recent(usize::MAX).len(), LOG_LINES);
        let (backlog, mut rx) = log.follow(1);
        assert_eq!(backlog, ["l1004"]);
        log.push("next");
        assert_eq!(rx.recv().await.unwrap(), "next");
    }
}
