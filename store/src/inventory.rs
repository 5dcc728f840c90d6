//! What the store holds (`mlxd ls`, and the models a server serves by name without a config
//! entry) and removing it (`mlxd rm`): the known models, the models jobs built (quantized,
//! fused, converted) and the GGUF conversions under `<home>/models/`, and the complete model
//! snapshots in the Hugging Face cache.
use std::fs;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::convert::STAMP_FILE;
use crate::hf::{repo_root, weights_complete, HfRepoId};
use crate::{io, is_model_dir, with_lock, StoreError, StoreOptions, KNOWN_MODELS};

/// Where a stored model lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoredKind {
    /// A known name, under `<home>/models/<name>`.
    Known,
    /// Any other model directory under `<home>/models/<name>`: the output of a job
    /// (`mlxd quantize`, a fuse or a conversion) or a directory put there by hand.
    Local,
    /// A GGUF file converted under `<home>/models/gguf/<key>`; the GGUF it came from, if the
    /// directory records it.
    Gguf { source: Option<PathBuf> },
    /// A snapshot in the Hugging Face cache.
    HuggingFace,
}

/// One model on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredModel {
    /// The name to give `mlxd rm` (and, but for GGUF conversions, `--model`).
    pub name: String,
    pub kind: StoredKind,
    /// `mlx 4-bit`, `bfloat16`, …, from config.json.
    pub format: String,
    /// Bytes of the files (symlinks followed, so a Hugging Face snapshot counts its blobs).
    pub size_bytes: u64,
    pub dir: PathBuf,
}

/// The weights' format from a model's config.json: MLX quantization bits, else the dtype.
pub fn format_of(dir: &Path) -> String {
    let Ok(v) = fs::read(dir.join("config.json"))
        .map_err(drop)
        .and_then(|b| serde_json::from_slice::<Value>(&b).map_err(drop))
    else {
        return "unreadable config.json".into();
    };
    let q = v
        .get("quantization")
        .or_else(|| v.get("quantization_config"));
    if let Some(bits) = q.and_then(|q| q.get("bits")).and_then(Value::as_u64) {
        return format!("mlx {bits}-bit");
    }
    v.get("torch_dtype")
        .or_else(|| v.get("dtype"))
        .and_then(Value::as_str)
        .unwrap_or("unknown dtype")
        .to_string()
}

/// What a model directory lacks to be served, as one phrase (`no weights (*.safetensors)
/// and no tokenizer.json`), or `None` when it has a `config.json`, weights and a tokenizer.
/// `mlxd pull <dir>` says this instead of calling a directory with only a `config.json`
/// ready.
pub fn incomplete(dir: &Path) -> Option<String> {
    let has_weights = fs::read_dir(dir).into_iter().flatten().flatten().any(|e| {
        e.file_name()
            .to_str()
            .is_some_and(|n| n.ends_with(".safetensors"))
    });
    let mut missing = Vec::new();
    if !dir.join("config.json").is_file() {
        missing.push("no config.json");
    }
    if !has_weights {
        missing.push("no weights (*.safetensors)");
    }
    if !dir.join("tokenizer.json").is_file() {
        missing.push("no tokenizer.json");
    }
    (!missing.is_empty()).then(|| missing.join(" and "))
}

/// Bytes that removing `path` frees: regular files under it, each inode once, symlinks not
/// followed. A store entry that is a symlink frees nothing of its target (`remove_dir_all`
/// removes the link), and a Hugging Face snapshot's links to the repo's blobs count nothing
/// beside the blobs themselves.
pub(crate) fn freed_size(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut seen = std::collections::HashSet::new();
    let mut total = 0;
    let mut stack = vec![path.to_path_buf()];
    while let Some(p) = stack.pop() {
        let Ok(m) = fs::symlink_metadata(&p) else {
            continue;
        };
        if m.is_dir() {
            stack.extend(
                fs::read_dir(&p)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| e.path()),
            );
        } else if m.is_file() && seen.insert((m.dev(), m.ino())) {
            total += m.len();
        }
    }
    total
}

