//! Reading a family's `config.json`: one deserializer that names the family in its errors,
//! the serde defaults the families' config structs share with mlx-lm's `ModelArgs`, and the
//! checks of the attention geometry a config gives.
use serde_json::Value;

use crate::loader::LoadError;

/// Deserializes a family's config struct, naming the family and the field serde rejects.
pub(crate) fn parse_config<T: serde::de::DeserializeOwned>(
    family: &str,
    config: &Value,
) -> Result<T, LoadError> {
    serde_json::from_value(config.clone())
        .map_err(|e| LoadError::Config(format!("{family} config: {e}")))
}

/// `true`, the default of `tie_word_embeddings` (and other flags) in most `ModelArgs`.
pub(crate) fn default_true() -> bool {
    true
}

/// `10000.0`, the default `rope_theta` of most `ModelArgs`.
pub(crate) fn default_rope_theta() -> f32 {
    10000.0
}

/// Checks the head counts a config gives: both positive, and the query heads a multiple of
/// the KV heads (grouped-query attention shares each KV head among whole groups).
pub(crate) fn check_heads(heads: i32, kv_heads: i32) -> Result<(), LoadError> {
    if heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0 {
        return Err(LoadError::Config(format!(
            "num_attention_heads {heads} must be a positive multiple of num_key_value_heads \
             {kv_heads}"
        )));
    }
    Ok(())
}

/// `hidden_size / num_attention_heads`, the head size when the config gives none, refused
/// when it does not divide.
pub(crate) fn implied_head_dim(hidden: i32, heads: i32) -> Result<i32, LoadError> {
    if heads <= 0 || hidden % heads != 0 {
        return Err(LoadError::Config(format!(
            "hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
        )));
    }
    Ok(hidden / heads)
}

/// `hidden_size // num_attention_heads`, as the mlx-lm families that ignore `head_dim` compute
/// it (flooring); refused only without heads.
pub(crate) fn floored_head_dim(hidden: i32, heads: i32) -> Result<i32, LoadError> {
    if heads <= 0 {
        return Err(LoadError::Config(format!(
            "num_attention_heads {heads} must be positive"
        )));
    }
    Ok(hidden / heads)
}

/// Per layer, whether it attends within the sliding window, from a `layer_types` list of
/// `sliding_attention` and `full_attention`. mlx-lm pairs layers with the list by `zip`, so a
/// list of another length is refused (it would silently drop layers), as is any other type.
pub(crate) fn sliding_layers(
    family: &str,
    types: &[String],
    num_layers: usize,
) -> Result<Vec<bool>, LoadError> {
    if types.len() != num_layers {
        return Err(LoadError::Config(format!(
            "{family}: {} layer_types for {num_layers} layers",
            types.len()
        )));
    }
    types
        .iter()
        .map(|t| match t.as_str() {
            "sliding_attention" => Ok(true),
            "full_attention" => Ok(false),
            other => Err(LoadError::Config(format!(
                "{family}: unsupported layer type {other:?}"
            ))),
        })
        .collect()
}
