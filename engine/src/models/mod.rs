//! Model architectures, one file per family, and the registry that picks one from
//! `config.json`'s `architectures[0]`.
//!
//! A model is a config plus `forward(tokens, caches)`: caches are owned per sequence and passed
//! in, so one loaded model serves any number of sequences.
pub mod attention;
pub mod cohere;
pub mod cohere2;
pub mod config;
pub mod decode_attention;
pub mod decoder;
pub mod deepseek_v2;
pub mod deepseek_v3;
pub mod delta_kernel;
pub mod exaone4;
pub mod falcon_h1;
pub mod gated_delta;
pub mod gemma2;
pub mod gemma3;
pub mod gemma4;
pub mod glm4;
pub mod glm4_moe;
pub mod gpt_oss;
pub mod granite;
pub mod granitemoe;
pub mod info;
pub(crate) mod kept;
pub mod layers;
pub mod lfm2;
pub mod llama;
pub mod mamba2;
pub mod ministral3;
pub mod mixtral;
pub mod mla;
pub mod mlp;
pub mod moe;
pub mod nemotron_h;
pub mod olmo2;
pub mod olmoe;
pub mod params;
pub mod phi3;
pub mod quant;
pub mod qwen2_moe;
pub mod qwen3;
pub mod qwen3_5;
pub mod qwen3_moe;
pub mod qwen3_next;
pub mod rope;
pub mod scalar;
pub mod smollm3;
pub mod stacked;
pub mod starcoder2;
pub mod switch;
#[cfg(test)]
pub(crate) mod test_arrays;

use std::path::Path;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;
use serde_json::Value;

use crate::cache::{DenseKv, LayerCache, LayerKind};
use crate::loader::{self, LoadError, Weights};

/// Facts about a loaded model that the server and the supervisor need.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    pub architecture: String,
    pub vocab_size: usize,
    pub num_layers: usize,
    /// The longest sequence (prompt + generation) the model supports.
    pub context_length: usize,
    /// Bytes of parameters held in memory.
    pub weight_bytes: usize,
    /// KV cache bytes per token of one sequence (as the cache stores it: the runtime updates
    /// this when the KV cache is quantized).
    pub kv_bytes_per_token: usize,
    /// Bytes of one unquantized KV element (the model's activation dtype).
    pub kv_dtype_bytes: usize,
    /// Dimension of one attention head (what a KV quantization group must divide).
    pub head_dim: usize,
    /// Bytes of the recurrent layers' states of one sequence, whatever its length (0 for a
    /// model that only attends).
    pub state_bytes_per_sequence: usize,
    /// Token ids that end a generation, from config.json (`eos_token_id`, int or list).
    pub eos_token_ids: Vec<u32>,
}

/// The last position `[B, 1, ...]` of `[B, L, ...]` (`x` itself when `L` is 1).
pub(crate) fn last_position(x: &Array) -> Array {
    match x.shape()[1] {
        1 => x.clone(),
        len => x.index((.., len - 1.., ..)),
    }
}

/// A causal language model.
pub trait CausalLm: Send {
    /// `tokens` is `[B, L]` (uint32); returns the last layer's hidden states `[B, L, D]`,
    /// before the final norm (what [`Self::head`] takes). `caches` holds one cache per layer,
    /// in any layout, with `B` rows.
    fn hidden(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception>;
    /// Logits `[B, L, vocab]` of hidden states from [`Self::hidden`]: the final norm, the
    /// head and the family's scaling or soft-capping.
    fn head(&self, hidden: &Array) -> Result<Array, Exception>;
    /// Logits `[B, L, vocab]` of `tokens` `[B, L]` (see [`Self::hidden`]).
    fn forward(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        let h = self.hidden(tokens, caches)?;
        self.head(&h)
    }
    /// Logits `[B, 1, vocab]` of the last position of `tokens` only: the head runs on one
    /// position per row, so a prefill pass that samples its prompts' first tokens does not
    /// compute (and hold) logits for every prompt position. The generic decoder also runs
    /// its last layer's attention output and feed-forward on that position alone
    /// ([`decoder::DecoderLayer::forward_last`]); other families run the whole last layer.
    fn forward_last(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        self.head(&last_position(&self.hidden(tokens, caches)?))
    }
    fn info(&self) -> &ModelInfo;
    /// Why this model cannot serve `feature` exactly, naming the family and the option; `None`
    /// when it can. The engine refuses a refused option at load instead of serving wrong
    /// tokens.
    fn refuses(&self, feature: Feature) -> Option<String> {
        let _ = feature;
        None
    }
    /// Each layer's sliding window (the most keys one query sees, itself included), `None`
    /// for layers that attend over the whole context. The runtime keeps a windowed layer's
    /// cache bounded by its window.
    fn layer_windows(&self) -> Vec<Option<usize>> {
        vec![None; self.info().num_layers]
    }
    /// What each layer keeps between forward passes: keys and values (within its window,
    /// from [`Self::layer_windows`]) unless the family has recurrent layers.
    fn layer_kinds(&self) -> Vec<LayerKind> {
        self.layer_windows()
            .into_iter()
            .map(|window| LayerKind::Attention { window })
            .collect()
    }
    /// Fresh per-layer caches for one sequence (the serial reference path): dense KV for
    /// attention layers, a one-row state for recurrent ones.
    fn new_dense_caches(&self) -> Vec<LayerCache> {
        self.layer_kinds()
            .into_iter()
            .map(|kind| match kind {
                LayerKind::Attention { .. } => LayerCache::Dense(DenseKv::new()),
                LayerKind::State { .. } => kind.fresh(vec![0], None),
            })
            .collect()
    }
    /// The LoRA adapters this model serves beside its own weights, per row
    /// ([`crate::adapters`]); `None` for a model loaded without a table (a tensor-parallel
    /// shard, a test's wrapper).
    fn adapters(&self) -> Option<&std::sync::Arc<crate::adapters::AdapterTable>> {
        None
    }
}

/// A runtime option that a family may be unable to serve exactly (see [`CausalLm::refuses`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feature {
    /// A quantized KV cache (`kv_bits`).
    KvQuantization,
    /// Speculative decoding with rollback (`draft`).
    Speculation,
    /// The prefix cache, and with it the SSD tier and generation checkpoints
    /// (`prompt_cache`, `ssd_cache`).
    PrefixCache,
}

