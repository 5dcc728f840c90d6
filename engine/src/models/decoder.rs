//! The decoder the families run: embed the tokens, pass the residual stream through each
//! layer with its cache, normalise, project to logits. A family supplies its layers
//! ([`DecoderLayer`], most often a [`Block`] of its attention and feed-forward parts)
//! and what the two ends differ in ([`Trunk`]: the final norm's kind, a tied or own output
//! head, scalar multipliers on the embeddings and logits).
use std::ops::Range;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};
use serde_json::Value;

use super::attention::SelfAttention;
use super::info::{activation_dtype, model_info_in, KvShape};
use super::layers::{LayerNorm, Matrix, Queries, RmsNorm};
use super::mlp::FeedForward;
use super::params::{Parameters, Params};
use super::scalar::{divide_by, scale_by};
use super::{CausalLm, Feature, ModelInfo};
use crate::cache::{LayerCache, LayerKind};
use crate::distributed::pipeline::StageLink;
use crate::loader::{LoadError, Weights};

/// A norm of the residual stream: `nn.RMSNorm` or `nn.LayerNorm`.
pub(crate) enum Norm {
    Rms(RmsNorm),
    Layer(LayerNorm),
}

impl Norm {
    pub fn forward(&self, x: &Array) -> Result<Array, Exception> {
        match self {
            Norm::Rms(n) => n.forward(x),
            Norm::Layer(n) => n.forward(x),
        }
    }
}

impl Parameters for Norm {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        match self {
            Norm::Rms(n) => p.add(n),
            Norm::Layer(n) => p.add(n),
        };
    }
}

/// Which norm a family uses, with its settings.
#[derive(Debug, Clone, Copy)]
pub(crate) enum NormKind {
    Rms {
        eps: f32,
    },
    /// A LayerNorm with a weight and, with `bias`, a bias.
    Layer {
        eps: f32,
        bias: bool,
    },
}

impl NormKind {
    /// Loads the norm at `prefix`.
    pub fn load(self, w: &mut Weights, prefix: &str) -> Result<Norm, LoadError> {
        Ok(match self {
            NormKind::Rms { eps } => Norm::Rms(RmsNorm::load(w, prefix, eps)?),
            NormKind::Layer { eps, bias } => Norm::Layer(LayerNorm::load(w, prefix, eps, bias)?),
        })
    }
}

/// One layer of a decoder: the residual stream `[B, L, D]` in and out, through its cache.
pub(crate) trait DecoderLayer: Parameters + Send {
    fn forward(&self, h: &Array, cache: &mut LayerCache) -> Result<Array, Exception>;
    /// The last position's output alone `[B, 1, D]`, every position's keys and values (or
    /// state) entering the cache: the last layer of a pass that reads only the last
    /// position's logits. Here the whole output, sliced; [`Block`] runs its attention output
    /// and feed-forward on the last position only.
    fn forward_last(&self, h: &Array, cache: &mut LayerCache) -> Result<Array, Exception> {
        Ok(super::last_position(&self.forward(h, cache)?))
    }
    /// The layer's sliding window ([`CausalLm::layer_windows`]), `None` for a global layer.
    fn window(&self) -> Option<usize> {
        None
    }
    /// What the layer keeps between forward passes ([`CausalLm::layer_kinds`]): keys and
    /// values within its window, unless it is a recurrent layer.
    fn kind(&self) -> LayerKind {
        LayerKind::Attention {
            window: self.window(),
        }
    }
}

/// Where a block normalises its two branches (attention, then feed-forward), with the names
/// the checkpoints give the norms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NormPlacement {
    /// Before each branch (`input_layernorm`, `post_attention_layernorm`): Llama's.
    Pre,
    /// After each branch, before its residual add (`post_attention_layernorm`,
    /// `post_feedforward_layernorm`): OLMo 2, EXAONE 4.
    Post,
    /// Before and after each branch (`input_layernorm`, `post_self_attn_layernorm`,
    /// `post_attention_layernorm`, `post_mlp_layernorm`): GLM-4.
    Sandwich,
}

