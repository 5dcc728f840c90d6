//! The SSD KV tier (`--ssd-cache`): prefix-cache entries and generation checkpoints written
//! behind to disk, so that a new engine process (a restart after a crash, a model reloaded
//! after the pool evicted it) restores a prefix from a memory-mapped file instead of
//! prefilling it.
//!
//! - [`format`]: the file format and every validity check (pure);
//! - [`index`]: the files held, longest-prefix lookup and the size cap (pure);
//! - [`identity`]: the model and tokenizer fingerprints an entry is written under;
//! - [`writer`]: the write-behind thread (atomic writes, deletions);
//! - [`tensors`]: MLX arrays to and from the format (on the MLX thread).
//!
//! Each model gets a directory of its own under the configured one, named by its
//! fingerprint; a file there that is corrupt, truncated or foreign (another model, tokenizer
//! or format version) is a miss, logged and deleted.
pub mod format;
pub mod identity;
pub mod index;
pub(crate) mod tensors;
mod writer;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use mlx_rs::error::Exception;

use super::{KvQuant, KvSpace, SeqKv, SeqLayer, Stored};
use format::{EntryKind, Header, Identity, Invalid, LayerDesc};
use index::{Index, IndexEntry};
use writer::{WriterCommand, TEMP_PREFIX};

/// What the SSD tier is configured with (`--ssd-cache`, `--ssd-cache-max`,
/// `--ssd-demote-idle`, `--generation-checkpoint`).
#[derive(Debug, Clone, PartialEq)]
pub struct SsdConfig {
    pub dir: PathBuf,
    /// Bytes the model's files may take; `None` is unlimited.
    pub max_bytes: Option<u64>,
    /// Prefix-cache entries unused this long leave memory (they stay on disk).
    pub demote_idle: Option<Duration>,
    /// Write a running sequence's KV every this many generated tokens.
    pub checkpoint_every: Option<usize>,
}

/// Counters of the tier since the engine started (files and bytes are current).
#[derive(Debug, Default)]
pub struct SsdCounters {
    pub files: AtomicU64,
    pub bytes: AtomicU64,
    /// Lookups answered from disk, and the prompt tokens they spared a prefill.
    pub hits: AtomicU64,
    pub restored_tokens: AtomicU64,
    pub writes: AtomicU64,
    pub written_bytes: AtomicU64,
    pub checkpoints: AtomicU64,
    /// Files found corrupt, truncated or foreign (deleted).
    pub invalid: AtomicU64,
    pub write_errors: AtomicU64,
    /// Prefix-cache entries moved out of memory for being idle.
    pub demoted: AtomicU64,
    /// Generation checkpoints not written because the writer was behind.
    pub skipped_checkpoints: AtomicU64,
}

/// What the MLX thread and the writer share.
pub(crate) struct Shared {
    index: Mutex<Index>,
    counters: Arc<SsdCounters>,
    /// Writes queued and not yet started.
    pending: AtomicU64,
}

impl Shared {
    fn publish(&self, index: &Index) {
        self.counters
            .files
            .store(index.len() as u64, Ordering::Relaxed);
        self.counters.bytes.store(index.bytes(), Ordering::Relaxed);
    }
}

/// Milliseconds since the epoch: the index's clock, comparable with file modification times.
fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Asks the writer to finish what is queued, from any thread (a `Spill` control message).
#[derive(Clone)]
pub struct SsdHandle {
    jobs: mpsc::Sender<WriterCommand>,
    shared: Arc<Shared>,
}

/// What a flush found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlushReport {
    pub files: u64,
    pub bytes: u64,
    /// False when the wait ran out with writes still queued.
    pub complete: bool,
}

impl SsdHandle {
    /// Waits (at most `timeout`) until every write queued so far is on disk.
    pub fn flush(&self, timeout: Duration) -> FlushReport {
        let (tx, rx) = mpsc::channel();
        let complete =
            self.jobs.send(WriterCommand::Flush(tx)).is_ok() && rx.recv_timeout(timeout).is_ok();
        let index = self.shared.index.lock().expect("index lock");
        FlushReport {
            files: index.len() as u64,
            bytes: index.bytes(),
            complete,
        }
    }
}

