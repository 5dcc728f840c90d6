//! `POST /v1/jobs` bodies: checked field by field (a bad one is a 400 naming it) and resolved
//! into the paths the job process gets, with the memory the job is counted for.
use std::path::{Path, PathBuf};

use mlxd_protocol::jobs::{
    JobRequest, JobSpec, TrainParams, BITS, DEFAULT_BITS, DEFAULT_GROUP_SIZE, GROUP_SIZES,
};
use serde_json::{Map, Value};

use super::admission::{self, CheckpointSize};
use crate::catalog::Catalog;
use crate::error::ProxyError;

/// A job ready to be queued: what was asked (defaults filled in), what the job process will
/// do, and the memory it is counted for.
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedJob {
    pub request: JobRequest,
    pub work: Work,
    pub memory_bytes: u64,
}

/// What the job process is asked to do, before the job has an id.
#[derive(Debug, Clone, PartialEq)]
pub enum Work {
    Quantize {
        source: PathBuf,
        bits: u32,
        group_size: u32,
        out: PathBuf,
    },
    Convert {
        gguf: PathBuf,
        out: PathBuf,
    },
    Fetch {
        model: String,
        home: PathBuf,
    },
    Fuse {
        source: PathBuf,
        adapter: PathBuf,
        out: PathBuf,
    },
    Lora {
        source: PathBuf,
        data: PathBuf,
        params: TrainParams,
        resume: bool,
        init_adapter: Option<PathBuf>,
        out: PathBuf,
    },
}

/// A LoRA run's checkpoints, beside its output (`.<leaf>.checkpoints`): kept after a cancel or
/// a crash so that a request with `resume` continues from them.
pub fn checkpoints_of(out: &Path) -> PathBuf {
    let leaf = out
        .file_name()
        .map(|l| l.to_string_lossy().into_owned())
        .unwrap_or_default();
    out.with_file_name(format!(".{leaf}.checkpoints"))
}

/// Marks a job's staging directory, beside its output (same filesystem, so the final rename is
/// atomic): `.<out leaf>.mlxd-job-<mlxd pid>-<id>`. The pid tells a later `mlxd` whether the
/// directory's owner is gone (`jobs::sweep_staging`).
pub const STAGING_MARK: &str = ".mlxd-job-";

impl Work {
    /// The directory the job builds its output in, removed unless the job succeeds.
    pub fn staging(&self, id: &str) -> Option<PathBuf> {
        let out = match self {
            Self::Quantize { out, .. }
            | Self::Convert { out, .. }
            | Self::Lora { out, .. }
            | Self::Fuse { out, .. } => out,
            Self::Fetch { .. } => return None,
        };
        let leaf = out.file_name()?.to_string_lossy();
        Some(out.with_file_name(format!(".{leaf}{STAGING_MARK}{}-{id}", std::process::id())))
    }

    pub fn spec(&self, id: &str) -> JobSpec {
        let staging = self.staging(id).unwrap_or_default();
        match self.clone() {
            Self::Quantize {
                source,
                bits,
                group_size,
                out,
            } => JobSpec::Quantize {
                source,
                bits,
                group_size,
                staging,
                out,
            },
            Self::Convert { gguf, out } => JobSpec::Convert { gguf, staging, out },
            Self::Fetch { model, home } => JobSpec::Fetch { model, home },
            Self::Fuse {
                source,
                adapter,
                out,
            } => JobSpec::Fuse {
                source,
                adapter,
                staging,
                out,
            },
            Self::Lora {
                source,
                data,
                params,
                resume,
                init_adapter,
                out,
            } => JobSpec::Lora {
                source,
                data,
                params: Box::new(params),
                checkpoints: checkpoints_of(&out),
                resume,
                init_adapter,
                staging,
                out,
            },
        }
    }
}

fn bad(field: &'static str, message: impl Into<String>) -> ProxyError {
    ProxyError::InvalidField {
        field,
        message: message.into(),
    }
}