/// A decoder block: `h + attn(h)`, then `h + mlp(h)`, each branch between the norms its
/// [`NormPlacement`] gives and optionally scaled before the add (Granite's
/// `residual_multiplier`).
pub(crate) struct Block<A, F> {
    pub attn: A,
    pub mlp: F,
    attn_input: Option<Norm>,
    attn_output: Option<Norm>,
    mlp_input: Option<Norm>,
    mlp_output: Option<Norm>,
    pub residual_scale: Option<f32>,
}

impl<A, F: FeedForward> Block<A, F> {
    /// The block around `attn` and `mlp`, with its norms loaded from `<prefix>.<name>`.
    pub fn load(
        w: &mut Weights,
        prefix: &str,
        placement: NormPlacement,
        norm: NormKind,
        attn: A,
        mlp: F,
    ) -> Result<Self, LoadError> {
        let mut load = |name: &str| norm.load(w, &format!("{prefix}.{name}")).map(Some);
        let (attn_input, attn_output, mlp_input, mlp_output) = match placement {
            NormPlacement::Pre => (
                load("input_layernorm")?,
                None,
                load("post_attention_layernorm")?,
                None,
            ),
            NormPlacement::Post => (
                None,
                load("post_attention_layernorm")?,
                None,
                load("post_feedforward_layernorm")?,
            ),
            NormPlacement::Sandwich => (
                load("input_layernorm")?,
                load("post_self_attn_layernorm")?,
                load("post_attention_layernorm")?,
                load("post_mlp_layernorm")?,
            ),
        };
        Ok(Self {
            attn,
            mlp,
            attn_input,
            attn_output,
            mlp_input,
            mlp_output,
            residual_scale: None,
        })
    }

    /// The block with `attend(attn, x, cache)` as its attention branch, for an attention that
    /// takes more than its input (Ministral 3's per-pass temperature).
    pub fn forward_with(
        &self,
        h: &Array,
        cache: &mut LayerCache,
        attend: impl FnOnce(&A, &Array, &mut LayerCache) -> Result<Array, Exception>,
    ) -> Result<Array, Exception> {
        let r = attend(&self.attn, &normed(&self.attn_input, h)?, cache)?;
        self.after_attention(h, &r)
    }

    /// The block from the attention branch's output `r` on: its residual add onto `h` (the
    /// positions `r` has), then the feed-forward branch.
    fn after_attention(&self, h: &Array, r: &Array) -> Result<Array, Exception> {
        let h = self.residual(h, &normed(&self.attn_output, r)?)?;
        let r = self.mlp.forward(&normed(&self.mlp_input, &h)?)?;
        self.residual(&h, &normed(&self.mlp_output, &r)?)
    }

    /// Whether each branch's output goes straight into its residual add (no norm after it,
    /// no residual scale), so that the branch may take the add into its own kernel.
    fn adds_plainly(&self) -> bool {
        self.attn_output.is_none() && self.mlp_output.is_none() && self.residual_scale.is_none()
    }

    /// `x` plus the branch output `r`, scaled first when the block has a residual scale.
    fn residual(&self, x: &Array, r: &Array) -> Result<Array, Exception> {
        match self.residual_scale {
            Some(m) => x.add(scale_by(r, m)?),
            None => x.add(r),
        }
    }
}

/// `x` through `norm`, or unchanged without one.
fn normed(norm: &Option<Norm>, x: &Array) -> Result<Array, Exception> {
    match norm {
        Some(n) => n.forward(x),
        None => Ok(x.clone()),
    }
}

