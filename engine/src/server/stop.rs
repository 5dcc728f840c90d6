//! Stop strings over a stream of text deltas.
//!
//! Text that might be the start of a stop string is held back until the next delta shows
//! whether it is. Deltas are held whole (never split) so that every delta sent to the client
//! carries exactly the token ids whose text it holds: a resumed stream then starts on a token
//! boundary.
use crate::detokenizer::Delta;

/// What one push gives back.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct StopOutcome {
    /// Text (and ids) that is final and can be sent.
    pub emit: Delta,
    /// A stop string was found; `emit` ends just before it and generation should end.
    pub stopped: bool,
}

pub struct StopMatcher {
    stops: Vec<String>,
    held: Vec<Delta>,
    /// The stop string that ended the text, once one has.
    matched: Option<String>,
}

impl StopMatcher {
    /// `stops` must not contain empty strings.
    pub fn new(stops: Vec<String>) -> Self {
        debug_assert!(stops.iter().all(|s| !s.is_empty()));
        Self {
            stops,
            held: Vec::new(),
            matched: None,
        }
    }

    /// The stop string that ended the text (Anthropic's `stop_sequence`).
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    pub fn push(&mut self, delta: Delta) -> StopOutcome {
        if self.stops.is_empty() {
            return StopOutcome {
                emit: delta,
                stopped: false,
            };
        }
        self.held.push(delta);
        let text: String = self.held.iter().map(|d| d.text.as_str()).collect();

        let found = self
            .stops
            .iter()
            .filter_map(|s| text.find(s.as_str()).map(|pos| (pos, s)))
            .min_by_key(|(pos, _)| *pos);
        if let Some((pos, stop)) = found {
            self.matched = Some(stop.clone());
            let ids = self.held.drain(..).flat_map(|d| d.ids).collect();
            return StopOutcome {
                emit: Delta {
                    text: text[..pos].to_owned(),
                    ids,
                },
                stopped: true,
            };
        }

        let safe = text.len() - self.longest_partial_stop(&text);
        let mut end = 0;
        let mut whole = 0;
        for d in &self.held {
            if end + d.text.len() > safe {
                break;
            }
            end += d.text.len();
            whole += 1;
        }
        let mut emit = Delta::default();
        for d in self.held.drain(..whole) {
            emit.text.push_str(&d.text);
            emit.ids.extend(d.ids);
        }
        StopOutcome {
            emit,
            stopped: false,
        }
    }

    /// At the end of generation: everything still held, since no stop string completed.
    pub fn finish(&mut self) -> Delta {
        let mut out = Delta::default();
        for d in self.held.drain(..) {
            out.text.push_str(&d.text);
            out.ids.extend(d.ids);
        }
        out
    }

    /// Byte length of the longest end of `text` that is a proper prefix of a stop string.
    fn longest_partial_stop(&self, text: &str) -> usize {
        self.stops
            .iter()
            .filter_map(|stop| {
                (1..stop.len())
                    .rev()
                    .filter(|&k| stop.is_char_boundary(k))
                    .find(|&k| text.ends_with(&stop[..k]))
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(text: &str, id: u32) -> Delta {
        Delta {
            text: text.into(),
            ids: vec![id],
        }
    }

    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, bool, String) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut sent = Vec::new();
        for (i, p) in pieces.iter().enumerate() {
            let out = m.push(d(p, i as u32));
            if !out.emit.text.is_empty() {
                sent.push(out.emit.text);
            }
            if out.stopped {
                return (sent, true, String::new());
            }
        }
        (sent, false, m.finish().text)
    }

    #[test]
    fn no_stops_passes_through() {
        assert_eq!(
            run(&[], &["a", "b"]),
            (vec!["a".into(), "b".into()], false, "".into())
        );
    }

    #[test]
    fn stop_inside_one_delta_is_cut() {
        assert_eq!(
            run(&["END"], &["ab", "cENDd"]),
            (vec!["ab".into(), "c".into()], true, "".into())
        );
    }

    #[test]
    fn stop_across_deltas_is_held_then_cut() {
        let (sent, stopped, _) = run(&["END"], &["xE", "N", "D", "more"]);
        assert_eq!(sent, vec!["x"]);
        assert!(stopped);
        let (sent, stopped, _) = run(&["END"], &["ab", "xE", "N", "D"]);
        assert_eq!(sent, vec!["ab", "x"]);
        assert!(stopped);
    }

    #[test]
    fn false_alarm_is_released_whole() {
        let (sent, stopped, rest) = run(&["END"], &["xE", "Nx", "y"]);
        assert_eq!(sent, vec!["xENx", "y"]);
        assert!(!stopped);
        assert_eq!(rest, "");
        let (sent, stopped, rest) = run(&["END"], &["a", "EN"]);
        assert_eq!(
            (sent, stopped, rest),
            (vec!["a".into()], false, "EN".into())
        );
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        let (sent, stopped, _) = run(&["\n\n", "b"], &["ab\n\nc"]);
        assert_eq!((sent, stopped), (vec!["a".into()], true));
    }

    #[test]
    fn multibyte_stop_prefixes() {
        let (sent, stopped, _) = run(&["日本"], &["x日", "本"]);
        assert_eq!((sent, stopped), (vec!["x".into()], true));
        let (sent, stopped, _) = run(&["日本"], &["x日", "語"]);
        assert_eq!((sent, stopped), (vec!["x日語".into()], false));
    }

    #[test]
    fn ids_travel_with_their_text() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push(d("a", 1)).emit, d("a", 1));
        assert_eq!(m.push(d("E", 2)).emit, Delta::default());
        let out = m.push(d("x", 3));
        assert_eq!(
            out.emit,
            Delta {
                text: "Ex".into(),
                ids: vec![2, 3]
            }
        );
        let out = m.push(d("EN", 4));
        assert_eq!(out.emit, Delta::default());
        let out = m.push(d("D!", 5));
        assert!(out.stopped);
        assert_eq!(
            out.emit,
            Delta {
                text: "".into(),
                ids: vec![4, 5]
            }
        );
    }
}