/// A prefix the tier can restore: its file, how much of `prompt` it matches, its length.
#[derive(Debug, Clone)]
pub struct SsdMatch {
    pub name: String,
    /// The file's tokens.
    pub tokens: Vec<u32>,
    pub matched: usize,
    pub entry_len: usize,
    /// Per layer, the logical position of its first held position.
    pub starts: Vec<usize>,
}

/// The tier as the cache manager (on the MLX thread) sees it.
pub struct SsdTier {
    dir: PathBuf,
    identity: Identity,
    config: SsdConfig,
    shared: Arc<Shared>,
    jobs: Option<mpsc::Sender<WriterCommand>>,
    writer: Option<thread::JoinHandle<()>>,
}

impl std::fmt::Debug for SsdTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SsdTier").field("dir", &self.dir).finish()
    }
}

/// Writes queued beyond which a generation checkpoint is skipped (each holds a copy of a
/// sequence's KV until written; prefix entries are shared with the prefix cache and always
/// queued).
const MAX_PENDING_CHECKPOINT: u64 = 8;

/// Waited for queued writes when the engine stops.
pub const STOP_FLUSH: Duration = Duration::from_secs(20);

impl SsdTier {
    /// Opens the tier for the model in `model_dir` whose KV is quantized as `kv_quant` says:
    /// its directory under `config.dir` is created if needed and scanned; leftover temporary files and invalid entries are
    /// deleted.
    pub fn open(
        config: SsdConfig,
        model_dir: &Path,
        kv_quant: Option<KvQuant>,
        counters: Arc<SsdCounters>,
    ) -> std::io::Result<Self> {
        let kv_format = kv_quant.map_or_else(
            || "plain".to_owned(),
            |q| format!("q{}g{}", q.bits, q.group_size),
        );
        let identity = identity::of_model_dir(model_dir, &kv_format)?;
        let dir = config.dir.join(&identity::hex(&identity.model)[..16]);
        std::fs::create_dir_all(&dir).map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("creating the SSD cache directory {}: {e}", dir.display()),
            )
        })?;
        let mut index = Index::new(config.max_bytes);
        let mut removed = Vec::new();
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            let Some(name) = path.file_name().and_then(|n| n.to_str()).map(str::to_owned) else {
                continue;
            };
            if name.starts_with(TEMP_PREFIX) {
                tracing::warn!(file = %path.display(), "deleting a half-written SSD KV file");
                let _ = std::fs::remove_file(&path);
                continue;
            }
            if !name.ends_with(".kv") {
                continue;
            }
            match scan(&path, &identity) {
                Ok((header, bytes, used)) => {
                    removed.extend(index.insert(IndexEntry {
                        name,
                        space: header.space,
                        tokens: header.tokens,
                        starts: header.starts.iter().map(|&s| s as usize).collect(),
                        bytes,
                        used,
                    }));
                }
                Err(e) => {
                    tracing::warn!(file = %path.display(), reason = %e, "deleting an unusable SSD KV file");
                    counters.invalid.fetch_add(1, Ordering::Relaxed);
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        for name in removed {
            let _ = std::fs::remove_file(dir.join(name));
        }
        tracing::info!(dir = %dir.display(), files = index.len(), bytes = index.bytes(), "SSD KV tier opened");
        let shared = Arc::new(Shared {
            index: Mutex::new(index),
            counters,
            pending: AtomicU64::new(0),
        });
        shared.publish(&shared.index.lock().expect("index lock"));
        let (jobs, rx) = mpsc::channel();
        let writer = {
            let (dir, shared) = (dir.clone(), shared.clone());
            thread::Builder::new()
                .name("ssd-writer".into())
                .spawn(move || writer::run(dir, shared, rx))?
        };
        Ok(Self {
            dir,
            identity,
            config,
            shared,
            jobs: Some(jobs),
            writer: Some(writer),
        })
    }

    /// The model's directory of entries.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn config(&self) -> &SsdConfig {
        &self.config
    }

    pub fn handle(&self) -> SsdHandle {
        SsdHandle {
            jobs: self.jobs.clone().expect("open until dropped"),
            shared: self.shared.clone(),
        }
    }

    pub fn counters(&self) -> &SsdCounters {
        &self.shared.counters
    }

    /// True when a file already holds `tokens` with layers starting at `starts` (or a longer
    /// sequence starting with them, whose layers start no later).
    pub fn covers(&self, space: KvSpace, tokens: &[u32], starts: &[usize]) -> bool {
        self.shared
            .index
            .lock()
            .expect("index lock")
            .covers(space, tokens, starts)
    }

    /// Queues `layers` (the base model's KV of `tokens`, every layer from position 0) for
    /// writing; returns at once. Nothing is queued when a file already covers the tokens.
    pub fn queue(
        &self,
        tokens: &[u32],
        layers: &[(Stored, Stored)],
        kind: EntryKind,
    ) -> Result<(), Exception> {
        self.queue_kv(KvSpace::BASE, tokens, &SeqKv::from(layers.to_vec()), kind)
    }

    /// Queues `kv` (the KV of `tokens` in `space`) for writing; returns at once. Nothing is
    /// queued when a file already covers it.
    pub fn queue_kv(
        &self,
        space: KvSpace,
        tokens: &[u32],
        kv: &SeqKv,
        kind: EntryKind,
    ) -> Result<(), Exception> {
        if tokens.is_empty() || self.covers(space, tokens, &kv.starts) {
            return Ok(());
        }
        let pending = self.shared.pending.load(Ordering::Relaxed);
        if matches!(kind, EntryKind::Checkpoint { .. }) && pending >= MAX_PENDING_CHECKPOINT {
            // The disk is behind: the next checkpoint supersedes this one anyway.
            self.shared
                .counters
                .skipped_checkpoints
                .fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        let tensors::Prepared {
            layers,
            arrays,
            payload_len,
        } = tensors::prepare(&kv.layers)?;
        let header = Header {
            identity: self.identity,
            space,
            kind,
            tokens: tokens.to_vec(),
            layers,
            starts: kv.starts.iter().map(|&s| s as u32).collect(),
            payload_len,
        };
        let job = WriterCommand::Write {
            name: identity::entry_name(space, tokens),
            header: Box::new(header),
            arrays,
            checkpoint: matches!(kind, EntryKind::Checkpoint { .. }),
        };
        if let Some(jobs) = &self.jobs {
            self.shared.pending.fetch_add(1, Ordering::Relaxed);
            if jobs.send(job).is_err() {
                self.shared.pending.fetch_sub(1, Ordering::Relaxed);
                tracing::warn!("the SSD writer is gone; entry not written");
            }
        }
        Ok(())
    }

    /// The base model's file sharing the longest prefix with `prompt`, the match capped at
    /// `max_match`.
    pub fn lookup(&self, prompt: &[u32], max_match: usize) -> Option<SsdMatch> {
        self.lookup_where(KvSpace::BASE, prompt, max_match, |_, _| true)
    }

    /// [`Self::lookup`] in `space`, among the files that can restore the match
    /// (`usable(starts, matched)`: a windowed entry cannot restore a prefix ending before its
    /// window's span).
    pub fn lookup_where(
        &self,
        space: KvSpace,
        prompt: &[u32],
        max_match: usize,
        usable: impl Fn(&[usize], usize) -> bool,
    ) -> Option<SsdMatch> {
        let index = self.shared.index.lock().expect("index lock");
        index
            .lookup_where(space, prompt, max_match, usable)
            .map(|(e, matched)| SsdMatch {
                name: e.name.clone(),
                tokens: e.tokens.clone(),
                matched,
                entry_len: e.tokens.len(),
                starts: e.starts.clone(),
            })
    }

    /// Reads the entry `m` found (memory-mapped, checksums verified) as MLX arrays, every
    /// layer's keys and values. An invalid file is deleted and forgotten, and the lookup
    /// becomes a miss (`Ok(None)`); only MLX failing is an error.
    pub fn restore(&self, m: &SsdMatch) -> Result<Option<Vec<(Stored, Stored)>>, Exception> {
        Ok(self.restore_kv(m)?.map(|kv| {
            kv.layers
                .into_iter()
                .filter_map(|l| match l {
                    SeqLayer::Kv(k, v) => Some((k, v)),
                    SeqLayer::State(_) => None,
                })
                .collect()
        }))
    }

    /// [`Self::restore`] with each layer's start.
    pub fn restore_kv(&self, m: &SsdMatch) -> Result<Option<SeqKv>, Exception> {
        let path = self.dir.join(&m.name);
        let read = (|| -> Result<Result<SeqKv, Exception>, RestoreError> {
            let file = std::fs::File::open(&path)?;
            // SAFETY: the tier's files are only ever replaced by rename, never written in
            // place, so the mapping's bytes do not change while it lives.
            let map = unsafe { memmap2::Mmap::map(&file)? };
            let (header, start) = format::decode_header(&map, map.len() as u64, &self.identity)?;
            let payload = format::checked_payload(&map, &header, start)?;
            let tokens = header.tokens.len() as u32;
            // A KV layer's arrays hold its positions from its start (a state has no positions).
            if header
                .layers
                .iter()
                .zip(&header.starts)
                .any(|(layer, start)| match layer {
                    LayerDesc::Kv(k, v) => k
                        .arrays
                        .iter()
                        .chain(&v.arrays)
                        .any(|a| a.shape[2] != tokens - start),
                    LayerDesc::State(_) => false,
                })
            {
                return Err(
                    Invalid::Malformed("arrays and tokens disagree in length".into()).into(),
                );
            }
            let starts = header.starts.iter().map(|&s| s as usize).collect();
            Ok(tensors::restore(&header.layers, payload).map(|layers| SeqKv::new(layers, starts)))
        })();
        match read {
            Ok(Ok(layers)) => {
                let mut index = self.shared.index.lock().expect("index lock");
                index.touch(&m.name, now_ms());
                let _ = std::fs::File::options()
                    .write(true)
                    .open(&path)
                    .and_then(|f| f.set_modified(SystemTime::now()));
                let c = &self.shared.counters;
                c.hits.fetch_add(1, Ordering::Relaxed);
                c.restored_tokens
                    .fetch_add(m.matched as u64, Ordering::Relaxed);
                Ok(Some(layers))
            }
            Ok(Err(e)) => Err(e),
            Err(RestoreError::Io(e)) => {
                tracing::warn!(file = %path.display(), error = %e, "an SSD KV file could not be read; treated as a miss");
                self.forget(&m.name, false);
                Ok(None)
            }
            Err(RestoreError::Invalid(e)) => {
                tracing::warn!(file = %path.display(), reason = %e, "deleting an unusable SSD KV file");
                self.shared.counters.invalid.fetch_add(1, Ordering::Relaxed);
                self.forget(&m.name, true);
                Ok(None)
            }
        }
    }

    fn forget(&self, name: &str, delete: bool) {
        let mut index = self.shared.index.lock().expect("index lock");
        index.remove(name);
        self.shared.publish(&index);
        if delete {
            let _ = std::fs::remove_file(self.dir.join(name));
        }
    }
}