impl<A: SelfAttention, F: FeedForward> DecoderLayer for Block<A, F> {
    fn forward(&self, h: &Array, cache: &mut LayerCache) -> Result<Array, Exception> {
        if self.adds_plainly() {
            // Each branch's output straight into its residual add: the branch may take the
            // add into its output projection's kernel (a widened adapter pass); the same two
            // ops otherwise.
            let h = self
                .attn
                .attend_add(&normed(&self.attn_input, h)?, cache, Queries::All, h)?;
            return self.mlp.forward_add(&normed(&self.mlp_input, &h)?, &h);
        }
        self.forward_with(h, cache, |attn, x, cache| {
            attn.attend(x, cache, Queries::All)
        })
    }

    fn forward_last(&self, h: &Array, cache: &mut LayerCache) -> Result<Array, Exception> {
        // Every position is normalised and projected into keys and values; from the
        // attention output on, the last position alone.
        let x = normed(&self.attn_input, h)?;
        let last = super::last_position(h);
        if self.adds_plainly() {
            let h = self.attn.attend_add(&x, cache, Queries::Last, &last)?;
            return self.mlp.forward_add(&normed(&self.mlp_input, &h)?, &h);
        }
        let r = self.attn.attend(&x, cache, Queries::Last)?;
        self.after_attention(&last, &r)
    }

    fn window(&self) -> Option<usize> {
        self.attn.window()
    }
}

impl<A: Parameters, F: Parameters> Parameters for Block<A, F> {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.attn)
            .add(&self.mlp)
            .add(&self.attn_input)
            .add(&self.attn_output)
            .add(&self.mlp_input)
            .add(&self.mlp_output);
    }
}

/// Where the logits come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Head {
    /// The embedding matrix. A copy of it stored as `lm_head` is dropped, as mlx-lm's
    /// `sanitize` drops it.
    Tied,
    /// The embedding matrix; the checkpoint must not hold an `lm_head` (the family's mlx-lm
    /// file has no `sanitize` that would drop one).
    TiedStrict,
    /// The model's own `lm_head`.
    Own,
}

impl Head {
    /// [`Head::Tied`] or [`Head::Own`], as `tie_word_embeddings` says.
    pub fn tied_if(tie_word_embeddings: bool) -> Self {
        if tie_word_embeddings {
            Head::Tied
        } else {
            Head::Own
        }
    }
}

/// Scalar multipliers at the two ends, each applied as a weak scalar (in the activations'
/// dtype), as mlx-lm applies a Python float.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct EndScalars {
    /// Multiplies the token embeddings (Granite's `embedding_multiplier`).
    pub embedding: Option<f32>,
    /// Divides the logits (Granite's `logits_scaling`).
    pub logits_divisor: Option<f32>,
    /// Multiplies the logits (Cohere's `logit_scale`).
    pub logits_scale: Option<f32>,
}

/// The ends of a decoder: token embedding, final norm and output head.
pub(crate) struct Trunk {
    /// `None` on a pipeline stage that neither embeds tokens nor uses the embedding as its
    /// head ([`Self::load_without_embedding`]).
    embed_tokens: Option<Matrix>,
    /// The activations' dtype, what the embedding gives ([`activation_dtype`]).
    activation: Dtype,
    norm: Norm,
    lm_head: Option<Matrix>,
    scalars: EndScalars,
}

impl Trunk {
    /// Loads `<prefix>model.embed_tokens`, the norm `<prefix>model.norm` and, for
    /// [`Head::Own`], `<prefix>lm_head`.
    pub fn load(
        w: &mut Weights,
        prefix: &str,
        norm: NormKind,
        head: Head,
    ) -> Result<Self, LoadError> {
        Self::load_with_norm(w, prefix, "norm", norm, head)
    }

    /// [`Self::load`] with the final norm named `<prefix>model.<norm_name>` (LFM2's
    /// `embedding_norm`).
    pub fn load_with_norm(
        w: &mut Weights,
        prefix: &str,
        norm_name: &str,
        norm: NormKind,
        head: Head,
    ) -> Result<Self, LoadError> {
        let lm_head = match head {
            Head::Own => Some(Matrix::load(w, &format!("{prefix}lm_head"))?),
            Head::Tied => {
                for suffix in ["weight", "scales", "biases"] {
                    w.discard(&format!("{prefix}lm_head.{suffix}"));
                }
                None
            }
            Head::TiedStrict => None,
        };
        let embed_tokens = Matrix::load(w, &format!("{prefix}model.embed_tokens"))?;
        Ok(Self {
            activation: activation_dtype(&embed_tokens),
            embed_tokens: Some(embed_tokens),
            norm: norm.load(w, &format!("{prefix}model.{norm_name}"))?,
            lm_head,
            scalars: EndScalars::default(),
        })
    }