fn string_field(
    obj: &Map<String, Value>,
    field: &'static str,
) -> Result<Option<String>, ProxyError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.trim().is_empty() => Err(bad(field, "must not be empty")),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(bad(field, format!("must be a string, got {other}"))),
    }
}

fn choice_field(
    obj: &Map<String, Value>,
    field: &'static str,
    allowed: &[u32],
    default: u32,
) -> Result<u32, ProxyError> {
    let list = || {
        allowed
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    match obj.get(field) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Number(n)) => n
            .as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .filter(|v| allowed.contains(v))
            .ok_or_else(|| bad(field, format!("must be one of {}, got {n}", list()))),
        Some(other) => Err(bad(
            field,
            format!("must be one of {}, got {other}", list()),
        )),
    }
}

/// `out`: an absolute path, or a plain name for `<home>/models/<name>` (a model in the store,
/// served by that name), else `default`.
fn out_field(
    obj: &Map<String, Value>,
    home: &Path,
    default: PathBuf,
) -> Result<PathBuf, ProxyError> {
    let out = match string_field(obj, "out")? {
        Some(o) if mlxd_store::inventory::is_plain_name(&o) => home.join("models").join(o),
        Some(o) => {
            let p = PathBuf::from(&o);
            if !p.is_absolute() {
                return Err(bad(
                    "out",
                    format!("must be a name (a model in the store) or an absolute path (the server's working directory is not yours), got {o:?}"),
                ));
            }
            if p.file_name().is_none() {
                return Err(bad("out", format!("{o:?} names no directory")));
            }
            p
        }
        None => default,
    };
    if out.exists() {
        return Err(bad(
            "out",
            format!(
                "{} already exists; a job never overwrites a model directory",
                out.display()
            ),
        ));
    }
    Ok(out)
}

fn reject_unknown(obj: &Map<String, Value>, known: &[&str]) -> Result<(), ProxyError> {
    match obj.keys().find(|k| !known.contains(&k.as_str())) {
        None => Ok(()),
        Some(k) => Err(ProxyError::BadRequest(format!(
            "unknown field {k:?}; this job kind takes {}",
            known.join(", ")
        ))),
    }
}

/// A name usable as a directory's leaf: `org/name` becomes `org--name`.
fn leaf_name(id: &str) -> String {
    id.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '-'
            }
        })
        .collect::<String>()
        .replace('/', "--")
}

/// Parses and resolves a `POST /v1/jobs` body against the catalog and the store at `home`.
/// Reads the filesystem (does the model exist, how large are its weights) but starts nothing.
pub fn prepare(body: &[u8], catalog: &Catalog, home: &Path) -> Result<PreparedJob, ProxyError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ProxyError::BadRequest(format!("request body is not valid JSON: {e}")))?;
    let Value::Object(obj) = &v else {
        return Err(ProxyError::BadRequest(
            "request body must be a JSON object".into(),
        ));
    };
    let kind = string_field(obj, "kind")?.ok_or_else(|| {
        bad(
            "kind",
            "is required: quantize, convert, fetch, lora or fuse",
        )
    })?;
    match kind.as_str() {
        "quantize" => prepare_quantize(obj, catalog, home),
        "convert" => prepare_convert(obj, home),
        "fetch" => prepare_fetch(obj, home),
        "lora" => prepare_lora(obj, catalog, home),
        "fuse" => prepare_fuse(obj, catalog, home),
        other => Err(bad(
            "kind",
            format!("must be quantize, convert, fetch, lora or fuse, got {other:?}"),
        )),
    }
}