impl Feature {
    /// The option's name as users set it.
    pub fn option(self) -> &'static str {
        match self {
            Feature::KvQuantization => "kv_bits",
            Feature::Speculation => "draft",
            Feature::PrefixCache => "prompt_cache",
        }
    }
}

type Builder = fn(&Value, &mut Weights) -> Result<Box<dyn CausalLm>, LoadError>;

/// `architectures[0]` → builder. Qwen2 and Mistral share the Llama file, as in mlx-lm.
const REGISTRY: &[(&str, Builder)] = &[
    ("Gemma2ForCausalLM", gemma2::build),
    ("Gemma3ForCausalLM", gemma3::build),
    ("Gemma3ForConditionalGeneration", gemma3::build_conditional),
    ("Gemma4ForCausalLM", gemma4::build),
    ("Gemma4ForConditionalGeneration", gemma4::build_conditional),
    ("GptOssForCausalLM", gpt_oss::build),
    ("FalconH1ForCausalLM", falcon_h1::build),
    ("Lfm2ForCausalLM", lfm2::build),
    ("Mamba2ForCausalLM", mamba2::build),
    ("NemotronHForCausalLM", nemotron_h::build),
    ("CohereForCausalLM", cohere::build),
    ("Cohere2ForCausalLM", cohere2::build),
    ("Exaone4ForCausalLM", exaone4::build),
    ("Glm4ForCausalLM", glm4::build),
    ("Ministral3ForCausalLM", ministral3::build),
    (
        "Mistral3ForConditionalGeneration",
        ministral3::build_conditional,
    ),
    ("LlamaForCausalLM", llama::build),
    ("MistralForCausalLM", llama::build),
    ("Qwen2ForCausalLM", llama::build),
    ("Qwen3ForCausalLM", qwen3::build),
    ("Qwen3MoeForCausalLM", qwen3_moe::build),
    ("Qwen3NextForCausalLM", qwen3_next::build),
    ("Qwen3_5ForCausalLM", qwen3_5::build),
    ("Qwen3_5ForConditionalGeneration", qwen3_5::build),
    ("Qwen3_5MoeForCausalLM", qwen3_5::build),
    ("Qwen3_5MoeForConditionalGeneration", qwen3_5::build),
    ("Qwen2MoeForCausalLM", qwen2_moe::build),
    ("MixtralForCausalLM", mixtral::build),
    ("OlmoeForCausalLM", olmoe::build),
    ("GraniteMoeForCausalLM", granitemoe::build),
    ("Glm4MoeForCausalLM", glm4_moe::build),
    ("DeepseekV2ForCausalLM", deepseek_v2::build),
    ("DeepseekV3ForCausalLM", deepseek_v3::build),
    ("GraniteForCausalLM", granite::build),
    ("Olmo2ForCausalLM", olmo2::build),
    ("Phi3ForCausalLM", phi3::build),
    ("SmolLM3ForCausalLM", smollm3::build),
    ("Starcoder2ForCausalLM", starcoder2::build),
];

/// Loads the model in `dir`, with every weight evaluated and accounted for.
pub fn load(dir: &Path) -> Result<Box<dyn CausalLm>, LoadError> {
    load_reporting(dir, None)
}

/// [`load`], reporting the weights read to `reporter` ([`crate::loader::LoadReporter`]).
pub fn load_reporting(
    dir: &Path,
    reporter: Option<crate::loader::LoadReporter>,
) -> Result<Box<dyn CausalLm>, LoadError> {
    load_for_group(dir, reporter, None)
}

