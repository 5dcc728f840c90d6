//! `mlxd run`: one answer for a prompt (or piped input), or a chat on the terminal with
//! Ollama's conventions — `/` commands, `"""` multi-line messages, line editing and history,
//! Ctrl-C stopping an answer while the chat goes on, Ctrl-D or `/bye` leaving.

pub mod answer;
pub mod command;
pub mod input;
pub mod line_reader;

use std::io::{IsTerminal, Write};

use futures::FutureExt;
use mlxd_client::{ChatMessage, Role};
use tokio::signal::unix::{signal, SignalKind};

use crate::client::{exit_code, Streamed};
use answer::Painter;
use command::{ChatCommand, ChatSettings};
use input::{MultiLine, Typed};
use line_reader::{LineError, LineReader, Read};

/// A chat's fixed parts.
pub struct Chat<'a> {
    pub client: &'a mlxd_client::Client,
    /// `None`: the server's default model.
    pub model: Option<String>,
    /// The model's name as shown (the default's id when `model` is `None`).
    pub shown_model: String,
    /// The server, as said to the user.
    pub server: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error(transparent)]
    Client(#[from] mlxd_client::ClientError),
    #[error(transparent)]
    Line(#[from] LineError),
    #[error("watching for Ctrl-C: {0}")]
    Signal(std::io::Error),
}

impl ChatError {
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Client(e) => crate::client::client_exit_code(e),
            Self::Line(_) | Self::Signal(_) => exit_code::SERVER,
        }
    }
}

/// Errors after which a chat cannot go on: the server is gone, or the model does not exist.
fn ends_the_chat(e: &mlxd_client::ClientError) -> bool {
    use mlxd_client::ClientError as E;
    matches!(e, E::Connect { .. } | E::Config(_)) || e.status() == Some(404)
}

fn out(s: &str) {
    let mut o = std::io::stdout().lock();
    let _ = o.write_all(s.as_bytes());
    let _ = o.flush();
}

/// One answer to `prompt`, printed to stdout as it streams; the notices on stderr.
pub async fn one_shot(
    chat: &Chat<'_>,
    settings: &ChatSettings,
    prompt: String,
) -> Result<Streamed, ChatError> {
    let history = [ChatMessage::new(Role::User, prompt)];
    let mut painter = Painter::new(std::io::stdout().is_terminal());
    let answer = answer::stream(
        chat.client,
        settings.request(chat.model.as_deref(), &history),
        &mut painter,
        true,
        std::future::pending(),
    )
    .await?;
    out(painter.end());
    report(&answer, settings, "--max-tokens");
    Ok(answer)
}

/// The notices after an answer: the token limit reached, and `--verbose`'s numbers.
fn report(answer: &Streamed, settings: &ChatSettings, how: &str) {
    if answer.hit_max_tokens() {
        eprintln!("{}", answer::max_tokens_notice(settings.max_tokens, how));
    }
    if settings.verbose {
        eprint!("{}", answer::verbose_report(answer));
    }
}

/// The chat on the terminal, until `/bye` or Ctrl-D.
pub async fn interactive(chat: &Chat<'_>, mut settings: ChatSettings) -> Result<(), ChatError> {
    // From here on SIGINT stops answers instead of ending the process; while a line is read
    // the terminal is raw and Ctrl-C reaches the line editor as a key instead.
    let mut sigint = signal(SignalKind::interrupt()).map_err(ChatError::Signal)?;
    let reader = LineReader::spawn(line_reader::history_path())?;
    eprintln!(
        "Chatting with {} at {}. Type /? for help; Ctrl-C stops an answer, Ctrl-D or /bye \
         leaves.",
        chat.shown_model, chat.server
    );
    let result = chat_loop(chat, &mut settings, &reader, &mut sigint).await;
    reader.finish();
    result
}

async fn chat_loop(
    chat: &Chat<'_>,
    settings: &mut ChatSettings,
    reader: &LineReader,
    sigint: &mut tokio::signal::unix::Signal,
) -> Result<(), ChatError> {
    let mut history: Vec<ChatMessage> = Vec::new();
    let mut multi = MultiLine::default();
    loop {
        let prompt = if multi.is_open() { "... " } else { ">>> " };
        let line = match reader.read(prompt).await? {
            Read::Eof => {
                // Leave the cursor on a fresh line, not after the prompt.
                out("\n");
                return Ok(());
            }
            Read::Interrupted => {
                if multi.is_open() {
                    multi.cancel();
                } else {
                    eprintln!("Use Ctrl-D or /bye to leave.");
                }
                continue;
            }
            Read::Line(line) => line,
        };
        let fenced = multi.is_open() || line.trim_start().starts_with("\"\"\"");
        let text = match multi.push(&line) {
            Typed::More => continue,
            Typed::Message(text) => text,
        };
        if text.trim().is_empty() {
            continue;
        }
        if !fenced {
            match command::parse(&text) {
                None => {}
                Some(Err(message)) => {
                    eprintln!("{message}");
                    continue;
                }
                Some(Ok(c)) => {
                    match c {
                        ChatCommand::Bye => return Ok(()),
                        ChatCommand::Help => eprint!("{}", command::HELP),
                        ChatCommand::Clear => {
                            history.clear();
                            eprintln!("Cleared the conversation.");
                        }
                        ChatCommand::Show => {
                            eprint!("{}", settings.show(&chat.shown_model, &chat.server))
                        }
                        ChatCommand::Set(s) => {
                            if settings.apply(s) {
                                history.clear();
                                eprintln!("Set the system prompt; the conversation starts anew.");
                            } else {
                                eprintln!("Set.");
                            }
                        }
                    }
                    continue;
                }
            }
        }
        history.push(ChatMessage::new(Role::User, text));
        // A Ctrl-C pressed before this answer is not meant for it.
        while let Some(Some(())) = sigint.recv().now_or_never() {}
        let mut painter = Painter::new(std::io::stdout().is_terminal());
        let stop = async {
            sigint.recv().await;
        };
        let answer = answer::stream(
            chat.client,
            settings.request(chat.model.as_deref(), &history),
            &mut painter,
            true,
            stop,
        )
        .await;
        match answer {
            Ok(a) => {
                out(painter.end());
                out("\n");
                if a.interrupted && a.text.is_empty() {
                    // Nothing was said: the question is withdrawn.
                    history.pop();
                } else {
                    // A stopped answer stays as far as it went, so the turns keep alternating.
                    history.push(ChatMessage::new(Role::Assistant, a.text.clone()));
                }
                report(&a, settings, "/set max_tokens");
            }
            Err(e) => {
                history.pop();
                out(painter.end());
                if ends_the_chat(&e) {
                    return Err(e.into());
                }
                eprintln!("mlxd: {e}");
            }
        }
    }
}
