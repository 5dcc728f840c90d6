//! `/api/tags`, `/api/ps` and `/api/show` bodies, from the pool's rows and what the store
//! reads from each model's directory (`mlxd_store::facts`). Pure given those inputs.

use std::time::{Duration, SystemTime};

use mlxd_store::facts::ModelFacts;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use super::clock;
use crate::pool::EngineStatus;

/// A model as the listing routes describe it.
#[derive(Debug, Clone)]
pub struct Described<'a> {
    pub status: &'a EngineStatus,
    /// `None` when the model is not on disk yet (a known name or repo not pulled).
    pub facts: Option<&'a ModelFacts>,
}

/// A stable identifier of the model's source (what it is loaded from), in the place where
/// Ollama puts a content digest. It changes when the source does, not with the bytes.
pub fn digest(source: &str) -> String {
    let d = Sha256::digest(source.as_bytes());
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// `1.2B`, `134.5M`, `900K`: a parameter count as Ollama writes it.
pub fn parameter_size(n: u64) -> String {
    let (value, unit) = match n {
        n if n >= 1_000_000_000 => (n as f64 / 1e9, "B"),
        n if n >= 1_000_000 => (n as f64 / 1e6, "M"),
        n if n >= 1_000 => (n as f64 / 1e3, "K"),
        n => return n.to_string(),
    };
    format!("{value:.1}{unit}")
}

/// Ollama's `details` object.
pub fn details(source: &str, facts: Option<&ModelFacts>) -> Value {
    let family = facts.and_then(|f| f.model_type.clone()).unwrap_or_default();
    let format = if source.ends_with(".gguf") {
        "gguf"
    } else {
        "safetensors"
    };
    json!({
        "parent_model": "",
        "format": format,
        "family": family,
        "families": if family.is_empty() { vec![] } else { vec![family.clone()] },
        "parameter_size": facts.and_then(|f| f.parameters).map(parameter_size).unwrap_or_default(),
        "quantization_level": facts.map(|f| f.quantization.clone()).unwrap_or_default(),
    })
}

/// When the model directory last changed (its config.json), else now.
fn modified_at(facts: Option<&ModelFacts>) -> String {
    let t = facts
        .and_then(|f| std::fs::metadata(f.dir.join("config.json")).ok())
        .and_then(|m| m.modified().ok())
        .unwrap_or_else(SystemTime::now);
    clock::rfc3339(t)
}

/// One `/api/tags` row.
pub fn tag(d: &Described<'_>, size_on_disk: u64) -> Value {
    let s = d.status;
    json!({
        "name": s.model,
        "model": s.model,
        "modified_at": modified_at(d.facts),
        "size": d.facts.map_or(size_on_disk, |f| f.size_bytes),
        "digest": digest(&s.source),
        "details": details(&s.source, d.facts),
    })
}

/// Whether `/api/ps` lists the row: an engine that is up (serving, or draining work).
pub fn is_running(s: &EngineStatus) -> bool {
    matches!(s.state, "ready" | "draining")
}

/// When a running model's idle timer unloads it: now plus what is left of its TTL, the TTL
/// itself while requests run, or (pinned, no TTL) about 292 years away, as Ollama writes
/// "forever".
pub fn expires_at(s: &EngineStatus, now: SystemTime) -> String {
    let left = match s.ttl_s {
        Some(ttl) => Duration::from_secs_f64((ttl - s.idle_s.unwrap_or(0.0)).max(0.0)),
        None => Duration::from_nanos(i64::MAX as u64),
    };
    clock::rfc3339(now + left)
}

/// One `/api/ps` row.
pub fn running(d: &Described<'_>, now: SystemTime) -> Value {
    let s = d.status;
    let on_gpu = s
        .device
        .as_deref()
        .is_some_and(|dev| dev.starts_with("gpu"));
    let mut row = json!({
        "name": s.model,
        "model": s.model,
        "size": s.memory_bytes,
        "digest": digest(&s.source),
        "details": details(&s.source, d.facts),
        "expires_at": expires_at(s, now),
        "size_vram": if on_gpu { s.memory_bytes } else { 0 },
    });
    if let Some(ready) = &s.ready {
        row["context_length"] = json!(ready.context_length);
    }
    row
}

/// What the model can be asked for, as Ollama names it, from its chat template.
pub fn capabilities(facts: Option<&ModelFacts>) -> Vec<&'static str> {
    let mut caps = vec!["completion"];
    if let Some(t) = facts.and_then(|f| f.chat_template.as_deref()) {
        if t.contains("tools") || t.contains("tool_call") {
            caps.push("tools");
        }
        if t.contains("<think>") || t.contains("enable_thinking") || t.contains("reasoning") {
            caps.push("thinking");
        }
    }
    caps
}