fn prepare_quantize(
    obj: &Map<String, Value>,
    catalog: &Catalog,
    home: &Path,
) -> Result<PreparedJob, ProxyError> {
    reject_unknown(obj, &["kind", "model", "bits", "group_size", "out"])?;
    let model = string_field(obj, "model")?.ok_or_else(|| {
        bad(
            "model",
            "is required: a model directory, a configured model id, a model in the store or a Hugging Face repo in the cache",
        )
    })?;
    let bits = choice_field(obj, "bits", BITS, DEFAULT_BITS)?;
    let group_size = choice_field(obj, "group_size", GROUP_SIZES, DEFAULT_GROUP_SIZE)?;
    let (id, source) = model_dir(&model, catalog, home)?;
    let size: CheckpointSize =
        admission::checkpoint_size(&source).map_err(|e| bad("model", e.to_string()))?;
    let default_out = home
        .join("models")
        .join(format!("{}-{bits}bit-g{group_size}", leaf_name(&id)));
    let out = out_field(obj, home, default_out)?;
    Ok(PreparedJob {
        request: JobRequest::Quantize {
            model,
            bits: Some(bits),
            group_size: Some(group_size),
            out: Some(out.display().to_string()),
        },
        memory_bytes: admission::quantize_peak_bytes(size, bits),
        work: Work::Quantize {
            source,
            bits,
            group_size,
            out,
        },
    })
}

/// The model directory behind `model`, without downloading or converting anything.
fn model_dir(model: &str, catalog: &Catalog, home: &Path) -> Result<(String, PathBuf), ProxyError> {
    let spec = match catalog.resolve(Some(model)) {
        Ok(entry) if !Path::new(model).is_dir() => entry.source.clone(),
        _ => model.to_string(),
    };
    let path = Path::new(&spec);
    if path.is_dir() {
        if !path.join("config.json").is_file() {
            return Err(bad(
                "model",
                format!(
                    "{} has no config.json, so it is not a model directory",
                    path.display()
                ),
            ));
        }
        let dir = std::fs::canonicalize(path).map_err(|e| bad("model", format!("{spec}: {e}")))?;
        return Ok((mlxd_store::served_id(&spec), dir));
    }
    if path.is_file() {
        return Err(bad(
            "model",
            format!("{spec} is a file; quantize takes a model directory (convert a GGUF first with kind \"convert\")"),
        ));
    }
    if mlxd_store::KNOWN_MODELS.iter().any(|k| k.name == spec) {
        let dir = home.join("models").join(&spec);
        if !dir.join("config.json").is_file() {
            return Err(bad(
                "model",
                format!(
                    "{spec} is not in the store at {} yet; fetch it first (kind \"fetch\")",
                    home.display()
                ),
            ));
        }
        return Ok((spec, dir));
    }
    if mlxd_store::HfRepoId::parse(&spec).is_some() {
        let mut opts = mlxd_store::StoreOptions::from_env(home);
        opts.hf_offline = true;
        return match mlxd_store::resolve_model_with(&spec, &opts) {
            Ok(resolved) => Ok((resolved.id, resolved.dir)),
            Err(e) => Err(bad(
                "model",
                format!("{e}; fetch it first (kind \"fetch\")"),
            )),
        };
    }
    Err(bad(
        "model",
        format!(
            "{spec:?} is not a model directory, a configured model ({}), a model in the store or a Hugging Face repo id",
            catalog.ids().join(", ")
        ),
    ))
}

fn prepare_convert(obj: &Map<String, Value>, home: &Path) -> Result<PreparedJob, ProxyError> {
    reject_unknown(obj, &["kind", "gguf", "out"])?;
    let gguf = string_field(obj, "gguf")?
        .ok_or_else(|| bad("gguf", "is required: the path of a .gguf file"))?;
    let path = PathBuf::from(&gguf);
    if !path.is_absolute() {
        return Err(bad(
            "gguf",
            format!("must be an absolute path, got {gguf:?}"),
        ));
    }
    if path.extension().is_none_or(|e| e != "gguf") {
        return Err(bad("gguf", format!("{gguf} is not a .gguf file")));
    }
    let meta = std::fs::metadata(&path).map_err(|e| bad("gguf", format!("{gguf}: {e}")))?;
    if !meta.is_file() {
        return Err(bad("gguf", format!("{gguf} is not a file")));
    }
    let stem = path
        .file_stem()
        .map(|s| leaf_name(&s.to_string_lossy()))
        .unwrap_or_else(|| "model".into());
    let out = out_field(obj, home, home.join("models").join(stem))?;
    Ok(PreparedJob {
        request: JobRequest::Convert {
            gguf,
            out: Some(out.display().to_string()),
        },
        memory_bytes: admission::convert_peak_bytes(meta.len()),
        work: Work::Convert { gguf: path, out },
    })
}

