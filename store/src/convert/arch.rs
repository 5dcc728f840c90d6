//! What the GGUF architectures other than `llama` share: hyper-parameters read under the
//! architecture's own metadata prefix (`qwen3.embedding_length`), a table of every tensor a
//! checkpoint of the architecture may hold and what each becomes, and the plan that
//! [`super::convert_gguf_with`] carries out.
//!
//! llama.cpp's `convert_hf_to_gguf.py` writes these files; each family module here inverts
//! what it does for that architecture (names, layouts, value shifts) and refuses what it cannot
//! invert exactly.
use std::collections::{BTreeMap, BTreeSet};

use serde_json::{json, Map, Value};

use super::gguf::{GgmlType, GgufFile, MetaValue};
use super::ConvertError;

/// Which parameter of a module a tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Param {
    Weight,
    Bias,
}

impl Param {
    pub fn suffix(self) -> &'static str {
        match self {
            Param::Weight => "weight",
            Param::Bias => "bias",
        }
    }
}

/// What a GGUF tensor becomes.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorRole {
    /// Hugging Face / mlx-lm module path, e.g. `model.layers.3.self_attn.q_proj`; the tensor is
    /// `<module>.<param>` (and `<module>.scales`/`.biases` when a quantized weight).
    pub module: String,
    pub param: Param,
    /// Expected shape in Hugging Face order (`[out, in]` for matrices, `[experts, out, in]` for
    /// stacked experts, `[n]` for norms and biases).
    pub shape: Vec<usize>,
    /// Heads whose rows to un-permute (llama's Q and K projections).
    pub unpermute_heads: Option<usize>,
    /// Subtracted from every value (Gemma's norms, which llama.cpp stores as `1 + w`).
    pub shift: f32,
}

impl TensorRole {
    /// A weight or bias stored as it is.
    pub fn plain(module: String, param: Param, shape: Vec<usize>) -> Self {
        Self {
            module,
            param,
            shape,
            unpermute_heads: None,
            shift: 0.0,
        }
    }

    /// The name of the output tensor.
    pub fn output_name(&self) -> String {
        format!("{}.{}", self.module, self.param.suffix())
    }
}

/// Where each GGUF tensor goes: [`super::convert_gguf_with`] asks it for every tensor of the
/// file and for the tensors that must be there.
pub trait TensorMap {
    /// The role of GGUF tensor `name`; `None` for a tensor the hyper-parameters already read
    /// (rope factors), an error naming the tensor for one the architecture does not have.
    fn role(&self, name: &str) -> Result<Option<TensorRole>, ConvertError>;
    /// The GGUF names that must be present.
    fn required(&self) -> Vec<String>;
}

#[derive(Debug)]
struct Entry {
    role: TensorRole,
    required: bool,
}

/// Every tensor an architecture's checkpoint may hold, by GGUF name.
#[derive(Debug)]
pub struct TensorTable {
    arch: String,
    entries: BTreeMap<String, Entry>,
    /// Tensors read as hyper-parameters, not converted.
    metadata: BTreeSet<String>,
}

impl TensorTable {
    pub fn new(arch: &str) -> Self {
        Self {
            arch: arch.to_string(),
            entries: BTreeMap::new(),
            metadata: BTreeSet::new(),
        }
    }

    /// `gguf` (a name without its `.weight`/`.bias`) holds `role`; `required` when every
    /// checkpoint has it.
    pub fn add(&mut self, gguf: &str, role: TensorRole, required: bool) {
        let name = format!("{gguf}.{}", role.param.suffix());
        self.entries.insert(name, Entry { role, required });
    }

    /// A required weight stored as it is.
    pub fn weight(&mut self, gguf: &str, module: String, shape: Vec<usize>) {
        self.add(gguf, TensorRole::plain(module, Param::Weight, shape), true);
    }

