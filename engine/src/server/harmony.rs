//! OpenAI's harmony format (gpt-oss): the output is a series of messages, each a header and a
//! body, `<|channel|>CHANNEL [to=RECIPIENT] [<|constrain|>TYPE]<|message|>BODY<|end|>`, the
//! next one opened by `<|start|>assistant`. The `analysis` channel is reasoning, `final` (and
//! `commentary` addressed to no one, a preamble) is the answer, and a message addressed
//! `to=functions.NAME` is a call whose body is the JSON arguments, ended by `<|call|>`.
//!
//! The generation prompt ends with `<|start|>assistant`, so the output starts with a header.
//! `<|call|>` and `<|return|>` end the generation (they are end-of-sequence tokens and never
//! reach the text), so a message may also end with the output. The markers are special
//! tokens: the text must be detokenized with them.
use serde_json::Value;

use super::conversation::Piece;
use super::tools::{literal, partial_suffix, ParsedCall, ToolSpec};
use crate::constraint::grammar::with_layout;

const START: &str = "<|start|>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
const END: &str = "<|end|>";
const CALL: &str = "<|call|>";
const RETURN: &str = "<|return|>";
const CONSTRAIN: &str = "<|constrain|>";
const RECIPIENT: &str = "to=";
/// Where function calls are addressed.
const FUNCTIONS: &str = "functions.";

/// Every marker of the format (which the text must keep).
pub const MARKERS: [&str; 7] = [START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN];

/// Markers that end a message body and are consumed.
const BODY_ENDS: [&str; 3] = [END, CALL, RETURN];
/// Markers that end a message body by opening the next header (a model that skipped `<|end|>`).
const HEADER_OPENS: [&str; 2] = [START, CHANNEL];
/// How a header may begin.
const HEADER_STARTS: [&str; 5] = [START, CHANNEL, CONSTRAIN, " to=", RECIPIENT];
/// Longest header accepted; a longer one is not harmony and is let out as text.
const MAX_HEADER: usize = 256;

/// Where a message's body goes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Route {
    Reasoning,
    Content,
    /// A call of this function: the body is buffered and parsed whole.
    Call(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Header,
    Body(Route),
    /// The output is not harmony from here on: all of it is answer text.
    Plain,
}

/// Splits streamed harmony output into reasoning, answer and calls, holding back what may be
/// a marker, so that no markup reaches the client.
#[derive(Debug)]
pub struct HarmonyStream {
    state: State,
    buf: String,
    /// Whether messages to functions become calls (the request offered tools); otherwise
    /// their bodies are answer text.
    parse_calls: bool,
}

/// A message header's parts.
#[derive(Debug, PartialEq, Eq)]
struct Header {
    channel: Option<String>,
    recipient: Option<String>,
}