/// The `/api/show` body.
pub fn show(d: &Described<'_>) -> Value {
    let s = d.status;
    let f = d.facts;
    let arch = f
        .and_then(|f| f.model_type.clone())
        .unwrap_or_else(|| "unknown".into());
    let mut info = Map::new();
    info.insert("general.architecture".into(), json!(arch));
    if let Some(f) = f {
        info.insert("general.basename".into(), json!(s.model));
        let mut put = |key: &str, v: Option<u64>| {
            if let Some(v) = v {
                info.insert(key.to_string(), json!(v));
            }
        };
        put("general.parameter_count", f.parameters);
        put(&format!("{arch}.context_length"), f.context_length);
        put(&format!("{arch}.block_count"), f.layers);
        put(&format!("{arch}.embedding_length"), f.hidden_size);
        put(&format!("{arch}.vocab_size"), f.vocab_size);
    }
    let template = f.and_then(|f| f.chat_template.clone()).unwrap_or_default();
    let mut modelfile = format!("# Served by mlxd from {}\nFROM {}\n", s.source, s.source);
    if !template.is_empty() {
        modelfile.push_str(&format!("TEMPLATE \"\"\"{template}\"\"\"\n"));
    }
    let mut body = json!({
        "modelfile": modelfile,
        "parameters": "",
        "template": template,
        "details": details(&s.source, f),
        "model_info": Value::Object(info),
        "capabilities": capabilities(f),
        "modified_at": modified_at(f),
    });
    if let Some(license) = f.and_then(|f| f.license.clone()) {
        body["license"] = json!(license);
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_sizes() {
        assert_eq!(parameter_size(134_515_008), "134.5M");
        assert_eq!(parameter_size(1_235_814_400), "1.2B");
        assert_eq!(parameter_size(8_000), "8.0K");
        assert_eq!(parameter_size(12), "12");
    }

    #[test]
    fn digest_is_stable_hex() {
        let d = digest("smollm2-135m");
        assert_eq!(d.len(), 64);
        assert_eq!(d, digest("smollm2-135m"));
        assert_ne!(d, digest("smollm2-135m-q8"));
    }

    fn facts(template: &str) -> ModelFacts {
        ModelFacts {
            dir: std::path::PathBuf::from("/nonexistent"),
            architecture: "LlamaForCausalLM".into(),
            model_type: Some("llama".into()),
            parameters: Some(134_515_008),
            quantization: "mlx 4-bit".into(),
            context_length: Some(8192),
            layers: Some(30),
            hidden_size: Some(576),
            vocab_size: Some(49152),
            chat_format: None,
            chat_template: Some(template.into()),
            license: Some("apache-2.0".into()),
            size_bytes: 100,
        }
    }

    #[test]
    fn details_and_capabilities_from_facts() {
        let f = facts("{% if tools %}{{ tools }}{% endif %}<think>");
        let d = details("smollm2-135m", Some(&f));
        assert_eq!(d["family"], "llama");
        assert_eq!(d["families"], json!(["llama"]));
        assert_eq!(d["parameter_size"], "134.5M");
        assert_eq!(d["quantization_level"], "mlx 4-bit");
        assert_eq!(d["format"], "safetensors");
        assert_eq!(details("/m/x.gguf", None)["format"], "gguf");
        assert_eq!(details("/m/x.gguf", None)["families"], json!([]));
        assert_eq!(
            capabilities(Some(&f)),
            vec!["completion", "tools", "thinking"]
        );
        assert_eq!(
            capabilities(Some(&facts("{{ messages }}"))),
            vec!["completion"]
        );
        assert_eq!(capabilities(None), vec!["completion"]);
    }
}