    /// [`Self::load`] for a pipeline stage that does not embed tokens and has its own head
    /// ([`Head::Own`]): the embedding's tensors are dropped unread, only its dtype is kept.
    pub fn load_without_embedding(
        w: &mut Weights,
        prefix: &str,
        norm: NormKind,
    ) -> Result<Self, LoadError> {
        let embedding = format!("{prefix}model.embed_tokens");
        // A quantized embedding gives its scales' dtype ([`activation_dtype`]).
        let activation = ["scales", "weight"]
            .iter()
            .find_map(|part| w.dtype_of(&format!("{embedding}.{part}")))
            .ok_or_else(|| LoadError::MissingTensors(vec![format!("{embedding}.weight")]))?;
        for part in ["weight", "scales", "biases"] {
            w.discard(&format!("{embedding}.{part}"));
        }
        Ok(Self {
            embed_tokens: None,
            activation,
            lm_head: Some(Matrix::load(w, &format!("{prefix}lm_head"))?),
            norm: norm.load(w, &format!("{prefix}model.norm"))?,
            scalars: EndScalars::default(),
        })
    }

    /// The activations' dtype (what the embedding gives).
    pub fn activation_dtype(&self) -> Dtype {
        self.activation
    }

    fn embedding(&self) -> Result<&Matrix, Exception> {
        self.embed_tokens.as_ref().ok_or_else(|| {
            Exception::custom("this pipeline stage holds no embedding: it receives hidden states")
        })
    }

    pub fn with_scalars(self, scalars: EndScalars) -> Self {
        Self { scalars, ..self }
    }

    /// The embeddings of `tokens` `[B, L]` → `[B, L, D]`.
    pub fn embed(&self, tokens: &Array) -> Result<Array, Exception> {
        let h = self.embedding()?.rows(tokens)?;
        match self.scalars.embedding {
            Some(m) => scale_by(&h, m),
            None => Ok(h),
        }
    }

    /// Logits `[B, L, vocab]` of the last hidden state `h`.
    pub fn logits(&self, h: &Array) -> Result<Array, Exception> {
        let h = self.norm.forward(h)?;
        let head = match &self.lm_head {
            Some(head) => head,
            None => self.embedding()?,
        };
        let mut logits = head.matmul_t(&h)?;
        if let Some(d) = self.scalars.logits_divisor {
            logits = divide_by(&logits, d)?;
        }
        if let Some(s) = self.scalars.logits_scale {
            logits = scale_by(&logits, s)?;
        }
        Ok(logits)
    }

    /// The parameters around `layers`, in load order: embedding, layers, norm, head.
    pub fn push_params_around<'a, P: Parameters + ?Sized>(
        &'a self,
        layers: &'a P,
        p: &mut Params<'a>,
    ) {
        p.add(&self.embed_tokens)
            .add(layers)
            .add(&self.norm)
            .add(&self.lm_head);
    }
}

/// What the blocks and ends of a decoder share, besides their attention and feed-forward
/// parts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stack<'a> {
    /// The prefix of every weight name (Mistral 3 nests its text model under
    /// `language_model.`).
    pub prefix: &'a str,
    pub num_layers: usize,
    pub placement: NormPlacement,
    pub norm: NormKind,
    pub head: Head,
    /// Drops each layer's `self_attn.rotary_emb.inv_freq`, as the Llama lineage's `sanitize`
    /// does (mlx-lm recomputes the frequencies from the config).
    pub drop_rotary_inv_freq: bool,
    pub residual_scale: Option<f32>,
    pub scalars: EndScalars,
}

