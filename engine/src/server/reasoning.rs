//! Reasoning models: the thinking text between `<think>` and `</think>` separated from the
//! answer, whole or streamed (OpenAI's `reasoning_content`, Anthropic's `thinking` blocks).
//!
//! Active for templates that write `<think>` (Qwen3, DeepSeek-R1 and their kin). Thinking
//! starts either in the output (`<think>` first) or already in the prompt (a generation
//! prompt that ends with `<think>`, as templates that always think render it).
use super::tools::partial_suffix;

pub const THINK_OPEN: &str = "<think>";
pub const THINK_CLOSE: &str = "</think>";

/// A piece of output: thinking or answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Thinking(String),
    Answer(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Only whitespace so far; `<think>` may still open.
    Start,
    Thinking,
    /// Just after `</think>`: the whitespace before the answer is dropped.
    AnswerStart,
    Answer,
}

/// Splits streamed text into thinking and answer, holding back what may be a tag.
#[derive(Debug)]
pub struct ReasoningSplit {
    state: State,
    buf: String,
}

impl ReasoningSplit {
    /// `prompt_text`: the rendered prompt (thinking is open when it ends with `<think>`).
    pub fn new(prompt_text: &str) -> Self {
        let open = prompt_text.trim_end().ends_with(THINK_OPEN);
        Self {
            state: if open { State::Thinking } else { State::Start },
            buf: String::new(),
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<Part> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.state {
                State::AnswerStart => {
                    // The answer usually starts after a blank line.
                    let rest = self.buf.trim_start();
                    if rest.is_empty() {
                        self.buf.clear();
                        return out;
                    }
                    self.buf = rest.to_owned();
                    self.state = State::Answer;
                }
                State::Answer => {
                    if !self.buf.is_empty() {
                        out.push(Part::Answer(std::mem::take(&mut self.buf)));
                    }
                    return out;
                }
                State::Start => {
                    let trimmed = self.buf.trim_start();
                    if trimmed.starts_with(THINK_OPEN) {
                        let skip = self.buf.len() - trimmed.len() + THINK_OPEN.len();
                        self.buf.drain(..skip);
                        self.state = State::Thinking;
                    } else if THINK_OPEN.starts_with(trimmed) {
                        return out;
                    } else {
                        self.state = State::Answer;
                    }
                }
                State::Thinking => match self.buf.find(THINK_CLOSE) {
                    Some(pos) => {
                        let thinking: String = self.buf.drain(..pos).collect();
                        self.buf.drain(..THINK_CLOSE.len());
                        if !thinking.is_empty() {
                            out.push(Part::Thinking(thinking));
                        }
                        self.state = State::AnswerStart;
                    }
                    None => {
                        let keep = partial_suffix(&self.buf, THINK_CLOSE);
                        let cut = self.buf.len() - keep;
                        if cut > 0 {
                            out.push(Part::Thinking(self.buf.drain(..cut).collect()));
                        }
                        return out;
                    }
                },
            }
        }
    }

    /// The end: held-back text goes to the part it was in.
    pub fn finish(&mut self) -> Vec<Part> {
        let rest = std::mem::take(&mut self.buf);
        if rest.is_empty() {
            return Vec::new();
        }
        match self.state {
            State::Thinking => vec![Part::Thinking(rest)],
            State::Start | State::AnswerStart | State::Answer => vec![Part::Answer(rest)],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(prompt: &str, text: &str, size: usize) -> (String, String) {
        let mut s = ReasoningSplit::new(prompt);
        let chars: Vec<char> = text.chars().collect();
        let mut parts = Vec::new();
        for chunk in chars.chunks(size) {
            parts.extend(s.push(&chunk.iter().collect::<String>()));
        }
        parts.extend(s.finish());
        let (mut thinking, mut answer) = (String::new(), String::new());
        for p in parts {
            match p {
                Part::Thinking(t) => thinking.push_str(&t),
                Part::Answer(a) => answer.push_str(&a),
            }
        }
        (thinking, answer)
    }

    #[test]
    fn thinking_is_split_whole_and_streamed() {
        let text = "<think>\nLet me see.\n</think>\n\nIt is 4.";
        for size in 1..=text.len() {
            assert_eq!(
                split("<|im_start|>assistant\n", text, size),
                ("\nLet me see.\n".into(), "It is 4.".into()),
                "chunks of {size}"
            );
        }
        // Opened by the prompt.
        assert_eq!(
            split("assistant\n<think>\n", "hmm</think>ok", 2),
            ("hmm".into(), "ok".into())
        );
        // No thinking at all, and thinking cut off by max_tokens.
        assert_eq!(
            split("", "just <b>text</b>", 1),
            ("".into(), "just <b>text</b>".into())
        );
        assert_eq!(
            split("", "<think>still going", 3),
            ("still going".into(), "".into())
        );
    }
}