/// Bytes of the files under `dir`, symlinks followed.
pub(crate) fn dir_size(dir: &Path) -> u64 {
    fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| {
            let p = e.path();
            match fs::metadata(&p) {
                Ok(m) if m.is_dir() => dir_size(&p),
                Ok(m) => m.len(),
                Err(_) => 0,
            }
        })
        .sum()
}

fn sorted_dirs(dir: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.is_dir()
                && !p
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        })
        .collect();
    dirs.sort();
    dirs
}

fn gguf_source(dir: &Path) -> Option<PathBuf> {
    let v: Value = serde_json::from_slice(&fs::read(dir.join(STAMP_FILE)).ok()?).ok()?;
    v.get("source")?.as_str().map(PathBuf::from)
}

fn entry(name: String, kind: StoredKind, dir: PathBuf) -> StoredModel {
    StoredModel {
        name,
        kind,
        format: format_of(&dir),
        size_bytes: dir_size(&dir),
        dir,
    }
}

/// A model the store holds, found without reading its files: its name, kind and directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// The name `mlxd ls` shows and a server serves it under.
    pub name: String,
    pub kind: StoredKind,
    pub dir: PathBuf,
}

impl Found {
    /// What an engine is asked to load for it (`Launch.model`): a known name or a Hugging
    /// Face repo id as such (the engine's store checks and, if need be, refreshes them), any
    /// other model by its directory.
    pub fn spec(&self) -> String {
        match self.kind {
            StoredKind::Known | StoredKind::HuggingFace => self.name.clone(),
            StoredKind::Local | StoredKind::Gguf { .. } => self.dir.display().to_string(),
        }
    }
}