    /// The ends of a decoder over `vocab` tokens of width `hidden` as mlx-lm names them: the
    /// token embedding, the final norm's weight, and the output projection, absent when it is
    /// tied to the embedding.
    pub fn embedding_and_head(&mut self, vocab: usize, hidden: usize) {
        self.weight(
            "token_embd",
            "model.embed_tokens".into(),
            vec![vocab, hidden],
        );
        self.weight("output_norm", "model.norm".into(), vec![hidden]);
        self.add(
            "output",
            TensorRole::plain("lm_head".into(), Param::Weight, vec![vocab, hidden]),
            false,
        );
    }

    /// A tensor that the hyper-parameters consumed.
    pub fn metadata(&mut self, gguf: &str) {
        self.metadata.insert(gguf.to_string());
    }
}

impl TensorMap for TensorTable {
    fn role(&self, name: &str) -> Result<Option<TensorRole>, ConvertError> {
        if self.metadata.contains(name) {
            return Ok(None);
        }
        match self.entries.get(name) {
            Some(e) => Ok(Some(e.role.clone())),
            None => Err(ConvertError::UnknownTensor {
                name: name.to_string(),
                arch: self.arch.clone(),
            }),
        }
    }

    fn required(&self) -> Vec<String> {
        self.entries
            .iter()
            .filter(|(_, e)| e.required)
            .map(|(n, _)| n.clone())
            .collect()
    }
}

/// What converting one architecture takes: the config.json fields that come from the
/// hyper-parameters, the tensor table, and what the tokenizer needs.
#[derive(Debug)]
pub struct ArchPlan {
    /// config.json without `tie_word_embeddings`, `torch_dtype`, the token ids and the
    /// quantization, which the conversion adds.
    pub config: Map<String, Value>,
    pub tensors: TensorTable,
    pub context_length: usize,
}

/// Metadata read under an architecture's prefix.
pub struct Meta<'a> {
    pub g: &'a GgufFile,
    pub arch: &'a str,
}

impl Meta<'_> {
    pub fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    /// A required positive integer.
    pub fn usize(&self, k: &str) -> Result<usize, ConvertError> {
        let key = self.key(k);
        let v = self.g.u64(&key)?;
        usize::try_from(v)
            .ok()
            .filter(|&v| v > 0)
            .ok_or_else(|| ConvertError::Unsupported(format!("{key} is {v}; it must be positive")))
    }

    /// An optional positive integer.
    pub fn opt_usize(&self, k: &str) -> Result<Option<usize>, ConvertError> {
        match self.g.opt_u64(&self.key(k))? {
            None => Ok(None),
            Some(_) => self.usize(k).map(Some),
        }
    }

    /// An optional non-negative integer, zero included.
    pub fn opt_u64(&self, k: &str) -> Result<Option<u64>, ConvertError> {
        self.g.opt_u64(&self.key(k))
    }

    /// A required float, as the f32 GGUF stores and llama.cpp computes with.
    pub fn f32(&self, k: &str) -> Result<f32, ConvertError> {
        let key = self.key(k);
        let v = self.g.f64(&key)? as f32;
        if v.is_finite() {
            Ok(v)
        } else {
            Err(ConvertError::Unsupported(format!("{key} is {v}")))
        }
    }

    pub fn opt_f32(&self, k: &str) -> Result<Option<f32>, ConvertError> {
        match self.g.get(&self.key(k)) {
            None => Ok(None),
            Some(_) => self.f32(k).map(Some),
        }
    }

    pub fn opt_str(&self, k: &str) -> Result<Option<&str>, ConvertError> {
        let key = self.key(k);
        match self.g.get(&key) {
            None => Ok(None),
            Some(MetaValue::String(s)) => Ok(Some(s)),
            Some(v) => Err(ConvertError::wrong_type(&key, "string", v)),
        }
    }
}

/// An f32 hyper-parameter as config.json writes it: the shortest decimal that reads back as
/// the same f32 (`1e-6`, not `9.999999974752427e-7`), which mlx-lm and the engine turn into the
/// same f32 llama.cpp uses.
pub fn f32_json(v: f32) -> Value {
    let shortest: f64 = v.to_string().parse().expect("an f32 prints as a number");
    json!(shortest)
}