impl Stack<'_> {
    /// `num_layers` pre-norm blocks with `norm`, weights under `model.`, nothing dropped or
    /// scaled.
    pub fn pre_norm(num_layers: usize, norm: NormKind, head: Head) -> Self {
        Self {
            prefix: "",
            num_layers,
            placement: NormPlacement::Pre,
            norm,
            head,
            drop_rotary_inv_freq: false,
            residual_scale: None,
            scalars: EndScalars::default(),
        }
    }

    /// The Llama lineage's stack: pre-norm blocks with RMS norms of `eps`, precomputed rotary
    /// frequencies dropped.
    pub fn llama_like(num_layers: usize, eps: f32, head: Head) -> Self {
        Self {
            drop_rotary_inv_freq: true,
            ..Self::pre_norm(num_layers, NormKind::Rms { eps }, head)
        }
    }
}

/// Loads the decoder's blocks and ends: layer `i`'s attention is `attention(w, i, prefix)` and
/// its feed-forward part `feed_forward(w, i, prefix)`, with `prefix` the layer's
/// (`model.layers.<i>`); its norms and the ends follow `stack`.
pub(crate) fn load_stack<A, F: FeedForward>(
    w: &mut Weights,
    stack: &Stack<'_>,
    attention: impl FnMut(&mut Weights, usize, &str) -> Result<A, LoadError>,
    feed_forward: impl FnMut(&mut Weights, usize, &str) -> Result<F, LoadError>,
) -> Result<(Trunk, Vec<Block<A, F>>), LoadError> {
    load_stack_layers(w, stack, 0..stack.num_layers, true, attention, feed_forward)
}

/// [`load_stack`] of the blocks `only` (a pipeline stage's, `crate::distributed::pipeline`)
/// and the ends, the embedding only `with_embedding` (else the head must be the model's own);
/// the other layers' tensors must have been discarded.
pub(crate) fn load_stack_layers<A, F: FeedForward>(
    w: &mut Weights,
    stack: &Stack<'_>,
    only: Range<usize>,
    with_embedding: bool,
    mut attention: impl FnMut(&mut Weights, usize, &str) -> Result<A, LoadError>,
    mut feed_forward: impl FnMut(&mut Weights, usize, &str) -> Result<F, LoadError>,
) -> Result<(Trunk, Vec<Block<A, F>>), LoadError> {
    let mut layers = Vec::with_capacity(only.len());
    for i in only {
        let p = format!("{}model.layers.{i}", stack.prefix);
        let attn = attention(w, i, &p)?;
        let mlp = feed_forward(w, i, &p)?;
        let mut block = Block::load(w, &p, stack.placement, stack.norm, attn, mlp)?;
        block.residual_scale = stack.residual_scale;
        layers.push(block);
        if stack.drop_rotary_inv_freq {
            w.discard(&format!("{p}.self_attn.rotary_emb.inv_freq"));
        }
    }
    let trunk = if with_embedding || stack.head != Head::Own {
        Trunk::load(w, stack.prefix, stack.norm, stack.head)?
    } else {
        Trunk::load_without_embedding(w, stack.prefix, stack.norm)?
    };
    Ok((trunk.with_scalars(stack.scalars), layers))
}

/// The sizes a decoder reports in its [`ModelInfo`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sizes {
    pub vocab_size: usize,
    pub context_length: usize,
    pub kv: KvShape,
}

/// A decoder of a family's layers.
pub(crate) struct Decoder<L> {
    trunk: Trunk,
    layers: Vec<L>,
    info: ModelInfo,
    /// The family's reasons to refuse runtime options.
    refusals: Vec<(Feature, String)>,
    /// In a pipeline, this rank's link to the others: `layers` are then its stage's only.
    link: Option<StageLink>,
}

