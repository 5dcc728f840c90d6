//! One streamed answer: sent through `mlxd-client`, shown as it arrives (thinking dimmed on a
//! terminal), stopped early when the caller's `stop` future fires (Ctrl-C), and reported
//! (`--verbose`, the `--max-tokens` notice).

use std::future::Future;
use std::io::Write;
use std::time::{Duration, Instant};

use futures::StreamExt;
use mlxd_client::{ChatCompletionRequest, CompletionClient};

use crate::client::Streamed;

/// ANSI faint, and back to normal.
const DIM: &str = "\x1b[2m";
const RESET: &str = "\x1b[0m";

/// Turns the pieces of an answer into what is printed: thinking dimmed (on a terminal) or left
/// out (in a pipe, where stdout is the answer), set apart from the answer by a blank line.
#[derive(Debug)]
pub struct Painter {
    terminal: bool,
    thinking: bool,
    wrote: bool,
}

impl Painter {
    pub fn new(terminal: bool) -> Self {
        Self {
            terminal,
            thinking: false,
            wrote: false,
        }
    }

    pub fn reasoning(&mut self, piece: &str) -> String {
        if !self.terminal {
            return String::new();
        }
        self.thinking = true;
        self.wrote = true;
        format!("{DIM}{piece}{RESET}")
    }

    pub fn content(&mut self, piece: &str) -> String {
        let mut out = String::new();
        if self.thinking {
            self.thinking = false;
            out.push_str("\n\n");
        }
        self.wrote = true;
        out.push_str(piece);
        out
    }

    /// The end of the answer: one newline, so the next prompt starts on its own line.
    pub fn end(&mut self) -> &'static str {
        if self.thinking {
            self.thinking = false;
        }
        "\n"
    }
}

/// Streams `request` (usage asked for), printing through `painter` to stdout, until the
/// server finishes or `stop` fires; dropping the stream on `stop` closes the connection,
/// which cancels the request on the server.
pub async fn stream(
    client: &mlxd_client::Client,
    mut request: ChatCompletionRequest,
    painter: &mut Painter,
    print: bool,
    stop: impl Future<Output = ()>,
) -> Result<Streamed, mlxd_client::ClientError> {
    request.params.stream_options = Some(mlxd_protocol::openai::StreamOptions {
        include_usage: Some(true),
    });
    let start = Instant::now();
    let mut out = Streamed::default();
    let show = |s: String| {
        if print && !s.is_empty() {
            let mut o = std::io::stdout().lock();
            // A closed stdout (`| head`) ends nothing here: the answer is still collected.
            let _ = o.write_all(s.as_bytes());
            let _ = o.flush();
        }
    };
    tokio::pin!(stop);
    let run = async {
        let mut chunks = client.stream(request).await?;
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk?;
            if let Some(usage) = &chunk.usage {
                out.prompt_tokens = Some(usage.prompt_tokens);
                out.completion_tokens = Some(usage.completion_tokens);
                out.cached_tokens = usage.prompt_tokens_details.map(|d| d.cached_tokens);
            }
            for choice in chunk.choices {
                if let Some(r) = choice.finish_reason {
                    out.finish_reason = Some(r);
                }
                if let Some(piece) = choice.delta.reasoning_content.filter(|p| !p.is_empty()) {
                    out.first_token.get_or_insert_with(|| start.elapsed());
                    out.reasoning.push_str(&piece);
                    show(painter.reasoning(&piece));
                }
                if let Some(piece) = choice.delta.content.filter(|p| !p.is_empty()) {
                    out.first_token.get_or_insert_with(|| start.elapsed());
                    out.text.push_str(&piece);
                    show(painter.content(&piece));
                }
            }
        }
        Ok::<_, mlxd_client::ClientError>(())
    };
    let interrupted = tokio::select! {
        done = run => {
            done?;
            false
        }
        _ = &mut stop => true,
    };
    out.interrupted = interrupted;
    out.elapsed = start.elapsed();
    Ok(out)
}

/// `--verbose`'s report after an answer: tokens and rates, as Ollama prints them.
pub fn verbose_report(a: &Streamed) -> String {
    let count = |n: Option<u64>| n.map_or("-".to_string(), |n| n.to_string());
    let rate = |r: Option<f64>| r.map_or("-".to_string(), |r| format!("{r:.1} tokens/s"));
    let ms = |d: Option<Duration>| {
        d.map_or("-".to_string(), |d| {
            format!("{:.0} ms", d.as_secs_f64() * 1e3)
        })
    };
    let cached = match a.cached_tokens {
        Some(c) => format!(" ({c} from the prompt cache)"),
        None => String::new(),
    };
    format!(
        "prompt tokens:       {}{cached}\n\
         time to first token: {}\n\
         prefill rate:        {}\n\
         answer tokens:       {}\n\
         decode rate:         {}\n\
         total time:          {}\n",
        count(a.prompt_tokens),
        ms(a.first_token),
        rate(a.prefill_rate()),
        count(a.completion_tokens),
        rate(a.decode_rate()),
        ms(Some(a.elapsed)),
    )
}

/// The notice for an answer cut at the token limit, naming how to raise it (`how`:
/// `--max-tokens` or `/set max_tokens`).
pub fn max_tokens_notice(limit: u32, how: &str) -> String {
    format!("(the answer stopped at the {limit}-token limit; {how} N allows longer ones)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thinking_is_dimmed_on_a_terminal_and_left_out_in_a_pipe() {
        let mut p = Painter::new(true);
        assert_eq!(p.reasoning("hmm"), "\x1b[2mhmm\x1b[0m");
        assert_eq!(p.content("Paris"), "\n\nParis");
        assert_eq!(p.content("."), ".");
        assert_eq!(p.end(), "\n");
        let mut p = Painter::new(false);
        assert_eq!(p.reasoning("hmm"), "");
        assert_eq!(p.content("Paris"), "Paris");
    }

    #[test]
    fn verbose_report_has_counts_and_rates() {
        let a = Streamed {
            first_token: Some(Duration::from_millis(100)),
            elapsed: Duration::from_millis(1100),
            prompt_tokens: Some(41),
            cached_tokens: Some(1),
            completion_tokens: Some(11),
            ..Default::default()
        };
        let r = verbose_report(&a);
        assert!(
            r.contains("prompt tokens:       41 (1 from the prompt cache)"),
            "{r}"
        );
        assert!(r.contains("prefill rate:        400.0 tokens/s"), "{r}");
        assert!(r.contains("decode rate:         10.0 tokens/s"), "{r}");
        assert!(r.contains("time to first token: 100 ms"), "{r}");
        let none = verbose_report(&Streamed::default());
        assert!(none.contains("answer tokens:       -"), "{none}");
    }
}