/// The hyper-parameters every architecture here shares.
#[derive(Debug, Clone, PartialEq)]
pub struct Common {
    pub n_layers: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    /// `rope.freq_base`, else llama.cpp's default of 10000.
    pub rope_theta: f32,
    pub context_length: usize,
    pub vocab_size: usize,
    /// `rope.dimension_count`, when present.
    pub rotary_dims: Option<usize>,
}

impl Common {
    /// Reads and checks them. The head dimension is `attention.key_length`, else
    /// `embedding_length / head_count`; a different `value_length` is refused.
    pub fn read(m: &Meta) -> Result<Self, ConvertError> {
        let hidden_size = m.usize("embedding_length")?;
        let n_heads = m.usize("attention.head_count")?;
        let n_kv_heads = m.opt_usize("attention.head_count_kv")?.unwrap_or(n_heads);
        if !n_heads.is_multiple_of(n_kv_heads) {
            return Err(ConvertError::Unsupported(format!(
                "{} {n_heads} is not a multiple of {} {n_kv_heads}",
                m.key("attention.head_count"),
                m.key("attention.head_count_kv")
            )));
        }
        let head_dim = match m.opt_usize("attention.key_length")? {
            Some(d) => d,
            None if hidden_size.is_multiple_of(n_heads) => hidden_size / n_heads,
            None => {
                return Err(ConvertError::Unsupported(format!(
                    "{} {hidden_size} is not a multiple of {} {n_heads}",
                    m.key("embedding_length"),
                    m.key("attention.head_count")
                )))
            }
        };
        if let Some(v) = m.opt_usize("attention.value_length")? {
            if v != head_dim {
                return Err(ConvertError::Unsupported(format!(
                    "{} {v} differs from the key length {head_dim}",
                    m.key("attention.value_length")
                )));
            }
        }
        let tokens = m.g.array("tokenizer.ggml.tokens")?.len();
        let vocab_size = m.opt_usize("vocab_size")?.unwrap_or(tokens);
        if vocab_size != tokens {
            return Err(ConvertError::Unsupported(format!(
                "{} {vocab_size} differs from the {tokens} tokens in tokenizer.ggml.tokens",
                m.key("vocab_size")
            )));
        }
        Ok(Self {
            n_layers: m.usize("block_count")?,
            hidden_size,
            intermediate_size: m.usize("feed_forward_length")?,
            n_heads,
            n_kv_heads,
            head_dim,
            rms_norm_eps: m.f32("attention.layer_norm_rms_epsilon")?,
            rope_theta: m.opt_f32("rope.freq_base")?.unwrap_or(10_000.0),
            context_length: m.usize("context_length")?,
            vocab_size,
            rotary_dims: m.opt_usize("rope.dimension_count")?,
        })
    }

    /// Refuses a `rope.dimension_count` other than the head dimension (partial rotary
    /// embeddings), for the families whose mlx-lm model rotates whole heads.
    pub fn require_full_rotary(&self, m: &Meta) -> Result<(), ConvertError> {
        match self.rotary_dims {
            Some(r) if r != self.head_dim => Err(ConvertError::Unsupported(format!(
                "{} {r} differs from the head dimension {} (partial rotary embeddings are not supported for {})",
                m.key("rope.dimension_count"),
                self.head_dim,
                m.arch
            ))),
            _ => Ok(()),
        }
    }

    pub fn q_rows(&self) -> usize {
        self.n_heads * self.head_dim
    }