/// Every complete model in the store and the Hugging Face cache, known names first, then the
/// other directories of `<home>/models/`, the GGUF conversions and the Hugging Face snapshots;
/// each name once (the first wins). Cheap: reads directory listings and refs, no weights.
pub fn scan(opts: &StoreOptions) -> Vec<Found> {
    let models = opts.home.join("models");
    let mut out = Vec::new();
    let store_dirs = sorted_dirs(&models);
    for dir in &store_dirs {
        let name = dir.file_name().unwrap_or_default().to_string_lossy();
        if KNOWN_MODELS.iter().any(|k| k.name == name) && is_model_dir(dir) {
            out.push(Found {
                name: name.into_owned(),
                kind: StoredKind::Known,
                dir: dir.clone(),
            });
        }
    }
    for dir in &store_dirs {
        let name = dir.file_name().unwrap_or_default().to_string_lossy();
        if !KNOWN_MODELS.iter().any(|k| k.name == name) && is_model_dir(dir) {
            out.push(Found {
                name: name.into_owned(),
                kind: StoredKind::Local,
                dir: dir.clone(),
            });
        }
    }
    for dir in sorted_dirs(&models.join("gguf")) {
        if is_model_dir(&dir) {
            let name = dir.file_name().unwrap_or_default().to_string_lossy();
            let source = gguf_source(&dir);
            out.push(Found {
                name: name.into_owned(),
                kind: StoredKind::Gguf { source },
                dir,
            });
        }
    }
    if let Some(cache) = &opts.hf_cache {
        for repo in sorted_dirs(cache) {
            let folder = repo.file_name().unwrap_or_default().to_string_lossy();
            let Some(id) = folder.strip_prefix("models--") else {
                continue;
            };
            let Some((org, name)) = id.split_once("--") else {
                continue;
            };
            for snapshot in sorted_dirs(&repo.join("snapshots")) {
                if !(is_model_dir(&snapshot) && weights_complete(&snapshot)) {
                    continue;
                }
                let hash = snapshot.file_name().unwrap_or_default().to_string_lossy();
                let refs = refs_to(&repo, &hash);
                let name = match refs.iter().any(|r| r == "main") {
                    true => format!("{org}/{name}"),
                    false => match refs.first() {
                        Some(r) => format!("{org}/{name}@{r}"),
                        None => format!("{org}/{name}@{hash}"),
                    },
                };
                out.push(Found {
                    name,
                    kind: StoredKind::HuggingFace,
                    dir: snapshot,
                });
            }
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    out.retain(|f| seen.insert(f.name.clone()));
    out
}

/// Every complete model in the store and the Hugging Face cache, in [`scan`]'s order, with
/// its format and size.
pub fn list(opts: &StoreOptions) -> Vec<StoredModel> {
    scan(opts)
        .into_iter()
        .map(|f| entry(f.name, f.kind, f.dir))
        .collect()
}

/// The stored model listed as `name`, if any.
pub fn find(name: &str, opts: &StoreOptions) -> Option<Found> {
    scan(opts).into_iter().find(|f| f.name == name)
}

/// The refs of a Hugging Face cache repo that point at commit `hash` (`main`, `v1.0`, …).
fn refs_to(repo: &Path, hash: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![(repo.join("refs"), String::new())];
    while let Some((dir, prefix)) = stack.pop() {
        for e in fs::read_dir(&dir).into_iter().flatten().flatten() {
            let name = format!("{prefix}{}", e.file_name().to_string_lossy());
            if e.path().is_dir() {
                stack.push((e.path(), format!("{name}/")));
            } else if fs::read_to_string(e.path()).is_ok_and(|h| h.trim() == hash) {
                out.push(name);
            }
        }
    }
    out.sort();
    out
}

/// What `remove` deleted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Removed {
    pub dirs: Vec<PathBuf>,
    /// Bytes freed on disk ([`freed_size`]): a symlinked entry's target is not counted.
    pub bytes: u64,
}

/// A name that is one directory leaf: no separator, not `.` or `..`, not hidden.
pub fn is_plain_name(name: &str) -> bool {
    !name.is_empty() && !name.starts_with('.') && !name.contains(['/', '\\'])
}

/// Removes `spec` from disk: a known name's directory; a model a job built, by its name; a
/// GGUF conversion by its listed name,
/// or every conversion of a GGUF file given by path; a Hugging Face repo id's whole cache
/// entry (`models--{org}--{name}`, every revision, since revisions share blobs). Each removal
/// holds the model's lock, so it never races a conversion or download of the same model.
pub fn remove(spec: &str, opts: &StoreOptions) -> Result<Removed, StoreError> {
    let models = opts.home.join("models");
    let mut targets: Vec<(String, PathBuf)> = Vec::new();
    if KNOWN_MODELS.iter().any(|k| k.name == spec) {
        targets.push((spec.to_string(), models.join(spec)));
    } else if let Some(repo) = HfRepoId::parse(spec) {
        if let Some(cache) = &opts.hf_cache {
            let key = format!("hf-{}--{}--{}", repo.org, repo.name, repo.revision_key());
            targets.push((key, repo_root(&repo, cache)));
        }
    } else {
        let by_name = models.join("gguf").join(spec);
        let local = models.join(spec);
        if is_plain_name(spec) && is_model_dir(&local) {
            targets.push((format!("local-{spec}"), local));
        } else if is_plain_name(spec) && is_model_dir(&by_name) {
            targets.push((format!("gguf-{spec}"), by_name));
        } else if let Ok(path) = fs::canonicalize(spec) {
            for dir in sorted_dirs(&models.join("gguf")) {
                if gguf_source(&dir).as_deref() == Some(path.as_path()) {
                    let key = dir.file_name().unwrap_or_default().to_string_lossy();
                    targets.push((format!("gguf-{key}"), dir));
                }
            }
        }
    }
    targets.retain(|(_, d)| d.exists());
    if targets.is_empty() {
        return Err(StoreError::NotStored(spec.to_string()));
    }
    let mut removed = Removed {
        dirs: Vec::new(),
        bytes: 0,
    };
    for (key, dir) in targets {
        with_lock(&opts.home, &key, || {
            let bytes = freed_size(&dir);
            fs::remove_dir_all(&dir).map_err(io(&dir))?;
            removed.bytes += bytes;
            removed.dirs.push(dir.clone());
            Ok(())
        })?;
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{resolve_model_with, DEFAULT_MODEL};

    #[test]
    fn lists_and_removes_what_the_store_holds() {
        let tmp = tempfile::tempdir().unwrap();
        let gguf = tmp.path().join("tiny.gguf");
        crate::convert::tests::tiny_llama(true, None).write(&gguf);
        let cache = tmp.path().join("hub");
        let opts = StoreOptions {
            smollm2_gguf: Some(gguf.clone()),
            hf_cache: Some(cache.clone()),
            hf_offline: true,
            ..crate::tests::opts(&tmp.path().join("home"))
        };
        assert!(list(&opts).is_empty());
        resolve_model_with(DEFAULT_MODEL, &opts).unwrap();
        let converted = resolve_model_with(gguf.to_str().unwrap(), &opts).unwrap();
        // A Hugging Face snapshot at `main`, one at a tag only, and an incomplete one.
        let sha = "a".repeat(40);
        let repo = cache.join("models--org--m");
        for (hash, weights) in [(sha.as_str(), true), ("b0", true), ("c0", false)] {
            let snap = repo.join("snapshots").join(hash);
            fs::create_dir_all(&snap).unwrap();
            fs::write(snap.join("config.json"), br#"{"torch_dtype": "bfloat16"}"#).unwrap();
            if weights {
                fs::write(snap.join("model.safetensors"), vec![0u8; 1000]).unwrap();
            }
        }
        fs::create_dir_all(repo.join("refs")).unwrap();
        fs::write(repo.join("refs/main"), &sha).unwrap();
        fs::write(repo.join("refs/v1"), "b0\n").unwrap();
        // What a quantize job leaves under `<home>/models/`, and its staging directory.
        let q8 = opts.home.join("models/smol-q8");
        fs::create_dir_all(&q8).unwrap();
        fs::write(q8.join("config.json"), br#"{"quantization": {"bits": 8}}"#).unwrap();
        let staging = opts.home.join("models/.smol-q4.mlxd-job-1-job-1");
        fs::create_dir_all(&staging).unwrap();
        fs::write(staging.join("config.json"), "{}").unwrap();

        let listed = list(&opts);
        let rows: Vec<(&str, &str)> = listed
            .iter()
            .map(|m| (m.name.as_str(), m.format.as_str()))
            .collect();
        let key = converted
            .dir
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        assert_eq!(
            rows,
            [
                (DEFAULT_MODEL, "mlx 4-bit"),
                ("smol-q8", "mlx 8-bit"),
                (key.as_str(), "mlx 4-bit"),
                ("org/m", "bfloat16"),
                ("org/m@v1", "bfloat16"),
            ]
        );
        assert_eq!(listed[0].kind, StoredKind::Known);
        assert_eq!(listed[1].kind, StoredKind::Local);
        let found = find("smol-q8", &opts).unwrap();
        assert_eq!(
            (found.dir.as_path(), found.spec()),
            (q8.as_path(), q8.display().to_string())
        );
        assert_eq!(find(DEFAULT_MODEL, &opts).unwrap().spec(), DEFAULT_MODEL);
        assert_eq!(find("org/m@v1", &opts).unwrap().spec(), "org/m@v1");
        assert!(find("smol-q4", &opts).is_none());
        assert!(find("nothing", &opts).is_none());
        assert_eq!(
            listed[2].kind,
            StoredKind::Gguf {
                source: Some(fs::canonicalize(&gguf).unwrap())
            }
        );
        assert!(listed[2].size_bytes > 1000);
        assert!(listed[3].size_bytes >= 1000);

        // A GGUF conversion is removed by the GGUF's path; the rest by their names.
        let r = remove(gguf.to_str().unwrap(), &opts).unwrap();
        assert_eq!(r.dirs, std::slice::from_ref(&converted.dir));
        assert!(r.bytes > 0);
        remove(DEFAULT_MODEL, &opts).unwrap();
        assert_eq!(
            remove("smol-q8", &opts).unwrap().dirs,
            std::slice::from_ref(&q8)
        );
        assert!(!q8.exists());
        remove("org/m", &opts).unwrap();
        assert!(!repo.exists());
        assert!(list(&opts).is_empty());
        let e = remove("org/m", &opts).unwrap_err();
        assert!(matches!(e, StoreError::NotStored(_)), "{e}");
        assert!(e.to_string().contains("mlxd ls"), "{e}");
        assert!(remove("nothing-here", &opts).is_err());
    }

    /// Issue 23, finding 12: `mlxd rm` of an entry that is a symlink reported its target's
    /// size as freed (the link goes, the target stays), and a Hugging Face repo counted each
    /// blob again for every snapshot linking to it.
    #[test]
    fn removal_reports_what_it_frees() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = tmp.path().join("hub");
        let opts = StoreOptions {
            hf_cache: Some(cache.clone()),
            hf_offline: true,
            ..crate::tests::opts(&tmp.path().join("home"))
        };
        let elsewhere = tmp.path().join("elsewhere");
        fs::create_dir_all(&elsewhere).unwrap();
        fs::write(elsewhere.join("config.json"), "{}").unwrap();
        fs::write(elsewhere.join("model.safetensors"), vec![0u8; 5000]).unwrap();
        fs::create_dir_all(opts.home.join("models")).unwrap();
        let link = opts.home.join("models/linked");
        std::os::unix::fs::symlink(&elsewhere, &link).unwrap();
        let r = remove("linked", &opts).unwrap();
        assert_eq!(r.dirs, std::slice::from_ref(&link));
        assert_eq!(r.bytes, 0, "the target stays: {r:?}");
        assert!(!link.exists() && elsewhere.join("model.safetensors").exists());

        // One 3000-byte blob, linked from two snapshots.
        let repo = cache.join("models--org--m");
        fs::create_dir_all(repo.join("blobs")).unwrap();
        fs::write(repo.join("blobs/abc"), vec![0u8; 3000]).unwrap();
        fs::write(repo.join("blobs/cfg"), "{}").unwrap();
        for snap in ["s1", "s2"] {
            let d = repo.join("snapshots").join(snap);
            fs::create_dir_all(&d).unwrap();
            std::os::unix::fs::symlink(repo.join("blobs/abc"), d.join("model.safetensors"))
                .unwrap();
            std::os::unix::fs::symlink(repo.join("blobs/cfg"), d.join("config.json")).unwrap();
        }
        fs::create_dir_all(repo.join("refs")).unwrap();
        fs::write(repo.join("refs/main"), "s1").unwrap();
        // The blobs and the ref, each once (following the links would count 9010).
        assert_eq!(remove("org/m", &opts).unwrap().bytes, 3000 + 2 + 2);
    }

    /// Issue 23, finding 12: `mlxd pull` called a directory holding only `config.json`
    /// ready; what it lacks is named.
    #[test]
    fn an_incomplete_directory_says_what_it_lacks() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        fs::write(d.join("config.json"), "{}").unwrap();
        assert_eq!(
            incomplete(d).as_deref(),
            Some("no weights (*.safetensors) and no tokenizer.json")
        );
        fs::write(d.join("model-00001-of-00002.safetensors"), b"x").unwrap();
        assert_eq!(incomplete(d).as_deref(), Some("no tokenizer.json"));
        fs::write(d.join("tokenizer.json"), "{}").unwrap();
        assert_eq!(incomplete(d), None);
        fs::remove_file(d.join("config.json")).unwrap();
        assert_eq!(incomplete(d).as_deref(), Some("no config.json"));
    }
}
