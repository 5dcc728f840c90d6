//! The feed-forward half of a decoder block: the trait a block's MLP or mixture of experts
//! implements, and the SwiGLU MLP of the Llama lineage (`down(silu(gate(x)) * up(x))`) with
//! separate gate and up projections or one fused `gate_up_proj` (Phi-3, GLM-4).
use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::layers::{swiglu, Linear};
use super::params::{Parameters, Params};
use super::stacked::{self, Stacked};
use super::switch::SwitchActivation;
use crate::loader::{LoadError, Weights};

/// A block's feed-forward part: `x` `[B, L, D]` → `[B, L, D]`.
pub(crate) trait FeedForward: Parameters + Send {
    fn forward(&self, x: &Array) -> Result<Array, Exception>;

    /// `residual + self.forward(x)`, the block's residual add after this branch; a part whose
    /// output projection can take the add into its own kernel does
    /// ([`Linear::forward_add`]).
    fn forward_add(&self, x: &Array, residual: &Array) -> Result<Array, Exception> {
        residual.add(self.forward(x)?)
    }
}

impl<T: FeedForward + ?Sized> FeedForward for Box<T> {
    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        (**self).forward(x)
    }

    fn forward_add(&self, x: &Array, residual: &Array) -> Result<Array, Exception> {
        (**self).forward_add(x, residual)
    }
}

/// The gated MLP with separate gate and up projections (`<prefix>.{gate,up,down}_proj`):
/// `down(act(up(x), gate(x)))`, SwiGLU unless a family gates otherwise (Gemma's GELU), with
/// the activations the routed experts use.
pub(crate) struct GatedMlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
    pub activation: SwitchActivation,
    /// The gate and up projections' stacked matrix ([`Stacked`]); `None`: two products.
    gate_up: Option<Box<Stacked>>,
}

impl GatedMlp {
    /// The SwiGLU MLP under `prefix`.
    pub fn load(w: &mut Weights, prefix: &str, bias: bool) -> Result<Self, LoadError> {
        Self::load_with(w, prefix, bias, SwitchActivation::SwiGlu)
    }

    /// The MLP under `prefix` gated by `activation`.
    pub fn load_with(
        w: &mut Weights,
        prefix: &str,
        bias: bool,
        activation: SwitchActivation,
    ) -> Result<Self, LoadError> {
        Self::new(
            [
                Linear::load(w, &format!("{prefix}.gate_proj"), bias)?,
                Linear::load(w, &format!("{prefix}.up_proj"), bias)?,
                Linear::load(w, &format!("{prefix}.down_proj"), bias)?,
            ],
            activation,
        )
    }

    /// The MLP of projections `[gate, up, down]`, gated by `activation`, the first two stacked
    /// where they can be.
    pub fn new(
        [mut gate_proj, mut up_proj, down_proj]: [Linear; 3],
        activation: SwitchActivation,
    ) -> Result<Self, LoadError> {
        let gate_up = Stacked::of(&mut [&mut gate_proj, &mut up_proj])?.map(Box::new);
        Ok(Self {
            gate_proj,
            up_proj,
            down_proj,
            activation,
            gate_up,
        })
    }
}

impl GatedMlp {
    /// `act(up(x), gate(x))`, the input of the down projection. A SwiGLU over stacked gate
    /// and up projections takes the activation into a widened adapter pass's kernel
    /// ([`Stacked::widened_swiglu`]).
    fn activated(&self, x: &Array) -> Result<Array, Exception> {
        let layers = [&self.gate_proj, &self.up_proj];
        if let (Some(stack), SwitchActivation::SwiGlu) = (&self.gate_up, self.activation) {
            if let Some(h) = stack.widened_swiglu(x, &layers)? {
                return Ok(h);
            }
        }
        let [gate, up] = stacked::project(self.gate_up.as_deref(), x, layers)?;
        self.activation.apply(&up, &gate)
    }
}

impl FeedForward for GatedMlp {
    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        self.down_proj.forward(&self.activated(x)?)
    }

    fn forward_add(&self, x: &Array, residual: &Array) -> Result<Array, Exception> {
        self.down_proj.forward_add(&self.activated(x)?, residual)
    }
}

impl Parameters for GatedMlp {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.gate_proj)
            .add(&self.up_proj)
            .add(&self.down_proj);
    }
}

/// The SwiGLU MLP with gate and up in one matrix (`<prefix>.gate_up_proj`, gate first) and
/// `<prefix>.down_proj`, neither biased.
pub(crate) struct FusedGatedMlp {
    gate_up_proj: Linear,
    down_proj: Linear,
}

impl FusedGatedMlp {
    pub fn load(w: &mut Weights, prefix: &str) -> Result<Self, LoadError> {
        Ok(Self {
            gate_up_proj: Linear::load(w, &format!("{prefix}.gate_up_proj"), false)?,
            down_proj: Linear::load(w, &format!("{prefix}.down_proj"), false)?,
        })
    }
}

impl FeedForward for FusedGatedMlp {
    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        let halves = self.gate_up_proj.forward(x)?.split_equal(2, -1)?;
        self.down_proj.forward(&swiglu(&halves[0], &halves[1])?)
    }
}

impl Parameters for FusedGatedMlp {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.gate_up_proj).add(&self.down_proj);
    }
}