impl HarmonyStream {
    pub fn new(parse_calls: bool) -> Self {
        Self {
            state: State::Header,
            buf: String::new(),
            parse_calls,
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        while self.step(&mut out) {}
        out
    }

    /// The end of the output: a message still open ends here; a header never finished is
    /// markup without content and is dropped (unless it holds no marker: then it was text).
    pub fn finish(&mut self) -> Vec<Piece> {
        let rest = std::mem::take(&mut self.buf);
        let state = std::mem::replace(&mut self.state, State::Plain);
        let mut out = Vec::new();
        match state {
            State::Header if rest.contains("<|") => {}
            State::Header | State::Plain => push_text(&mut out, Piece::Content(rest)),
            State::Body(route) => close_body(&mut out, route, rest),
        }
        out
    }

    /// One move of the state machine; `false` when it needs more text.
    fn step(&mut self, out: &mut Vec<Piece>) -> bool {
        match self.state.clone() {
            State::Plain => {
                push_text(out, Piece::Content(std::mem::take(&mut self.buf)));
                false
            }
            State::Header => self.read_header(),
            State::Body(route) => self.read_body(route, out),
        }
    }

    fn read_header(&mut self) -> bool {
        let starts_well = HEADER_STARTS
            .iter()
            .any(|s| self.buf.starts_with(s) || s.starts_with(self.buf.as_str()));
        if !starts_well {
            self.state = State::Plain;
            return true;
        }
        let Some(end) = self.buf.find(MESSAGE) else {
            if self.buf.len() > MAX_HEADER {
                self.state = State::Plain;
                return true;
            }
            return false;
        };
        let Some(header) = parse_header(&self.buf[..end]) else {
            self.state = State::Plain;
            return true;
        };
        self.buf.drain(..end + MESSAGE.len());
        self.state = State::Body(self.route(header));
        true
    }

    fn route(&self, header: Header) -> Route {
        match (header.recipient, header.channel.as_deref()) {
            (Some(to), _) if self.parse_calls => {
                let name = to.strip_prefix(FUNCTIONS).unwrap_or(&to).to_owned();
                Route::Call(name)
            }
            (_, Some("analysis")) => Route::Reasoning,
            _ => Route::Content,
        }
    }

    fn read_body(&mut self, route: Route, out: &mut Vec<Piece>) -> bool {
        let end = BODY_ENDS
            .iter()
            .map(|m| (m, true))
            .chain(HEADER_OPENS.iter().map(|m| (m, false)))
            .filter_map(|(m, consumed)| self.buf.find(m).map(|pos| (pos, m.len(), consumed)))
            .min_by_key(|(pos, _, _)| *pos);
        match end {
            Some((pos, len, consumed)) => {
                let body: String = self.buf.drain(..pos).collect();
                if consumed {
                    self.buf.drain(..len);
                }
                close_body(out, route, body);
                self.state = State::Header;
                true
            }
            None => {
                if !matches!(route, Route::Call(_)) {
                    let keep = BODY_ENDS
                        .iter()
                        .chain(HEADER_OPENS.iter())
                        .map(|m| partial_suffix(&self.buf, m))
                        .max()
                        .unwrap_or(0);
                    let cut = self.buf.len() - keep;
                    let text: String = self.buf.drain(..cut).collect();
                    push_text(out, routed(&route, text));
                }
                false
            }
        }
    }
}

fn routed(route: &Route, text: String) -> Piece {
    match route {
        Route::Reasoning => Piece::Reasoning(text),
        Route::Content | Route::Call(_) => Piece::Content(text),
    }
}

fn push_text(out: &mut Vec<Piece>, piece: Piece) {
    if !matches!(&piece, Piece::Content(t) | Piece::Reasoning(t) if t.is_empty()) {
        out.push(piece);
    }
}

/// A finished message body: a call's arguments parsed (the body as text if they are not a
/// JSON object), other bodies' last text let out.
fn close_body(out: &mut Vec<Piece>, route: Route, body: String) {
    let Route::Call(name) = route else {
        push_text(out, routed(&route, body));
        return;
    };
    let arguments = match body.trim() {
        "" => Some(Value::Object(Default::default())),
        text => serde_json::from_str::<Value>(text)
            .ok()
            .filter(Value::is_object),
    };
    match arguments {
        Some(arguments) if super::tools::valid_name(&name) => {
            out.push(Piece::Call(ParsedCall { name, arguments }))
        }
        _ => push_text(out, Piece::Content(body)),
    }
}

/// The parts of a header (the text before `<|message|>`): `<|start|>ROLE` optionally, then
/// `<|channel|>NAME`, `to=RECIPIENT` and a content type (`<|constrain|>json` or `json`) in
/// any order. `None` when it holds anything else.
fn parse_header(text: &str) -> Option<Header> {
    let mut header = Header {
        channel: None,
        recipient: None,
    };
    let mut rest = text;
    if let Some(after) = rest.strip_prefix(START) {
        // The role (`assistant`); an address may follow it directly.
        let (_, after) = next_word(after);
        rest = after;
    }
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            return Some(header);
        }
        if let Some(after) = rest.strip_prefix(CHANNEL) {
            let (word, after) = next_word(after);
            header.channel = Some(word.to_owned()).filter(|w| !w.is_empty());
            rest = after;
        } else if let Some(after) = rest.strip_prefix(CONSTRAIN) {
            rest = next_word(after).1;
        } else if rest.starts_with("<|") {
            return None;
        } else {
            let (word, after) = next_word(rest);
            if let Some(to) = word.strip_prefix(RECIPIENT) {
                header.recipient = Some(to.to_owned()).filter(|t| !t.is_empty());
            }
            rest = after;
        }
    }
}

/// The text up to the next whitespace or marker, and what follows.
fn next_word(text: &str) -> (&str, &str) {
    let end = text
        .char_indices()
        .find(|&(i, c)| c.is_whitespace() || text[i..].starts_with("<|"))
        .map_or(text.len(), |(i, _)| i);
    text.split_at(end)
}

