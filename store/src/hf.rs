//! Hugging Face repos: found in, or downloaded into, the standard Hugging Face hub cache
//! (`models--{org}--{name}/{blobs,snapshots,refs}`), so that mlxd, mlx-lm and transformers
//! share one copy of each model. Downloads go through the `hf-hub` crate: each file is fetched
//! into `blobs/<etag>.part` and renamed into place when complete, so an interrupted download
//! leaves only that one file, which the next attempt resumes with an HTTP range request.
use std::fs;
use std::path::{Path, PathBuf};

use hf_hub::api::sync::{ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};

use crate::{is_model_dir, with_lock, StoreError, StoreOptions, DEFAULT_HF_REVISION};

/// A Hugging Face repo id with its revision: `org/name[@revision]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HfRepoId {
    pub org: String,
    pub name: String,
    /// A branch, tag or commit hash; [`DEFAULT_HF_REVISION`] when the spec names none.
    pub revision: String,
}

impl HfRepoId {
    /// Parses `org/name` or `org/name@revision`: `org` starts with an ASCII letter or digit,
    /// `org` and `name` hold letters, digits, `_`, `.` and `-`, and a revision may also hold
    /// `/` (as `refs/pr/1` does). Anything else is not a repo id.
    pub fn parse(spec: &str) -> Option<Self> {
        let word = |c: char| c.is_ascii_alphanumeric() || "_.-".contains(c);
        let (repo, revision) = match spec.split_once('@') {
            Some((repo, rev)) => (repo, Some(rev)),
            None => (spec, None),
        };
        let (org, name) = repo.split_once('/')?;
        let org_ok = org.starts_with(|c: char| c.is_ascii_alphanumeric()) && org.chars().all(word);
        let name_ok = !name.is_empty() && name.chars().all(word);
        let rev_ok = revision
            .map(|r| !r.is_empty() && r.chars().all(|c| word(c) || c == '/'))
            .unwrap_or(true);
        if !(org_ok && name_ok && rev_ok) {
            return None;
        }
        // `.` and `..` as a name or revision part would step outside the directories built
        // from them.
        let dots = |p: &str| p == "." || p == "..";
        if dots(name) || revision.is_some_and(|r| r.split('/').any(|p| p.is_empty() || dots(p))) {
            return None;
        }
        Some(Self {
            org: org.to_string(),
            name: name.to_string(),
            revision: revision.unwrap_or(DEFAULT_HF_REVISION).to_string(),
        })
    }

    /// `org/name`, the id the model is served under.
    pub fn repo(&self) -> String {
        format!("{}/{}", self.org, self.name)
    }

    /// The revision as one path component (`/` becomes `--`).
    pub(crate) fn revision_key(&self) -> String {
        self.revision.replace('/', "--")
    }
}

fn is_commit_hash(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

fn has_safetensors(dir: &Path) -> bool {
    fs::read_dir(dir)
        .map(|entries| {
            entries.flatten().any(|e| {
                e.file_name().to_string_lossy().ends_with(".safetensors") && e.path().is_file()
            })
        })
        .unwrap_or(false)
}

/// Whether every weight file of `dir` is there: those its `model.safetensors.index.json`
/// names, or, without an index, at least one `*.safetensors`. Downloads fetch the weights
/// last, so a snapshot cut short by an interrupted download never passes.
pub(crate) fn weights_complete(dir: &Path) -> bool {
    let index = dir.join("model.safetensors.index.json");
    if !index.exists() {
        return has_safetensors(dir);
    }
    let Ok(v) = fs::read(&index)
        .map_err(drop)
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).map_err(drop))
    else {
        return false;
    };
    let Some(map) = v.get("weight_map").and_then(|m| m.as_object()) else {
        return false;
    };
    map.values().all(|f| {
        f.as_str()
            .is_some_and(|f| !f.contains('/') && dir.join(f).is_file())
    })
}

