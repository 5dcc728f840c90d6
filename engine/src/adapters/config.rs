//! `adapter_config.json` as mlx-lm's trainer writes it (`mlx_lm/tuner/utils.py`,
//! `load_adapters`): the fields serving needs, and the refusal of what is no adapter.
use serde_json::Value;

use super::AdapterError;

/// Which update an adapter makes (mlx-lm's `fine_tune_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdapterKind {
    /// `LoRALinear`: `y + scale * (x @ lora_a) @ lora_b`.
    Lora,
    /// `DoRALinear`: LoRA's output rescaled per output row by `m / ‖W + scale·Bᵀ·Aᵀ‖`
    /// (`<layer>.m` in the weights, the learned magnitude).
    Dora,
}

impl AdapterKind {
    /// mlx-lm's `fine_tune_type` for it.
    pub fn name(self) -> &'static str {
        match self {
            AdapterKind::Lora => "lora",
            AdapterKind::Dora => "dora",
        }
    }
}

/// An adapter's settings: its kind, `lora_parameters.rank` and `.scale`; `dropout` only
/// matters in training and is ignored.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterConfig {
    pub kind: AdapterKind,
    pub rank: usize,
    pub scale: f32,
}

/// Reads the settings from `adapter_config.json`'s text. A full fine-tune
/// (`fine_tune_type` `full`) is refused with its reason.
pub fn parse(text: &str) -> Result<AdapterConfig, AdapterError> {
    let invalid = |reason: String| AdapterError::Invalid(format!("adapter_config.json: {reason}"));
    let value: Value =
        serde_json::from_str(text).map_err(|e| invalid(format!("not valid JSON: {e}")))?;
    let kind = value
        .get("fine_tune_type")
        .and_then(Value::as_str)
        .unwrap_or("lora");
    // Older mlx-lm configs said `use_dora: true` instead.
    let legacy_dora = value.get("use_dora").and_then(Value::as_bool) == Some(true);
    let kind = match kind {
        "lora" if !legacy_dora => AdapterKind::Lora,
        "dora" | "lora" => AdapterKind::Dora,
        "full" => {
            return Err(AdapterError::Refused(
                "a full fine-tune (fine_tune_type \"full\") is a model, not an adapter: serve \
                 its directory as a model"
                    .into(),
            ))
        }
        other => {
            return Err(invalid(format!(
                "fine_tune_type {other:?} is unknown (mlx-lm writes \"lora\", \"dora\" or \
                 \"full\")"
            )))
        }
    };
    let params = value
        .get("lora_parameters")
        .ok_or_else(|| invalid("no `lora_parameters` object".into()))?;
    let rank = params
        .get("rank")
        .and_then(Value::as_u64)
        .filter(|&r| r > 0)
        .ok_or_else(|| invalid("`lora_parameters.rank` must be a positive integer".into()))?;
    let scale = params.get("scale").and_then(Value::as_f64).ok_or_else(|| {
        let hint = if params.get("alpha").is_some() {
            " (mlx-lm's config uses `scale`, not `alpha`)"
        } else {
            ""
        };
        invalid(format!("`lora_parameters.scale` must be a number{hint}"))
    })?;
    Ok(AdapterConfig {
        kind,
        rank: rank as usize,
        scale: scale as f32,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_rank_and_scale_of_a_lora_adapter() {
        let text = r#"{"fine_tune_type": "lora", "num_layers": 16,
            "lora_parameters": {"rank": 8, "scale": 20.0, "dropout": 0.1}}"#;
        assert_eq!(
            parse(text).unwrap(),
            AdapterConfig {
                kind: AdapterKind::Lora,
                rank: 8,
                scale: 20.0
            }
        );
        // An old config without `fine_tune_type` is LoRA.
        let text = r#"{"lora_parameters": {"rank": 4, "scale": 2}}"#;
        assert_eq!(parse(text).unwrap().rank, 4);
    }

    #[test]
    fn reads_dora_in_both_spellings() {
        let dora = r#"{"fine_tune_type": "dora", "lora_parameters": {"rank": 8, "scale": 2}}"#;
        assert_eq!(parse(dora).unwrap().kind, AdapterKind::Dora);
        let legacy = r#"{"use_dora": true, "lora_parameters": {"rank": 8, "scale": 2}}"#;
        assert_eq!(parse(legacy).unwrap().kind, AdapterKind::Dora);
    }

    #[test]
    fn refuses_full_and_malformed_configs_with_their_reason() {
        let full = r#"{"fine_tune_type": "full"}"#;
        assert!(matches!(parse(full), Err(AdapterError::Refused(m)) if m.contains("full")));
        let alpha = r#"{"lora_parameters": {"rank": 8, "alpha": 16}}"#;
        assert!(matches!(parse(alpha), Err(AdapterError::Invalid(m)) if m.contains("alpha")));
        let rank0 = r#"{"lora_parameters": {"rank": 0, "scale": 1}}"#;
        assert!(matches!(parse(rank0), Err(AdapterError::Invalid(m)) if m.contains("rank")));
        assert!(matches!(parse("{"), Err(AdapterError::Invalid(_))));
    }
}
