//! The write-behind thread: entries queued by the MLX thread are written here, off the decode
//! path, atomically (a temporary file, fsync, rename, fsync of the directory), then indexed;
//! the files the index gives up (redundant prefixes, the size cap) are deleted.
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;

use mlx_rs::Array;

use super::format::Header;
use super::index::IndexEntry;
use super::{now_ms, tensors, Shared};

/// Prefix of a file being written; left over only by a crash, deleted at start-up.
pub const TEMP_PREFIX: &str = ".tmp-";

/// What the writer thread is asked to do, in queue order (a command, not a batch job).
pub enum WriterCommand {
    Write {
        name: String,
        /// Boxed: the header is large beside the other commands.
        header: Box<Header>,
        /// The payload's arrays, evaluated and row-contiguous, in order.
        arrays: Vec<Array>,
        checkpoint: bool,
    },
    /// Answered once every job queued before it is done.
    Flush(Sender<()>),
    /// The tier is dropped: stop (handles may still hold senders).
    Close,
}

pub fn run(dir: PathBuf, shared: Arc<Shared>, jobs: Receiver<WriterCommand>) {
    for job in jobs {
        match job {
            WriterCommand::Write {
                name,
                header,
                arrays,
                checkpoint,
            } => {
                shared.pending.fetch_sub(1, Ordering::Relaxed);
                let tokens = header.tokens.clone();
                let space = header.space;
                let starts = header.starts.iter().map(|&s| s as usize).collect();
                match write_atomically(&dir, &name, &header, &arrays) {
                    Ok(bytes) => {
                        drop(arrays);
                        let removed = {
                            let mut index = shared.index.lock().expect("index lock");
                            let removed = index.insert(IndexEntry {
                                name: name.clone(),
                                space,
                                tokens,
                                starts,
                                bytes,
                                used: now_ms(),
                            });
                            shared.publish(&index);
                            removed
                        };
                        for old in removed {
                            if let Err(e) = std::fs::remove_file(dir.join(&old)) {
                                tracing::warn!(file = %old, error = %e, "could not delete an SSD KV file");
                            }
                        }
                        let c = &shared.counters;
                        c.writes.fetch_add(1, Ordering::Relaxed);
                        c.written_bytes.fetch_add(bytes, Ordering::Relaxed);
                        if checkpoint {
                            c.checkpoints.fetch_add(1, Ordering::Relaxed);
                        }
                        tracing::debug!(file = %name, bytes, checkpoint, "SSD KV entry written");
                    }
                    Err(e) => {
                        shared.counters.write_errors.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(file = %name, error = %e, "writing an SSD KV entry failed");
                    }
                }
            }
            WriterCommand::Flush(reply) => {
                let _ = reply.send(());
            }
            WriterCommand::Close => return,
        }
    }
}

/// Writes the entry as `dir/name`, all or nothing; returns the file's size.
fn write_atomically(
    dir: &Path,
    name: &str,
    header: &Header,
    arrays: &[Array],
) -> std::io::Result<u64> {
    let temp = dir.join(format!("{TEMP_PREFIX}{name}"));
    let result = (|| {
        let mut f = std::io::BufWriter::with_capacity(1 << 20, File::create(&temp)?);
        let head = header.encode();
        f.write_all(&head)?;
        let mut crc = crc32fast::Hasher::new();
        for a in arrays {
            let bytes = tensors::bytes(a).map_err(std::io::Error::other)?;
            crc.update(bytes);
            f.write_all(bytes)?;
        }
        f.write_all(&crc.finalize().to_le_bytes())?;
        let f = f.into_inner().map_err(|e| e.into_error())?;
        f.sync_all()?;
        let len = f.metadata()?.len();
        drop(f);
        std::fs::rename(&temp, dir.join(name))?;
        File::open(dir)?.sync_all()?;
        Ok(len)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    result
}