    pub fn kv_rows(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// config.json's fields that every family shares.
    pub fn config(&self, architecture: &str, model_type: &str) -> Map<String, Value> {
        let c = json!({
            "architectures": [architecture],
            "model_type": model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "rms_norm_eps": f32_json(self.rms_norm_eps),
            "max_position_embeddings": self.context_length,
            "vocab_size": self.vocab_size,
            "rope_theta": f32_json(self.rope_theta),
        });
        match c {
            Value::Object(map) => map,
            _ => unreachable!("built as an object"),
        }
    }
}

/// The `rope.scaling.*` keys: `None` when absent or `none`, the linear factor when `linear`
/// and `allow_linear`; any other scaling (YaRN, LongRoPE through these keys) is refused.
pub fn linear_rope_scaling(m: &Meta, allow_linear: bool) -> Result<Option<f32>, ConvertError> {
    let key = m.key("rope.scaling.type");
    match m.opt_str("rope.scaling.type")? {
        None | Some("none") => Ok(None),
        Some("linear") if allow_linear => {
            let factor = m.f32("rope.scaling.factor")?;
            if factor > 0.0 {
                Ok(Some(factor))
            } else {
                Err(ConvertError::Unsupported(format!(
                    "{} is {factor}; a linear rope scaling factor is positive",
                    m.key("rope.scaling.factor")
                )))
            }
        }
        Some(other) => Err(ConvertError::Unsupported(format!(
            "{key} {other:?} is not supported for {} (supported: none{})",
            m.arch,
            if allow_linear { ", linear" } else { "" }
        ))),
    }
}

/// A one-dimensional F32 tensor's values (llama.cpp's rope factor tensors), checked to hold
/// `len` finite values.
pub fn f32_vector(g: &GgufFile, name: &str, len: usize) -> Result<Option<Vec<f32>>, ConvertError> {
    let Some(info) = g.tensors.iter().find(|t| t.name == name) else {
        return Ok(None);
    };
    if info.ggml_type != GgmlType::F32 || info.dims != [len as u64] {
        return Err(ConvertError::Unsupported(format!(
            "{name} is {:?} {:?}; expected F32 [{len}]",
            info.ggml_type, info.dims
        )));
    }
    let values: Vec<f32> = g
        .tensor_data(info)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    if let Some(bad) = values.iter().find(|v| !v.is_finite()) {
        return Err(ConvertError::Unsupported(format!("{name} holds {bad}")));
    }
    Ok(Some(values))
}

/// The tokens that end a generation, beyond `eos`: the file's `eot`/`eom` ids, and the tokens
/// llama.cpp ends a generation at by their text (`<|im_end|>`, `<end_of_turn>`, `<|end|>`, ...),
/// which these families' own `generation_config.json` lists as well. Sorted, without `eos`.
pub fn extra_stop_ids(g: &GgufFile, eos: Option<u32>) -> Result<Vec<u32>, ConvertError> {
    const BY_TEXT: [&str; 7] = [
        "<|im_end|>",
        "<|endoftext|>",
        "<|end|>",
        "<end_of_turn>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|end_of_text|>",
    ];
    let tokens = g.array("tokenizer.ggml.tokens")?;
    let mut ids = BTreeSet::new();
    for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        if let Some(id) = g.opt_u64(key)? {
            if id as usize >= tokens.len() {
                return Err(ConvertError::Tokenizer(format!(
                    "{key} is {id}, outside the vocabulary of {} tokens",
                    tokens.len()
                )));
            }
            ids.insert(id as u32);
        }
    }
    for (id, t) in tokens.iter().enumerate() {
        if matches!(t, MetaValue::String(s) if BY_TEXT.contains(&s.as_str())) {
            ids.insert(id as u32);
        }
    }
    if let Some(e) = eos {
        ids.remove(&e);
    }
    Ok(ids.into_iter().collect())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::super::gguf::tests::GgufBuilder;
    use super::*;

    /// The metadata every architecture's plan reads: hidden 64, 4 heads of 16 (2 KV heads),
    /// FFN 128, 8 tokens, a context of 256; `layers` blocks.
    pub(crate) fn hparams(arch: &str, layers: u32) -> GgufBuilder {
        hparams_with_context(arch, layers, 256)
    }

    pub(crate) fn hparams_with_context(arch: &str, layers: u32, context: u32) -> GgufBuilder {
        let k = |s: &str| format!("{arch}.{s}");
        let mut b = GgufBuilder::default();
        b.kv_str("general.architecture", arch)
            .kv_u32(&k("block_count"), layers)
            .kv_u32(&k("context_length"), context)
            .kv_u32(&k("embedding_length"), 64)
            .kv_u32(&k("feed_forward_length"), 128)
            .kv_u32(&k("attention.head_count"), 4)
            .kv_u32(&k("attention.head_count_kv"), 2)
            .kv_f32(&k("rope.freq_base"), 1_000_000.0)
            .kv_f32(&k("attention.layer_norm_rms_epsilon"), 1e-6)
            .kv_str_array(
                "tokenizer.ggml.tokens",
                &[
                    "<a>",
                    "<|im_end|>",
                    "c",
                    "d",
                    "e",
                    "f",
                    "g",
                    "<end_of_turn>",
                ],
            );
        b
    }

