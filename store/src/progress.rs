//! What the store reports while it works, for progress displays (`mlxd pull`, `mlxd serve`'s
//! start-up): bytes downloaded and conversions. Reporting is optional: [`Progress::default`]
//! reports nothing.
use std::path::PathBuf;
use std::sync::Arc;

/// One step of the store's work.
#[derive(Debug, Clone, PartialEq)]
pub enum StoreEvent {
    /// `done` bytes of `what` (a file name or URL) fetched so far, of `total` (0 if unknown).
    Download { what: String, done: u64, total: u64 },
    /// `what` is complete.
    Downloaded { what: String },
    /// Converting the GGUF at `source`.
    Converting { source: PathBuf },
    /// Done converting into `dir`.
    Converted { dir: PathBuf, seconds: f64 },
}

type Sink = dyn Fn(&StoreEvent) + Send + Sync;

/// Where [`StoreEvent`]s go.
#[derive(Clone, Default)]
pub struct Progress(Option<Arc<Sink>>);

impl Progress {
    pub fn new(sink: impl Fn(&StoreEvent) + Send + Sync + 'static) -> Self {
        Self(Some(Arc::new(sink)))
    }

    pub(crate) fn emit(&self, event: StoreEvent) {
        if let Some(sink) = &self.0 {
            sink(&event);
        }
    }
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Progress(on)"
        } else {
            "Progress(off)"
        })
    }
}

/// Options compare equal whatever their progress sink.
impl PartialEq for Progress {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl Eq for Progress {}

/// Byte counting for one download.
pub(crate) struct Download {
    progress: Progress,
    what: String,
    done: u64,
    total: u64,
}

impl Download {
    pub(crate) fn new(progress: &Progress, what: &str, total: u64) -> Self {
        Self {
            progress: progress.clone(),
            what: what.to_string(),
            done: 0,
            total,
        }
    }

    pub(crate) fn add(&mut self, n: u64) {
        self.done += n;
        self.progress.emit(StoreEvent::Download {
            what: self.what.clone(),
            done: self.done,
            total: self.total,
        });
    }

    pub(crate) fn finish(&mut self) {
        self.progress.emit(StoreEvent::Downloaded {
            what: self.what.clone(),
        });
    }
}

impl hf_hub::api::Progress for Download {
    fn init(&mut self, size: usize, filename: &str) {
        self.what = filename.to_string();
        self.total = size as u64;
        self.done = 0;
    }

    fn update(&mut self, size: usize) {
        self.add(size as u64);
    }

    fn finish(&mut self) {
        Download::finish(self);
    }
}