/// A snapshot in the Hugging Face cache with config.json and safetensors weights. Pushes the
/// paths it looked at onto `looked`.
fn hf_cached(repo: &HfRepoId, cache: &Path, looked: &mut Vec<PathBuf>) -> Option<PathBuf> {
    let root = repo_root(repo, cache);
    let hash = if is_commit_hash(&repo.revision) {
        repo.revision.clone()
    } else {
        let r = root.join("refs").join(&repo.revision);
        looked.push(r.clone());
        let hash = fs::read_to_string(&r).ok()?.trim().to_string();
        // A ref must hold a commit hash, never a path.
        if !hash.bytes().all(|b| b.is_ascii_alphanumeric()) || hash.is_empty() {
            return None;
        }
        hash
    };
    let snapshot = root.join("snapshots").join(hash);
    looked.push(snapshot.clone());
    (is_model_dir(&snapshot) && weights_complete(&snapshot)).then_some(snapshot)
}

/// The snapshot of `repo` in the Hugging Face cache, downloading what is missing.
pub(crate) fn ensure_hf(repo: &HfRepoId, opts: &StoreOptions) -> Result<PathBuf, StoreError> {
    let cache = opts.hf_cache.as_ref().ok_or(StoreError::NoHfCache)?;
    let mut looked = Vec::new();
    if let Some(snapshot) = hf_cached(repo, cache, &mut looked) {
        return Ok(snapshot);
    }
    if opts.hf_offline {
        return Err(StoreError::HfNotCached {
            repo: repo.repo(),
            revision: repo.revision.clone(),
            looked,
        });
    }
    let key = format!("hf-{}--{}--{}", repo.org, repo.name, repo.revision_key());
    with_lock(&opts.home, &key, || {
        // Another process may have finished while we waited for the lock.
        if let Some(snapshot) = hf_cached(repo, cache, &mut Vec::new()) {
            return Ok(snapshot);
        }
        download_hf(repo, opts, cache)
    })
}

/// The files of a Hub repo the engine needs, by their names at the repo's top level.
fn hf_wanted(file: &str) -> bool {
    const NAMED: &[&str] = &[
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "chat_template.json",
        "model.safetensors.index.json",
    ];
    !file.contains('/')
        && !file.starts_with('.')
        && (NAMED.contains(&file) || file.ends_with(".safetensors"))
}

/// Percent-encodes every byte of `s` outside RFC 3986's unreserved set, `/` included.
fn url_component(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// The Hub's failure for `url` as a store error: 401/403 say what to do about gated repos.
fn hf_error(url: &str, e: ApiError) -> StoreError {
    let url = url.to_string();
    match e {
        ApiError::RequestError(e) => match *e {
            ureq::Error::Status(status @ (401 | 403), _) => {
                StoreError::HfUnauthorized { url, status }
            }
            ureq::Error::Status(404, _) => StoreError::HfNotFound { url },
            ureq::Error::Status(status, _) => StoreError::HttpStatus { url, status },
            ureq::Error::Transport(t) => StoreError::Network {
                url,
                message: t.to_string(),
            },
        },
        ApiError::IoError(e) => StoreError::Network {
            url,
            message: format!("{e} (the partial download is kept and resumed next time)"),
        },
        other => StoreError::HfMetadata {
            url,
            message: other.to_string(),
        },
    }
}

/// Downloads the files of `repo` the engine needs into the Hugging Face cache at `cache` and
/// returns their snapshot directory. Files already in the snapshot are not fetched again.
fn download_hf(repo: &HfRepoId, opts: &StoreOptions, cache: &Path) -> Result<PathBuf, StoreError> {
    let info_url = format!(
        "{}/api/models/{}/revision/{}",
        opts.hf_endpoint,
        repo.repo(),
        url_component(&repo.revision)
    );
    let api = ApiBuilder::from_cache(Cache::new(cache.to_path_buf()))
        .with_endpoint(opts.hf_endpoint.clone())
        .with_token(opts.hf_token.clone())
        .with_progress(false)
        .build()
        .map_err(|e| hf_error(&info_url, e))?;
    let api_repo = api.repo(Repo::with_revision(
        repo.repo(),
        RepoType::Model,
        repo.revision.clone(),
    ));
    let info = api_repo.info().map_err(|e| hf_error(&info_url, e))?;
    let sha = info.sha;
    if sha.is_empty() || !sha.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(StoreError::HfMetadata {
            url: info_url,
            message: format!("\"sha\" {sha:?} is not a commit hash"),
        });
    }
    let files: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).collect();
    let mut wanted: Vec<&String> = files.iter().filter(|f| hf_wanted(f)).collect();
    // Weights last (see `weights_complete`).
    wanted.sort_by_key(|f| f.ends_with(".safetensors"));
    if !wanted.iter().any(|f| f.ends_with(".safetensors")) {
        const SHOWN: usize = 20;
        let mut list = files
            .iter()
            .take(SHOWN)
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join(", ");
        if files.len() > SHOWN {
            list.push_str(&format!(" and {} more", files.len() - SHOWN));
        }
        return Err(StoreError::HfNoSafetensors {
            repo: repo.repo(),
            revision: repo.revision.clone(),
            files: list,
        });
    }
    if !wanted.iter().any(|f| *f == "config.json") {
        return Err(StoreError::HfMetadata {
            url: info_url,
            message: format!("{}@{sha} has no config.json", repo.repo()),
        });
    }
    let snapshot = repo_root(repo, cache).join("snapshots").join(&sha);
    for file in wanted {
        if snapshot.join(file).is_file() {
            continue;
        }
        let url = api_repo.url(file);
        let path = api_repo
            .download_with_progress(
                file,
                crate::progress::Download::new(&opts.progress, file, 0),
            )
            .map_err(|e| hf_error(&url, e))?;
        // Each file is fetched at the revision, which a push can move mid-download.
        if path.parent() != Some(snapshot.as_path()) {
            return Err(StoreError::HfMetadata {
                url,
                message: format!(
                    "{}@{} moved from commit {sha} while downloading; run again",
                    repo.repo(),
                    repo.revision
                ),
            });
        }
    }
    Ok(snapshot)
}

