//! Server-sent events framing: find event boundaries in a byte stream without
//! re-encoding anything, and encode single `data:` events.

use bytes::{Bytes, BytesMut};

/// Splits a byte stream into complete SSE events (each ending with a blank line: two
/// line terminators in a row, a terminator being `\r\n`, `\n` or `\r`). Bytes are passed
/// through unchanged; an event is released as soon as its blank line is complete. The
/// result does not depend on how the stream is cut into chunks: a `\r` at the end of a
/// chunk waits for the next byte, which may be its `\n`.
#[derive(Debug, Default)]
pub struct SseSplitter {
    buf: BytesMut,
    scan: Scan,
}

/// Where the boundary scan stands, so each byte is looked at once.
#[derive(Debug, Default, Clone, Copy)]
struct Scan {
    /// Next byte to look at.
    pos: usize,
    /// The current line has no bytes yet (only true after a terminator: the start of
    /// an event counts as mid-line, so a stray leading newline joins the next event).
    line_empty: bool,
    /// The byte before `pos` was `\r`; whether `\n` follows decides the terminator.
    cr: bool,
}

impl SseSplitter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `chunk` and returns every event it completed, in order.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<Bytes> {
        self.buf.extend_from_slice(chunk);
        let mut events = Vec::new();
        while let Some(end) = find_boundary(&self.buf, &mut self.scan) {
            events.push(self.buf.split_to(end).freeze());
            self.scan = Scan::default();
        }
        events
    }

    /// Bytes of an event not yet terminated.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// Returns whatever is left (an unterminated last event) and resets.
    pub fn finish(&mut self) -> Option<Bytes> {
        self.scan = Scan::default();
        (!self.buf.is_empty()).then(|| self.buf.split().freeze())
    }
}

/// End (exclusive) of the first blank line, continuing from `scan`.
fn find_boundary(buf: &[u8], scan: &mut Scan) -> Option<usize> {
    while scan.pos < buf.len() {
        let b = buf[scan.pos];
        if scan.cr {
            scan.cr = false;
            // `\r\n` ends after the `\n`; a lone `\r` ended before this byte.
            let end = if b == b'\n' { scan.pos + 1 } else { scan.pos };
            if std::mem::replace(&mut scan.line_empty, true) {
                return Some(end);
            }
            if b == b'\n' {
                scan.pos += 1;
            }
            continue;
        }
        match b {
            b'\r' => scan.cr = true,
            b'\n' => {
                if std::mem::replace(&mut scan.line_empty, true) {
                    return Some(scan.pos + 1);
                }
            }
            _ => scan.line_empty = false,
        }
        scan.pos += 1;
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
    fn lone_cr_and_mixed_terminators() {
        let mut s = SseSplitter::new();
        // CR then CRLF is a blank line; so are LF then CR, and CR CR.
        let ev = s.push(b"data: a\r\r\ndata: b\n\rdata: c\r\rx");
        assert_eq!(
            ev,
            vec![
                Bytes::from("data: a\r\r\n"),
                Bytes::from("data: b\n\r"),
                Bytes::from("data: c\r\r")
            ]
        );
        // A CR at the end of a chunk waits for the next byte.
        let mut s = SseSplitter::new();
        assert!(s.push(b"data: a\r\r").is_empty());
        assert_eq!(s.push(b"\n"), vec![Bytes::from("data: a\r\r\n")]);
    }

    #[test]
    fn encodes_data_event() {
        assert_eq!(data_event("{}"), Bytes::from("data: {}\n\n"));
    }
}

#[cfg(test)]
mod proptests {
    use super::*;
    use proptest::prelude::*;

    /// Bytes rich in terminators, so boundaries of every kind occur.
    fn sse_bytes() -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::vec(
            prop_oneof![
                Just(b'\n'),
                Just(b'\r'),
                Just(b'd'),
                Just(b':'),
                any::<u8>()
            ],
            0..512,
        )
    }

    fn split_all(input: &[u8], cuts: &[usize]) -> (Vec<Bytes>, Option<Bytes>) {
        let mut s = SseSplitter::new();
        let mut out = Vec::new();
        let mut at = 0;
        for c in cuts {
            let c = (*c).clamp(at, input.len());
            out.extend(s.push(&input[at..c]));
            at = c;
        }
        out.extend(s.push(&input[at..]));
        (out, s.finish())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(std::env::var("MLXD_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(512)))]

        /// Nothing is lost, added or reordered; every released event ends with a
        /// terminator; and the events are the same however the input is chunked.
        #[test]
        fn lossless_and_chunking_invariant(
            input in sse_bytes(),
            mut cuts in proptest::collection::vec(0usize..512, 0..16),
        ) {
            cuts.sort_unstable();
            let (whole, whole_rest) = split_all(&input, &[]);
            let (chunked, chunked_rest) = split_all(&input, &cuts);
            let mut joined: Vec<u8> = whole.concat();
            joined.extend(whole_rest.clone().unwrap_or_default());
            prop_assert_eq!(&joined, &input);
            for ev in &whole {
                let last = *ev.last().unwrap();
                prop_assert!(last == b'\n' || last == b'\r');
            }
            prop_assert_eq!(whole, chunked);
            prop_assert_eq!(whole_rest, chunked_rest);
        }
    }
}