fn prepare_fetch(obj: &Map<String, Value>, home: &Path) -> Result<PreparedJob, ProxyError> {
    reject_unknown(obj, &["kind", "model"])?;
    let model =
        string_field(obj, "model")?.unwrap_or_else(|| mlxd_store::DEFAULT_MODEL.to_string());
    let known = mlxd_store::KNOWN_MODELS.iter().any(|k| k.name == model);
    if !known && mlxd_store::HfRepoId::parse(&model).is_none() {
        return Err(bad(
            "model",
            format!(
                "{model:?} is neither a known model ({}) nor a Hugging Face repo id (org/name[@revision])",
                mlxd_store::KNOWN_MODELS
                    .iter()
                    .map(|k| k.name)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    }
    Ok(PreparedJob {
        request: JobRequest::Fetch {
            model: Some(model.clone()),
        },
        memory_bytes: admission::FETCH_PEAK_BYTES,
        work: Work::Fetch {
            model,
            home: home.to_path_buf(),
        },
    })
}

fn prepare_fuse(
    obj: &Map<String, Value>,
    catalog: &Catalog,
    home: &Path,
) -> Result<PreparedJob, ProxyError> {
    reject_unknown(obj, &["kind", "model", "adapter", "out"])?;
    let model = string_field(obj, "model")?.ok_or_else(|| {
        bad(
            "model",
            "is required: the base model (a model directory, a configured model id, a model in the store or a Hugging Face repo in the cache)",
        )
    })?;
    let adapter_spec = string_field(obj, "adapter")?.ok_or_else(|| {
        bad(
            "adapter",
            "is required: an adapter in the store (<home>/adapters/<name>) or an absolute path",
        )
    })?;
    let adapter = if mlxd_store::inventory::is_plain_name(&adapter_spec) {
        home.join("adapters").join(&adapter_spec)
    } else if Path::new(&adapter_spec).is_absolute() {
        PathBuf::from(&adapter_spec)
    } else {
        return Err(bad(
            "adapter",
            format!("must be a name (an adapter in the store) or an absolute path, got {adapter_spec:?}"),
        ));
    };
    if !adapter.join("adapter_config.json").is_file()
        || !adapter.join("adapters.safetensors").is_file()
    {
        return Err(bad(
            "adapter",
            format!(
                "{} is not an adapter directory (adapter_config.json and adapters.safetensors)",
                adapter.display()
            ),
        ));
    }
    let (id, source) = model_dir(&model, catalog, home)?;
    let size: CheckpointSize =
        admission::checkpoint_size(&source).map_err(|e| bad("model", e.to_string()))?;
    let adapter_leaf = adapter
        .file_name()
        .map(|l| leaf_name(&l.to_string_lossy()))
        .unwrap_or_else(|| "adapter".into());
    let default_out = home
        .join("models")
        .join(format!("{}-{adapter_leaf}", leaf_name(&id)));
    let out = out_field(obj, home, default_out)?;
    Ok(PreparedJob {
        request: JobRequest::Fuse {
            model,
            adapter: adapter.display().to_string(),
            out: Some(out.display().to_string()),
        },
        memory_bytes: admission::fuse_peak_bytes(size),
        work: Work::Fuse {
            source,
            adapter,
            out,
        },
    })
}

/// The fields of a `lora` request besides [`TrainParams`]'.
const LORA_FIELDS: &[&str] = &["kind", "model", "data", "out", "resume", "init_adapter"];

fn absolute_path(
    obj: &Map<String, Value>,
    field: &'static str,
) -> Result<Option<PathBuf>, ProxyError> {
    let Some(s) = string_field(obj, field)? else {
        return Ok(None);
    };
    let p = PathBuf::from(&s);
    if !p.is_absolute() {
        return Err(bad(
            field,
            format!(
                "must be an absolute path (the server's working directory is not yours), got {s:?}"
            ),
        ));
    }
    if !p.exists() {
        return Err(bad(field, format!("{s}: no such file or directory")));
    }
    Ok(Some(p))
}

fn prepare_lora(
    obj: &Map<String, Value>,
    catalog: &Catalog,
    home: &Path,
) -> Result<PreparedJob, ProxyError> {
    // The hyperparameters are TrainParams' fields; anything else is unknown.
    let mut params_obj = obj.clone();
    for f in LORA_FIELDS {
        params_obj.remove(*f);
    }
    let params: TrainParams = serde_json::from_value(Value::Object(params_obj))
        .map_err(|e| ProxyError::BadRequest(format!("lora job: {e}")))?;
    params
        .check()
        .map_err(|m| ProxyError::BadRequest(format!("lora job: {m}")))?;
    let model = string_field(obj, "model")?.ok_or_else(|| {
        bad(
            "model",
            "is required: a model directory, a configured model id, a model in the store or a Hugging Face repo in the cache",
        )
    })?;
    let data = absolute_path(obj, "data")?.ok_or_else(|| {
        bad(
            "data",
            "is required: the absolute path of a directory with train.jsonl and valid.jsonl",
        )
    })?;
    for name in ["train.jsonl", "valid.jsonl"] {
        if !data.join(name).is_file() {
            return Err(bad("data", format!("{} has no {name}", data.display())));
        }
    }
    let init_adapter = absolute_path(obj, "init_adapter")?;
    let resume = match obj.get("resume") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => return Err(bad("resume", format!("must be true or false, got {other}"))),
    };
    let (id, source) = model_dir(&model, catalog, home)?;
    let size: CheckpointSize =
        admission::checkpoint_size(&source).map_err(|e| bad("model", e.to_string()))?;
    let shape = admission::ModelShape::read(&source);
    let row_tokens = admission::lora_row_tokens(
        &[&data.join("train.jsonl"), &data.join("valid.jsonl")],
        params.max_seq_length,
    )
    .map_err(|e| bad("data", format!("{}: {e}", data.display())))?;
    let adapters = home.join("adapters");
    let out = match string_field(obj, "out")? {
        Some(o) if mlxd_store::inventory::is_plain_name(&o) => adapters.join(o),
        Some(o) if Path::new(&o).is_absolute() && Path::new(&o).file_name().is_some() => {
            PathBuf::from(o)
        }
        Some(o) => {
            return Err(bad(
                "out",
                format!("must be a name (an adapter in the store) or an absolute path, got {o:?}"),
            ))
        }
        None => adapters.join(format!("{}-lora", leaf_name(&id))),
    };
    if out.exists() {
        return Err(bad(
            "out",
            format!(
                "{} already exists; a job never overwrites an adapter",
                out.display()
            ),
        ));
    }
    if resume && !checkpoints_of(&out).is_dir() {
        return Err(bad(
            "resume",
            format!(
                "no checkpoints of an earlier run for {} ({} does not exist)",
                out.display(),
                checkpoints_of(&out).display()
            ),
        ));
    }
    Ok(PreparedJob {
        request: JobRequest::Lora {
            model,
            data: data.display().to_string(),
            out: Some(out.display().to_string()),
            resume,
            init_adapter: init_adapter.as_ref().map(|p| p.display().to_string()),
            params: params.clone(),
        },
        memory_bytes: admission::lora_peak_bytes(size, shape, &params, row_tokens),
        work: Work::Lora {
            source,
            data,
            params,
            resume,
            init_adapter,
            out,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn catalog() -> Catalog {
        let config = crate::config::Config::default();
        Catalog::from_config(&config).expect("default catalog")
    }

    fn field_of(body: &str) -> (Option<&'static str>, String) {
        let home = tempfile::tempdir().unwrap();
        let e = prepare(body.as_bytes(), &catalog(), home.path()).unwrap_err();
        assert_eq!(e.status(), http::StatusCode::BAD_REQUEST, "{e}");
        (e.param(), e.to_string())
    }

    #[test]
    fn bad_fields_are_named() {
        for (body, field, needle) in [
            (r#"{}"#, "kind", "required"),
            (
                r#"{"kind":"bake"}"#,
                "kind",
                "quantize, convert, fetch, lora or fuse",
            ),
            (r#"{"kind":"quantize"}"#, "model", "required"),
            (r#"{"kind":"quantize","model":7}"#, "model", "string"),
            (
                r#"{"kind":"quantize","model":"/nonexistent/m","bits":3}"#,
                "bits",
                "4, 8",
            ),
            (
                r#"{"kind":"quantize","model":"/nonexistent/m","group_size":48}"#,
                "group_size",
                "32, 64, 128",
            ),
            (
                r#"{"kind":"quantize","model":"/nonexistent/m"}"#,
                "model",
                "not a model",
            ),
            (
                r#"{"kind":"convert","gguf":"rel.gguf"}"#,
                "gguf",
                "absolute",
            ),
            (r#"{"kind":"convert","gguf":"/x/y.bin"}"#, "gguf", ".gguf"),
            (
                r#"{"kind":"fetch","model":"not a repo"}"#,
                "model",
                "repo id",
            ),
        ] {
            let (param, message) = field_of(body);
            assert_eq!(param, Some(field), "{body}: {message}");
            assert!(message.contains(needle), "{body}: {message}");
        }
    }

    #[test]
    fn unknown_fields_and_non_objects_are_refused() {
        let home = tempfile::tempdir().unwrap();
        for body in [r#"[1]"#, r#"{"kind":"fetch","bits":4}"#, "{"] {
            let e = prepare(body.as_bytes(), &catalog(), home.path()).unwrap_err();
            assert_eq!(e.status(), http::StatusCode::BAD_REQUEST, "{body}");
        }
    }

    #[test]
    fn a_model_directory_gets_a_default_out_and_an_estimate() {
        let home = tempfile::tempdir().unwrap();
        let model = home.path().join("src-model");
        std::fs::create_dir(&model).unwrap();
        std::fs::write(model.join("config.json"), "{}").unwrap();
        // One 1 KiB tensor in a minimal safetensors file.
        let header = br#"{"w":{"dtype":"F16","shape":[16,32],"data_offsets":[0,1024]}}"#;
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header);
        file.extend(std::iter::repeat_n(0u8, 1024));
        std::fs::write(model.join("model.safetensors"), file).unwrap();
        let body = format!(
            r#"{{"kind":"quantize","model":"{}","bits":8}}"#,
            model.display()
        );
        let job = prepare(body.as_bytes(), &catalog(), home.path()).unwrap();
        let Work::Quantize {
            out,
            bits,
            group_size,
            ..
        } = &job.work
        else {
            panic!("{job:?}")
        };
        assert_eq!((*bits, *group_size), (8, 64));
        assert_eq!(out, &home.path().join("models/src-model-8bit-g64"));
        assert!(job.memory_bytes >= 3 * 1024);
        let staging = job.work.staging("job-3").unwrap();
        assert_eq!(
            staging,
            home.path().join(format!(
                "models/.src-model-8bit-g64.mlxd-job-{}-job-3",
                std::process::id()
            ))
        );
        // A plain name is a model in the store; a relative path is refused.
        let named = body.replace("\"bits\":8", "\"bits\":8,\"out\":\"smol-q8\"");
        let job = prepare(named.as_bytes(), &catalog(), home.path()).unwrap();
        let Work::Quantize { out: named_out, .. } = &job.work else {
            panic!("{job:?}")
        };
        assert_eq!(named_out, &home.path().join("models/smol-q8"));
        let relative = body.replace("\"bits\":8", "\"bits\":8,\"out\":\"x/smol-q8\"");
        let e = prepare(relative.as_bytes(), &catalog(), home.path()).unwrap_err();
        assert_eq!(e.param(), Some("out"));
        assert!(e.to_string().contains("a name"), "{e}");
        // An existing output is refused.
        std::fs::create_dir_all(out).unwrap();
        let e = prepare(body.as_bytes(), &catalog(), home.path()).unwrap_err();
        assert_eq!(e.param(), Some("out"));
    }

    #[test]
    fn lora_requests_check_their_settings_and_fill_in_mlx_lm_defaults() {
        let home = tempfile::tempdir().unwrap();
        let model = home.path().join("m");
        std::fs::create_dir(&model).unwrap();
        std::fs::write(model.join("config.json"), r#"{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 100}"#).unwrap();
        let header = br#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
        let mut weights = (header.len() as u64).to_le_bytes().to_vec();
        weights.extend_from_slice(header);
        weights.extend_from_slice(&[0u8; 8]);
        std::fs::write(model.join("model.safetensors"), weights).unwrap();
        let data = home.path().join("data");
        std::fs::create_dir(&data).unwrap();
        let body = |extra: &str| {
            format!(
                r#"{{"kind":"lora","model":{:?},"data":{:?}{extra}}}"#,
                model.display().to_string(),
                data.display().to_string()
            )
        };
        let err = |extra: &str| {
            prepare(body(extra).as_bytes(), &catalog(), home.path())
                .unwrap_err()
                .to_string()
        };
        assert!(err("").contains("has no train.jsonl"), "{}", err(""));
        std::fs::write(data.join("train.jsonl"), "").unwrap();
        std::fs::write(data.join("valid.jsonl"), "").unwrap();
        assert!(err(r#","rank":0"#).contains("rank 0"));
        assert!(err(r#","fine_tune_type":"full""#).contains("not built"));
        assert!(err(r#","learning_rat":1"#).contains("learning_rat"));
        let e = err(r#","resume":true"#);
        assert!(e.contains("no checkpoints"), "{e}");
        let job = prepare(body("").as_bytes(), &catalog(), home.path()).unwrap();
        let JobRequest::Lora { params, out, .. } = &job.request else {
            panic!("{job:?}")
        };
        assert_eq!(*params, TrainParams::default());
        assert_eq!(
            out.as_deref(),
            Some(home.path().join("adapters/m-lora").to_str().unwrap())
        );
        // Weights (8 bytes here) plus a batch of 4 rows' activations and logits, a row the
        // template's allowance (the files are empty) under max_seq_length 2048.
        let per_token = 2 * (12 * 64 + 4 * 128) * 4 + 3 * 100 * 4;
        let rows = 4 * admission::TEMPLATE_TOKENS;
        assert!(job.memory_bytes >= rows * per_token);
        assert!(job.memory_bytes < rows * per_token + (2 << 30));
        std::fs::write(data.join("train.jsonl"), "x".repeat(5000) + "\n").unwrap();
        let long = prepare(body("").as_bytes(), &catalog(), home.path()).unwrap();
        assert_eq!(
            long.memory_bytes - job.memory_bytes,
            4 * (2048 - admission::TEMPLATE_TOKENS) * per_token,
            "rows capped at max_seq_length"
        );
    }
}