    /// Writes `b` and opens it.
    pub(crate) fn open(b: &GgufBuilder) -> (tempfile::TempDir, GgufFile) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        b.write(&path);
        let g = GgufFile::open(&path).unwrap();
        (dir, g)
    }

    #[test]
    fn f32_json_prints_the_shortest_decimal() {
        assert_eq!(f32_json(1e-6).to_string(), "1e-6");
        assert_eq!(f32_json(1_000_000.0).to_string(), "1000000.0");
        assert_eq!(f32_json(1.08).as_f64().unwrap() as f32, 1.08f32);
    }

    #[test]
    fn common_hyper_parameters_are_checked() {
        let (_d, g) = open(&hparams("qwen3", 2));
        let c = Common::read(&Meta {
            g: &g,
            arch: "qwen3",
        })
        .unwrap();
        assert_eq!((c.head_dim, c.vocab_size, c.n_kv_heads), (16, 8, 2));
        assert_eq!(c.rms_norm_eps, 1e-6);

        let mut b = hparams("qwen3", 2);
        b.kv_u32("qwen3.attention.key_length", 32)
            .kv_u32("qwen3.attention.value_length", 16);
        let (_d, g) = open(&b);
        let e = Common::read(&Meta {
            g: &g,
            arch: "qwen3",
        })
        .unwrap_err();
        assert!(
            e.to_string().contains("qwen3.attention.value_length 16"),
            "{e}"
        );

        let mut b = hparams("qwen3", 2);
        b.kv_u32("qwen3.vocab_size", 9);
        let (_d, g) = open(&b);
        let e = Common::read(&Meta {
            g: &g,
            arch: "qwen3",
        })
        .unwrap_err();
        assert!(e.to_string().contains("qwen3.vocab_size 9"), "{e}");
    }

    #[test]
    fn stop_tokens_come_from_the_metadata_and_llama_cpp_s_end_of_turn_texts() {
        let mut b = hparams("qwen3", 1);
        b.kv_u32("tokenizer.ggml.eot_token_id", 3);
        let (_d, g) = open(&b);
        assert_eq!(extra_stop_ids(&g, Some(1)).unwrap(), vec![3, 7]);
        assert_eq!(extra_stop_ids(&g, Some(7)).unwrap(), vec![1, 3]);
        let mut b = hparams("qwen3", 1);
        b.kv_u32("tokenizer.ggml.eom_token_id", 8);
        let (_d, g) = open(&b);
        assert!(extra_stop_ids(&g, None)
            .unwrap_err()
            .to_string()
            .contains("tokenizer.ggml.eom_token_id is 8"));
    }

    #[test]
    fn rope_scaling_other_than_linear_is_refused() {
        let mut b = hparams("qwen2", 1);
        b.kv_str("qwen2.rope.scaling.type", "yarn")
            .kv_f32("qwen2.rope.scaling.factor", 4.0);
        let (_d, g) = open(&b);
        let m = Meta {
            g: &g,
            arch: "qwen2",
        };
        let e = linear_rope_scaling(&m, true).unwrap_err();
        assert!(
            e.to_string().contains("qwen2.rope.scaling.type \"yarn\""),
            "{e}"
        );
        let mut b = hparams("qwen2", 1);
        b.kv_str("qwen2.rope.scaling.type", "linear")
            .kv_f32("qwen2.rope.scaling.factor", 4.0);
        let (_d, g) = open(&b);
        let m = Meta {
            g: &g,
            arch: "qwen2",
        };
        assert_eq!(linear_rope_scaling(&m, true).unwrap(), Some(4.0));
        assert!(linear_rope_scaling(&m, false).is_err());
    }
}
