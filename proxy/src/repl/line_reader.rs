//! Line editing and history for the chat (rustyline), on a thread of its own: reading a line
//! blocks, and the async side asks for one line at a time, only after an answer is done.
//!
//! Each line gets a fresh editor, given the history so far. A rustyline editor takes SIGINT
//! and SIGWINCH over for as long as it lives (its `signal-hook` build does not, but then it
//! stalls on input that arrives in one burst, a paste or keys typed ahead); so the editor lives
//! only while a line is read, the terminal raw and Ctrl-C a key, and between lines SIGINT is
//! the chat's, to stop an answer.

use std::path::PathBuf;

use rustyline::error::ReadlineError;
use rustyline::history::{DefaultHistory, History};
use rustyline::Editor;
use tokio::sync::{mpsc, oneshot};

/// What reading a line gave.
#[derive(Debug)]
pub enum Read {
    Line(String),
    /// Ctrl-C at the prompt.
    Interrupted,
    /// Ctrl-D on an empty line.
    Eof,
}

#[derive(Debug, thiserror::Error)]
pub enum LineError {
    #[error("the terminal: {0}")]
    Terminal(#[from] ReadlineError),
    #[error("the line editor's thread has stopped")]
    Gone,
}

type Ask = (String, oneshot::Sender<Result<Read, ReadlineError>>);

/// The line editor's thread; [`LineReader::finish`] ends it and saves the history.
pub struct LineReader {
    asks: mpsc::UnboundedSender<Ask>,
    thread: std::thread::JoinHandle<()>,
}

/// Where the chat's history is kept: `$XDG_STATE_HOME/mlxd/history`, else
/// `~/.local/state/mlxd/history`.
pub fn history_path() -> Option<PathBuf> {
    let base = match std::env::var_os("XDG_STATE_HOME").filter(|x| !x.is_empty()) {
        Some(x) => PathBuf::from(x),
        None => {
            PathBuf::from(std::env::var_os("HOME").filter(|h| !h.is_empty())?).join(".local/state")
        }
    };
    Some(base.join("mlxd").join("history"))
}

/// An editor holding `entries` as its history.
fn editor(entries: &[String]) -> Result<Editor<(), DefaultHistory>, ReadlineError> {
    let mut editor: Editor<(), DefaultHistory> = Editor::new()?;
    for e in entries {
        editor.add_history_entry(e.as_str())?;
    }
    Ok(editor)
}

/// The entries of the history file at `path`; none when it does not exist yet.
fn load(path: &std::path::Path) -> Vec<String> {
    let mut history = DefaultHistory::new();
    match history.load(path) {
        Ok(()) => history.iter().cloned().collect(),
        Err(e) => {
            // An unreadable history is a fresh one, not a reason to refuse a chat.
            if path.exists() {
                eprintln!(
                    "mlxd: the chat history in {} was not read: {e}",
                    path.display()
                );
            }
            Vec::new()
        }
    }
}

fn save(path: &std::path::Path, entries: &[String]) -> Result<(), ReadlineError> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut history = DefaultHistory::new();
    for e in entries {
        history.add(e)?;
    }
    history.save(path)
}

impl LineReader {
    /// Starts the editor's thread, with the history of `history` (created when first saved).
    pub fn spawn(history: Option<PathBuf>) -> Result<Self, LineError> {
        let (asks, mut rx) = mpsc::unbounded_channel::<Ask>();
        let thread = std::thread::Builder::new()
            .name("mlxd-line-editor".into())
            .spawn(move || {
                let mut entries = history.as_deref().map(load).unwrap_or_default();
                while let Some((prompt, reply)) = rx.blocking_recv() {
                    let read = editor(&entries).and_then(|mut e| e.readline(&prompt));
                    let read = match read {
                        Ok(line) => {
                            if !line.trim().is_empty() && entries.last() != Some(&line) {
                                entries.push(line.clone());
                            }
                            Ok(Read::Line(line))
                        }
                        Err(ReadlineError::Interrupted) => Ok(Read::Interrupted),
                        Err(ReadlineError::Eof) => Ok(Read::Eof),
                        Err(e) => Err(e),
                    };
                    if reply.send(read).is_err() {
                        break;
                    }
                }
                if let Some(h) = &history {
                    if let Err(e) = save(h, &entries) {
                        eprintln!(
                            "mlxd: the chat history was not saved to {}: {e}",
                            h.display()
                        );
                    }
                }
            })
            .map_err(|e| LineError::Terminal(ReadlineError::Io(e)))?;
        Ok(Self { asks, thread })
    }

    /// Reads one line after showing `prompt`.
    pub async fn read(&self, prompt: &str) -> Result<Read, LineError> {
        let (tx, rx) = oneshot::channel();
        self.asks
            .send((prompt.to_string(), tx))
            .map_err(|_| LineError::Gone)?;
        Ok(rx.await.map_err(|_| LineError::Gone)??)
    }

    /// Ends the editor's thread once it has saved the history.
    pub fn finish(self) {
        drop(self.asks);
        if self.thread.join().is_err() {
            eprintln!("mlxd: the line editor's thread panicked; the chat history may be lost");
        }
    }
}