impl Drop for SsdTier {
    /// Finishes the queued writes (bounded by [`STOP_FLUSH`]) before the engine exits, so a
    /// stopped engine leaves its prefixes on disk.
    fn drop(&mut self) {
        let pending = self.shared.pending.load(Ordering::Relaxed);
        let report = self.handle().flush(STOP_FLUSH);
        if !report.complete {
            tracing::warn!(pending, "the SSD writer did not finish its queue in time");
        }
        if let Some(jobs) = self.jobs.take() {
            let _ = jobs.send(WriterCommand::Close);
        }
        // Only a writer that finished its queue is joined (it then stops at `Close`); one
        // still writing is left to the process's exit.
        if report.complete {
            if let Some(w) = self.writer.take() {
                let _ = w.join();
            }
        }
    }
}

enum RestoreError {
    Io(std::io::Error),
    Invalid(Invalid),
}

impl From<std::io::Error> for RestoreError {
    fn from(e: std::io::Error) -> Self {
        RestoreError::Io(e)
    }
}

impl From<Invalid> for RestoreError {
    fn from(e: Invalid) -> Self {
        RestoreError::Invalid(e)
    }
}

/// Checks a file's header (not its payload: that is checked when it is restored); returns it
/// with the file's size and modification time.
fn scan(path: &Path, identity: &Identity) -> Result<(Header, u64, u64), String> {
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let meta = file.metadata().map_err(|e| e.to_string())?;
    let used = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as u64);
    if meta.len() == 0 {
        return Err(Invalid::Truncated("empty").to_string());
    }
    // SAFETY: as in `restore`: files are replaced by rename, never written in place.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| e.to_string())?;
    let (header, _) =
        format::decode_header(&map, meta.len(), identity).map_err(|e| e.to_string())?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if identity::entry_name(header.space, &header.tokens) != name {
        return Err("its name does not match its tokens".into());
    }
    Ok((header, meta.len(), used))
}