/// [`load_reporting`] of this rank's shard for a tensor-parallel `group`
/// (`crate::distributed`); an architecture whose file cannot divide it is refused before a
/// weight is read.
pub fn load_for_group(
    dir: &Path,
    reporter: Option<crate::loader::LoadReporter>,
    group: Option<crate::distributed::Group>,
) -> Result<Box<dyn CausalLm>, LoadError> {
    let config = loader::read_config(dir)?;
    let (arch, build) = registered(&config)?;
    if let Some(group) = &group {
        crate::distributed::check_architecture(arch, group.size())?;
    }
    // A shard holds part of each linear layer: adapters are not applied to it.
    let adapters = group
        .is_none()
        .then(|| std::sync::Arc::new(crate::adapters::AdapterTable::new()));
    let mut weights = Weights::open(dir, &config)?
        .with_reporter(reporter)
        .with_group(group);
    let model = {
        let _registering = adapters.clone().map(crate::adapters::loading_into);
        build(&config, &mut weights)?
    };
    weights.finish()?;
    Ok(match adapters {
        Some(table) => Box::new(crate::adapters::model::Adapted::new(model, table)),
        None => model,
    })
}

/// Builds one stage of a pipeline (`crate::distributed::pipeline`): the rank's layers and the
/// model's ends.
type StageBuild =
    fn(&Value, &mut Weights, crate::distributed::Group) -> Result<Box<dyn CausalLm>, LoadError>;

/// The architectures whose files can load a pipeline stage (their `build_stage` functions).
const PIPELINED: &[(&str, StageBuild)] = &[
    ("LlamaForCausalLM", llama::build_stage),
    ("MistralForCausalLM", llama::build_stage),
    ("Qwen2ForCausalLM", llama::build_stage),
    ("Qwen3ForCausalLM", qwen3::build_stage),
    ("Qwen3MoeForCausalLM", qwen3_moe::build_stage),
];

/// The stage builder of `architecture` for a pipeline of `ranks`, or the refusal naming it.
fn stage_builder(architecture: &str, ranks: usize) -> Result<StageBuild, LoadError> {
    PIPELINED
        .iter()
        .find(|(name, _)| *name == architecture)
        .map(|(_, build)| *build)
        .ok_or_else(|| {
            let built: Vec<&str> = PIPELINED.iter().map(|(name, _)| *name).collect();
            LoadError::Config(format!(
                "{architecture} cannot be divided into a pipeline of {ranks} ranks: pipeline \
                 parallelism is built for {} only",
                built.join(", ")
            ))
        })
}

/// This rank's stage of a pipeline over `group` (`crate::distributed::pipeline`): its layers
/// and the model's ends; the other layers' tensors are never read. An architecture that
/// cannot be pipelined is refused before a weight is read.
pub fn load_pipeline_stage(
    dir: &Path,
    reporter: Option<crate::loader::LoadReporter>,
    group: crate::distributed::Group,
) -> Result<Box<dyn CausalLm>, LoadError> {
    let config = loader::read_config(dir)?;
    let (arch, _) = registered(&config)?;
    let build = stage_builder(arch, group.size())?;
    let mut weights = Weights::open(dir, &config)?.with_reporter(reporter);
    let model = build(&config, &mut weights, group)?;
    weights.finish()?;
    Ok(model)
}

/// The first of config.json's `architectures` and its builder in the registry: the one
/// lookup of a model's file, for one engine, a tensor-parallel rank and a pipeline stage.
fn registered(config: &Value) -> Result<(&str, Builder), LoadError> {
    let arch = config
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str)
        .ok_or_else(|| LoadError::Config("missing `architectures` list".into()))?;
    REGISTRY
        .iter()
        .find(|(name, _)| *name == arch)
        .map(|(_, build)| (arch, *build))
        .ok_or_else(|| {
            let known: Vec<&str> = REGISTRY.iter().map(|(n, _)| *n).collect();
            LoadError::Architecture(arch.to_owned(), known.join(", "))
        })
}

/// `eos_token_id` as an int or a list of ints.
pub fn eos_ids(config: &Value) -> Vec<u32> {
    match config.get("eos_token_id") {
        Some(Value::Number(n)) => n.as_u64().map(|n| vec![n as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_u64)
            .map(|n| n as u32)
            .collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod pipeline_tests {
    use super::*;

    #[test]
    fn only_the_families_with_a_stage_builder_form_a_pipeline() {
        for (arch, _) in PIPELINED {
            assert!(stage_builder(arch, 2).is_ok(), "{arch}");
        }
        for arch in [
            "MixtralForCausalLM",
            "Gemma3ForCausalLM",
            "Qwen3NextForCausalLM",
        ] {
            let message = stage_builder(arch, 2).expect_err(arch).to_string();
            assert!(
                message.contains(&format!(
                    "{arch} cannot be divided into a pipeline of 2 ranks"
                )) && message.contains("Qwen3MoeForCausalLM"),
                "{message}"
            );
        }
    }
}
