//! Server-sent events framing: find event boundaries in a byte stream without
//! re-encoding anything, and encode single `data:` events.

use bytes::{Bytes, BytesMut};

/// Splits a byte stream into complete SSE events (each ending with a blank line:
/// `\n\n`, `\r\n\r\n` or `\r\r`). Bytes are passed through unchanged; an event is
/// released as soon as its terminating blank line has arrived.
#[derive(Debug, Default)]
pub struct SseSplitter {
    buf: BytesMut,
    /// Where to resume scanning for a boundary.
    scanned: usize,
}

impl SseSplitter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `chunk` and returns every event it completed, in order.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<Bytes> {
        self.buf.extend_from_slice(chunk);
        let mut events = Vec::new();
        while let Some(end) = find_boundary(&self.buf, self.scanned) {
            events.push(self.buf.split_to(end).freeze());
            self.scanned = 0;
        }
        // A boundary is at most 4 bytes; rescan the tail only.
        self.scanned = self.buf.len().saturating_sub(3);
        events
    }

    /// Bytes of an event not yet terminated.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// Returns whatever is left (an unterminated last event) and resets.
    pub fn finish(&mut self) -> Option<Bytes> {
        self.scanned = 0;
        (!self.buf.is_empty()).then(|| self.buf.split().freeze())
    }
}

/// End (exclusive) of the first event boundary at or after `from`.
fn find_boundary(buf: &[u8], from: usize) -> Option<usize> {
    let mut i = from;
    while i + 1 < buf.len() {
        match (buf[i], buf[i + 1]) {
            (b'\n', b'\n') => return Some(i + 2),
            (b'\r', b'\r') if buf.get(i + 2) != Some(&b'\n') => return Some(i + 2),
            (b'\r', b'\n') if buf.get(i + 2) == Some(&b'\r') && buf.get(i + 3) == Some(&b'\n') => {
                return Some(i + 4)
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// Encodes `data` (which must not contain a newline, e.g. compact JSON) as one event.
pub fn data_event(data: &str) -> Bytes {
    let mut s = String::with_capacity(data.len() + 8);
    s.push_str("data: ");
    s.push_str(data);
    s.push_str("\n\n");
    Bytes::from(s)
}

/// The OpenAI end-of-stream marker.
pub const DONE_EVENT: &[u8] = b"data: [DONE]\n\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_whole_and_partial_events() {
        let mut s = SseSplitter::new();
        assert!(s.push(b"data: {\"a\":1}").is_empty());
        assert_eq!(s.push(b"\n"), Vec::<Bytes>::new());
        let ev = s.push(b"\ndata: 2\n\ndata: 3");
        assert_eq!(
            ev,
            vec![
                Bytes::from("data: {\"a\":1}\n\n"),
                Bytes::from("data: 2\n\n")
            ]
        );
        assert_eq!(s.pending(), 7);
        assert_eq!(s.finish(), Some(Bytes::from("data: 3")));
        assert_eq!(s.finish(), None);
    }

    #[test]
    fn crlf_boundaries_and_multiline_events() {
        let mut s = SseSplitter::new();
        let ev = s.push(b"event: x\r\ndata: 1\r\n\r\nid: 2\ndata: y\n\n");
        assert_eq!(
            ev,
            vec![
                Bytes::from("event: x\r\ndata: 1\r\n\r\n"),
                Bytes::from("id: 2\ndata: y\n\n")
            ]
        );
    }

    #[test]
    fn byte_at_a_time() {
        let input = b"data: a\n\ndata: b\r\n\r\ndata: [DONE]\n\n";
        let mut s = SseSplitter::new();
        let mut out = Vec::new();
        for b in input {
            out.extend(s.push(&[*b]));
        }
        assert_eq!(out.len(), 3);
        assert_eq!(out.concat(), input.to_vec());
        assert_eq!(s.finish(), None);
    }

    #[test]
    fn encodes_data_event() {
        assert_eq!(data_event("{}"), Bytes::from("data: {}\n\n"));
    }
}
