//! Turning what a person types or pipes into prompts: `"""` multi-line messages in the chat,
//! and one prompt from piped stdin (with or without a prompt argument). Pure.

/// The fence that opens and closes a multi-line message.
const FENCE: &str = "\"\"\"";

/// What a typed line gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Typed {
    /// A whole message (or command) to act on.
    Message(String),
    /// Inside a `"""` message: more lines are needed.
    More,
}

/// Collects the lines of a `"""` message: a line starting with `"""` opens it (text after the
/// fence is its first line), a line ending with `"""` closes it; outside one, each line is a
/// message.
#[derive(Debug, Default)]
pub struct MultiLine {
    open: Option<String>,
}

impl MultiLine {
    /// True inside a `"""` message (the prompt shows `...`).
    pub fn is_open(&self) -> bool {
        self.open.is_some()
    }

    /// Drops a message being written (Ctrl-C).
    pub fn cancel(&mut self) {
        self.open = None;
    }

    pub fn push(&mut self, line: &str) -> Typed {
        match self.open.take() {
            None => {
                let Some(rest) = line.trim_start().strip_prefix(FENCE) else {
                    return Typed::Message(line.to_string());
                };
                let end = rest.trim_end();
                if let Some(body) = end.strip_suffix(FENCE) {
                    return Typed::Message(body.to_string());
                }
                self.open = Some(if rest.trim().is_empty() {
                    String::new()
                } else {
                    format!("{rest}\n")
                });
                Typed::More
            }
            Some(mut text) => match line.trim_end().strip_suffix(FENCE) {
                Some(last) => {
                    text.push_str(last);
                    Typed::Message(text.trim_end_matches('\n').to_string())
                }
                None => {
                    text.push_str(line);
                    text.push('\n');
                    self.open = Some(text);
                    Typed::More
                }
            },
        }
    }
}

/// The one prompt of `mlxd run` when stdin is piped: all of stdin (not a prompt per line),
/// with the prompt argument after it, as Ollama does (`cat notes.txt | mlxd run m "Summarise
/// the text above"`). `None` when both are empty: nothing to send.
pub fn piped_prompt(argument: Option<&str>, stdin: &str) -> Option<String> {
    let piped = stdin.trim_end_matches(['\n', '\r']);
    let argument = argument.unwrap_or("");
    match (piped.trim().is_empty(), argument.trim().is_empty()) {
        (true, true) => None,
        (true, false) => Some(argument.to_string()),
        (false, true) => Some(piped.to_string()),
        (false, false) => Some(format!("{piped}\n\n{argument}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_lines_are_messages() {
        let mut m = MultiLine::default();
        assert_eq!(m.push("hello"), Typed::Message("hello".into()));
        assert_eq!(m.push(""), Typed::Message("".into()));
        assert!(!m.is_open());
    }

    #[test]
    fn fenced_messages_span_lines() {
        let mut m = MultiLine::default();
        assert_eq!(m.push("\"\"\""), Typed::More);
        assert!(m.is_open());
        assert_eq!(m.push("first line"), Typed::More);
        assert_eq!(m.push(""), Typed::More);
        assert_eq!(
            m.push("third\"\"\""),
            Typed::Message("first line\n\nthird".into())
        );
        assert!(!m.is_open());
        // Text on the opening line, the fence alone on the closing one.
        assert_eq!(m.push("\"\"\"Say A."), Typed::More);
        assert_eq!(m.push("Say B."), Typed::More);
        assert_eq!(m.push("\"\"\""), Typed::Message("Say A.\nSay B.".into()));
        // Opened and closed on one line.
        assert_eq!(
            m.push("\"\"\"one line\"\"\""),
            Typed::Message("one line".into())
        );
        // A command inside a message is text.
        assert_eq!(m.push("\"\"\""), Typed::More);
        assert_eq!(m.push("/bye"), Typed::More);
        assert_eq!(m.push("\"\"\""), Typed::Message("/bye".into()));
        assert_eq!(m.push("\"\"\""), Typed::More);
        m.cancel();
        assert!(!m.is_open());
        assert_eq!(m.push("after"), Typed::Message("after".into()));
    }

    #[test]
    fn piped_input_is_one_prompt() {
        assert_eq!(
            piped_prompt(None, "Say A.\n\nSay B.\n"),
            Some("Say A.\n\nSay B.".into())
        );
        assert_eq!(
            piped_prompt(Some("Repeat the text above"), "text\n"),
            Some("text\n\nRepeat the text above".into())
        );
        assert_eq!(piped_prompt(Some("hi"), ""), Some("hi".into()));
        assert_eq!(piped_prompt(None, "\n\n"), None);
        assert_eq!(piped_prompt(Some(" "), ""), None);
    }
}
