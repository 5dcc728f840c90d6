//! One SSE event from an engine, read once for everyone who looks at it on its way to the
//! client: the resume record and the metrics tap.
//!
//! The engine's `: mlxd` meta line (see [`EventMeta`]) is cut off and parsed when the event is
//! made; the chunk's JSON is parsed at most once, the first time a reader asks for it, and
//! the same value serves the other. On a healthy stream neither reader asks (the meta line
//! says what they need), so the chunk passes as the engine's bytes, unread.

use std::cell::OnceCell;

use bytes::Bytes;
use mlxd_protocol::openai::EventMeta;
use serde_json::Value;

/// What an event's meta line said: its content, or `Err` when it did not parse.
pub type MetaLine = Result<EventMeta, ()>;

/// One whole SSE event from an engine.
pub struct EngineEvent {
    /// The event the client gets: without the meta line (a slice of the same bytes).
    bytes: Bytes,
    meta: Option<MetaLine>,
    /// The event's `data:` payload as JSON, once parsed (`None` inside: not JSON).
    json: OnceCell<Option<Value>>,
}

impl EngineEvent {
    /// Cuts the meta line, if any, off one whole event and parses it.
    pub fn new(event: Bytes) -> Self {
        let (meta, bytes) = match EventMeta::split(&event) {
            Some((meta, at)) => (Some(meta.map_err(|_| ())), event.slice(at..)),
            None => (None, event),
        };
        Self {
            bytes,
            meta,
            json: OnceCell::new(),
        }
    }

    /// The event as the client gets it (no meta line).
    pub fn bytes(&self) -> &Bytes {
        &self.bytes
    }

    /// The meta line's content, if the event had one.
    pub fn meta(&self) -> Option<&MetaLine> {
        self.meta.as_ref()
    }

    /// The data of an event that is exactly one `data:` line, else `None`.
    pub fn single_data(&self) -> Option<&str> {
        let text = std::str::from_utf8(&self.bytes).ok()?;
        let line = text.trim_end_matches(['\n', '\r']);
        if line.contains(['\n', '\r']) {
            return None;
        }
        let data = line.strip_prefix("data:")?;
        Some(data.strip_prefix(' ').unwrap_or(data))
    }

    /// The event's `data:` lines (joined, as SSE joins them) parsed as JSON; `None` for no
    /// data, `[DONE]` or what is not JSON. Parsed on the first call only.
    pub fn json(&self) -> Option<&Value> {
        self.json.get_or_init(|| parse_data(&self.bytes)).as_ref()
    }

    /// Whether the event ends its stream: `[DONE]`, or an Anthropic `message_stop` or
    /// `error` event.
    pub fn is_last(&self) -> bool {
        let Ok(text) = std::str::from_utf8(&self.bytes) else {
            return false;
        };
        text.lines().any(|l| {
            let l = l.trim_end();
            l == "data: [DONE]"
                || l == "data:[DONE]"
                || l == "event: message_stop"
                || l == "event: error"
        })
    }
}

fn parse_data(event: &[u8]) -> Option<Value> {
    let text = std::str::from_utf8(event).ok()?;
    let mut lines = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(str::trim_start);
    let first = lines.next()?;
    let joined;
    let data = match lines.next() {
        None => first,
        Some(second) => {
            joined = [first, second]
                .into_iter()
                .chain(lines)
                .collect::<Vec<_>>()
                .join("\n");
            &joined
        }
    };
    if data.is_empty() || data == "[DONE]" {
        return None;
    }
    serde_json::from_str(data).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_meta_line_is_cut_off_and_read() {
        let e = EngineEvent::new(Bytes::from_static(
            b": mlxd {\"token_ids\":[5,6],\"finish\":true}\ndata: {\"a\":1}\n\n",
        ));
        assert_eq!(e.bytes().as_ref(), b"data: {\"a\":1}\n\n");
        let meta = e.meta().unwrap().as_ref().unwrap();
        assert_eq!(meta.token_ids, [5, 6]);
        assert!(meta.finish);
        assert_eq!(e.single_data(), Some("{\"a\":1}"));
    }

    #[test]
    fn a_broken_meta_line_is_an_error_and_still_cut_off() {
        let e = EngineEvent::new(Bytes::from_static(
            b": mlxd {\"token_ids\":\"x\"}\ndata: {}\n\n",
        ));
        assert_eq!(e.meta(), Some(&Err(())));
        assert_eq!(e.bytes().as_ref(), b"data: {}\n\n");
    }

    #[test]
    fn an_event_without_the_line_passes_whole() {
        let raw = Bytes::from_static(b"data: {\"usage\":{}}\n\n");
        let e = EngineEvent::new(raw.clone());
        assert!(e.meta().is_none());
        assert_eq!(e.bytes(), &raw);
        assert!(e.json().unwrap().get("usage").is_some());
    }

    #[test]
    fn the_json_is_parsed_once_and_shared() {
        let e = EngineEvent::new(Bytes::from_static(b"data: {\"x\":[1]}\n\n"));
        let first: *const Value = e.json().unwrap();
        let second: *const Value = e.json().unwrap();
        assert_eq!(first, second, "the second reader gets the first parse");
    }

    #[test]
    fn data_lines_done_and_anthropic_events() {
        let multi = EngineEvent::new(Bytes::from_static(b"data: {\"a\":\ndata: 2}\n\n"));
        assert_eq!(multi.json(), Some(&serde_json::json!({"a": 2})));
        assert_eq!(multi.single_data(), None);
        let done = EngineEvent::new(Bytes::from_static(b"data: [DONE]\n\n"));
        assert!(done.is_last());
        assert_eq!(done.json(), None);
        assert_eq!(done.single_data(), Some("[DONE]"));
        let stop = EngineEvent::new(Bytes::from_static(
            b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
        ));
        assert!(stop.is_last());
        assert_eq!(stop.json().unwrap()["type"], "message_stop");
        let not_json = EngineEvent::new(Bytes::from_static(b"data: nope\n\n"));
        assert_eq!(not_json.json(), None);
        assert!(!not_json.is_last());
        let comment = EngineEvent::new(Bytes::from_static(b": keep-alive\n\n"));
        assert_eq!(comment.json(), None);
        assert_eq!(comment.single_data(), None);
    }
}
