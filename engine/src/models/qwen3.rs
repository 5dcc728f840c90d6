//! Qwen3 (dense): the Llama decoder with RMS-normalised query and key heads, an explicit
//! `head_dim`, and `rope_theta` possibly nested under `rope_parameters` (transformers ≥ 5).
use serde_json::Value;

use super::attention::QkNorm;
use super::config::parse_config;
use super::llama::Config;
use super::mlp::GatedMlp;
use super::CausalLm;
use crate::distributed::Group;
use crate::loader::{LoadError, Weights};

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    build_in(config, w, None)
}

/// [`build`] for one stage of a pipeline over `group` (`crate::distributed::pipeline`).
pub fn build_stage(
    config: &Value,
    w: &mut Weights,
    group: Group,
) -> Result<Box<dyn CausalLm>, LoadError> {
    build_in(config, w, Some(group))
}

fn build_in(
    config: &Value,
    w: &mut Weights,
    pipeline: Option<Group>,
) -> Result<Box<dyn CausalLm>, LoadError> {
    let mut config = config.clone();
    if let Some(params) = config.get("rope_parameters").cloned() {
        if config.get("rope_theta").is_none() {
            if let Some(theta) = params.get("rope_theta") {
                config["rope_theta"] = theta.clone();
            }
        }
        if config.get("rope_scaling").is_none_or(Value::is_null) {
            config["rope_scaling"] = params;
        }
    }
    if config.get("rope_theta").is_none() {
        return Err(LoadError::Config("Qwen3 config has no rope_theta".into()));
    }
    let c: Config = parse_config("Qwen3", &config)?;
    if c.head_dim.is_none() {
        return Err(LoadError::Config("Qwen3 config has no head_dim".into()));
    }
    let mut shaped = c.shaped(&config, c.attention_bias, QkNorm::PerHead)?;
    let mlp = |w: &mut Weights, _, p: &str| GatedMlp::load(w, &format!("{p}.mlp"), c.mlp_bias);
    match pipeline {
        Some(group) => shaped.build_stage(w, group, mlp),
        None => {
            let group = shard(w, &mut shaped.attention)?;
            shaped.build_sharded(w, group, mlp)
        }
    }
}

/// Tensor parallelism for Qwen3: the Llama split ([`super::llama::shard`]); the per-head query
/// and key norms stay whole (every head uses the same `[head_dim]` weights).
fn shard(
    w: &mut Weights,
    attention: &mut super::attention::AttentionShape,
) -> Result<Option<crate::distributed::Group>, LoadError> {
    super::llama::shard(w, attention)
}