pub(crate) fn repo_root(repo: &HfRepoId, cache: &Path) -> PathBuf {
    cache.join(format!("models--{}--{}", repo.org, repo.name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_repo_ids() {
        let r = HfRepoId::parse("Qwen/Qwen3-0.6B").unwrap();
        assert_eq!(
            (r.org.as_str(), r.name.as_str(), r.revision.as_str()),
            ("Qwen", "Qwen3-0.6B", "main")
        );
        assert_eq!(r.repo(), "Qwen/Qwen3-0.6B");
        let r = HfRepoId::parse("mlx-community/Llama-3.2-1B-Instruct-4bit@v1.0").unwrap();
        assert_eq!(r.name, "Llama-3.2-1B-Instruct-4bit");
        assert_eq!(r.revision, "v1.0");
        let r = HfRepoId::parse("org/m_1@refs/pr/12").unwrap();
        assert_eq!(r.revision, "refs/pr/12");
        assert_eq!(r.revision_key(), "refs--pr--12");
        for bad in [
            "smollm2-135m",
            "org/",
            "/name",
            "-org/name",
            ".org/name",
            "org/name/extra",
            "org/na me",
            "org/name@",
            "org/name@a@b",
            "org/..",
            "org/name@../x",
            "org/name@a//b",
            "./model",
            "../models/x",
            "/abs/path",
        ] {
            assert_eq!(HfRepoId::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn repo_files_kept_from_a_listing() {
        for f in [
            "config.json",
            "model-00001-of-00002.safetensors",
            "model.safetensors.index.json",
            "chat_template.jinja",
            "special_tokens_map.json",
        ] {
            assert!(hf_wanted(f), "{f}");
        }
        for f in [
            "pytorch_model.bin",
            "README.md",
            ".gitattributes",
            "original/model.safetensors",
            "onnx/model.onnx",
        ] {
            assert!(!hf_wanted(f), "{f}");
        }
    }

    #[test]
    fn url_components_are_escaped() {
        assert_eq!(url_component("refs/pr/1"), "refs%2Fpr%2F1");
        assert_eq!(url_component("a b+c.safetensors"), "a%20b%2Bc.safetensors");
        assert_eq!(url_component("v1.0-rc_2~x"), "v1.0-rc_2~x");
    }
}