/// The grammar that makes the model call one of `tools`: a commentary message to the
/// function with JSON arguments under its schema. The generation ends where the arguments
/// do (the model's `<|call|>` would end it anyway); a harmony turn holds one call.
pub fn forced_grammar(tools: &[&ToolSpec], special_id: &dyn Fn(&str) -> Option<u32>) -> String {
    let mut rules = String::new();
    let mut calls = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        let header = serde_json::to_string(&format!("commentary to={FUNCTIONS}{} ", tool.name))
            .unwrap_or_default();
        rules.push_str(&format!(
            "call_{i}: {header} {} \"json\" {} args_{i}\nargs_{i}: %json {}\n",
            literal(CONSTRAIN, special_id),
            literal(MESSAGE, special_id),
            with_layout(&tool.parameters),
        ));
        calls.push(format!("call_{i}"));
    }
    format!(
        "start: {} ({})\n{rules}",
        literal(CHANNEL, special_id),
        calls.join(" | ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Feeds `text` in chunks of every size and checks the merged pieces are `want` each time.
    fn stream_equals(parse_calls: bool, text: &str, want: &[Piece]) {
        let chars: Vec<char> = text.chars().collect();
        for size in 1..=chars.len().max(1) {
            let mut h = HarmonyStream::new(parse_calls);
            let mut got = Vec::new();
            for chunk in chars.chunks(size) {
                got.extend(h.push(&chunk.iter().collect::<String>()));
            }
            got.extend(h.finish());
            let mut merged: Vec<Piece> = Vec::new();
            for piece in got {
                match (merged.last_mut(), piece) {
                    (Some(Piece::Content(a)), Piece::Content(b)) => a.push_str(&b),
                    (Some(Piece::Reasoning(a)), Piece::Reasoning(b)) => a.push_str(&b),
                    (_, piece) => merged.push(piece),
                }
            }
            assert_eq!(merged, want, "chunks of {size}: {text:?}");
        }
    }

    fn call(name: &str, arguments: Value) -> Piece {
        Piece::Call(ParsedCall {
            name: name.into(),
            arguments,
        })
    }

    #[test]
    fn analysis_is_reasoning_and_final_is_the_answer() {
        stream_equals(
            false,
            "<|channel|>analysis<|message|>User says hi.<|end|><|start|>assistant<|channel|>final<|message|>Hello <b>!</b>",
            &[
                Piece::Reasoning("User says hi.".into()),
                Piece::Content("Hello <b>!</b>".into()),
            ],
        );
    }

    #[test]
    fn calls_in_both_header_orders() {
        let text = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}<|call|>";
        stream_equals(
            true,
            text,
            &[
                Piece::Reasoning("Need weather.".into()),
                call("get_weather", json!({"city": "Oslo"})),
            ],
        );
        // `<|call|>` is an end-of-sequence token: usually the output just ends.
        stream_equals(
            true,
            " to=functions.now<|channel|>commentary json<|message|>{}",
            &[call("now", json!({}))],
        );
        // Without tools offered, the body is text (never the markup).
        stream_equals(
            false,
            "<|channel|>commentary to=functions.w <|constrain|>json<|message|>{\"a\": 1}<|call|>",
            &[Piece::Content("{\"a\": 1}".into())],
        );
    }

    #[test]
    fn a_preamble_and_the_final_answer_are_content() {
        stream_equals(
            true,
            "<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>",
            &[Piece::Content("Let me look.Done.".into())],
        );
    }

    #[test]
    fn malformed_output_is_plain_text() {
        stream_equals(false, "Just text.", &[Piece::Content("Just text.".into())]);
        stream_equals(
            true,
            "<|channel|>final<|message|>ok<|end|>stray",
            &[Piece::Content("okstray".into())],
        );
        stream_equals(
            true,
            "<|channel|>commentary to=functions.w<|message|>{not json",
            &[Piece::Content("{not json".into())],
        );
        stream_equals(
            true,
            "<|channel|>fin<|oops|><|message|>x",
            &[Piece::Content("<|channel|>fin<|oops|><|message|>x".into())],
        );
        // A header cut off by max_tokens carries nothing; text that only looks like the
        // start of one is text.
        stream_equals(true, "<|channel|>fin", &[]);
        stream_equals(true, " to=x", &[Piece::Content(" to=x".into())]);
        // A missing <|end|> before the next header.
        stream_equals(
            false,
            "<|channel|>analysis<|message|>a<|start|>assistant<|channel|>final<|message|>b",
            &[Piece::Reasoning("a".into()), Piece::Content("b".into())],
        );
    }

    #[test]
    fn headers_are_parsed() {
        assert_eq!(
            parse_header("<|start|>assistant to=functions.f<|channel|>commentary json"),
            Some(Header {
                channel: Some("commentary".into()),
                recipient: Some("functions.f".into())
            })
        );
        assert_eq!(parse_header("<|channel|>final<|end|>"), None);
    }
}