impl<L: DecoderLayer + 'static> Decoder<L> {
    /// The decoder of `layers` between the ends of `trunk`; its [`ModelInfo`] from `config`
    /// and `sizes`.
    pub fn new(config: &Value, trunk: Trunk, layers: Vec<L>, sizes: Sizes) -> Self {
        let info = model_info_in(
            config,
            sizes.vocab_size,
            sizes.context_length,
            sizes.kv,
            trunk.activation_dtype(),
        );
        Self {
            trunk,
            layers,
            info,
            refusals: Vec::new(),
            link: None,
        }
    }

    /// The decoder of one pipeline stage: `layers` are the stage's (its caches hold them
    /// only), the hidden states come from and go to the neighbouring ranks through `link`.
    /// The KV bytes per token stay those `sizes` gave (the largest stage's, the same on
    /// every rank).
    pub fn in_pipeline(mut self, link: StageLink) -> Self {
        self.info.num_layers = self.layers.len();
        self.link = Some(link);
        self
    }

    /// A decoder whose recurrent layers hold `bytes` of state per sequence
    /// ([`ModelInfo::state_bytes_per_sequence`]).
    pub fn with_state_bytes(mut self, bytes: usize) -> Self {
        self.info.state_bytes_per_sequence = bytes;
        self
    }

    /// Refuses `feature` with `reason` (see [`CausalLm::refuses`]).
    pub fn refusing(mut self, feature: Feature, reason: String) -> Self {
        self.refusals.push((feature, reason));
        self
    }

    /// Materializes every parameter (counting the bytes held) and boxes the model.
    pub fn finish(mut self, w: &Weights) -> Result<Box<dyn CausalLm>, LoadError> {
        let mut p = Params::default();
        self.trunk.push_params_around(&self.layers, &mut p);
        let bytes = p.materialize(w.reporter())?;
        self.info.weight_bytes = bytes;
        Ok(Box::new(self))
    }
}

impl<L: DecoderLayer + 'static> CausalLm for Decoder<L> {
    fn hidden(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        let mut h = match &self.link {
            Some(link) if !link.stage.is_first() => link.receive(tokens)?,
            _ => self.trunk.embed(tokens)?,
        };
        for (i, (layer, cache)) in self.layers.iter().zip(caches.iter_mut()).enumerate() {
            // A training step with --grad-checkpoint recomputes the layer in its backward pass.
            h = crate::adapters::checkpoint::layer(i, &h, cache, layer, L::forward)?;
        }
        if let Some(link) = &self.link {
            h = link.pass_on(h)?;
        }
        Ok(h)
    }

    fn head(&self, hidden: &Array) -> Result<Array, Exception> {
        self.trunk.logits(hidden)
    }

    fn forward_last(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        let Some((last, layers)) = self.layers.split_last().filter(|_| self.link.is_none()) else {
            // A pipeline stage passes every position on (and an empty model has no last
            // layer): the whole pass, then the last position.
            return self.head(&super::last_position(&self.hidden(tokens, caches)?));
        };
        let [before @ .., last_cache] = caches else {
            return Err(Exception::custom("a forward pass without layer caches"));
        };
        if before.len() != layers.len() {
            return Err(Exception::custom(format!(
                "{} layer caches for {} layers",
                caches.len(),
                self.layers.len()
            )));
        }
        let mut h = self.trunk.embed(tokens)?;
        for (layer, cache) in layers.iter().zip(before.iter_mut()) {
            h = layer.forward(&h, cache)?;
        }
        self.head(&last.forward_last(&h, last_cache)?)
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn layer_windows(&self) -> Vec<Option<usize>> {
        self.layers.iter().map(DecoderLayer::window).collect()
    }

    fn layer_kinds(&self) -> Vec<LayerKind> {
        self.layers.iter().map(DecoderLayer::kind).collect()
    }

    fn refuses(&self, feature: Feature) -> Option<String> {
        self.refusals
            .iter()
            .find(|(f, _)| *f == feature)
            .map(|(_, reason)| reason.clone())
    }
}
