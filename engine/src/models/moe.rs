//! Mixture-of-experts feed-forward blocks: a [`Router`] picks each token's experts and their
//! weights, [`SwitchGlu`] runs the chosen experts, the outputs are summed by weight, and
//! always-on shared experts add theirs ([`RoutedExperts`]). The routers several families
//! share live here too: the softmax router (Qwen2-MoE, Qwen3-MoE, OLMoE) and DeepSeek-V3's
//! sigmoid router (DeepSeek-V3, Kimi K2, GLM-4.5 MoE); the others are in their family files.
use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{topk_axis, Ellipsis, IndexOp};
use mlx_rs::ops::{argpartition_axis, flatten, sigmoid, softmax_axis, unflatten};
use mlx_rs::{Array, Dtype};

use super::layers::Linear;
use super::mlp::{FeedForward, GatedMlp};
use super::params::{Parameters, Params};
use super::scalar::{scale_by, weak_scalar};
use super::switch::{top_k_of_negated, weighted_sum, SwitchActivation, SwitchGlu};
use crate::loader::{LoadError, Weights};

/// Picks experts: hidden states `[..., D]` → expert ids `[..., k]` (uint32) and their weights
/// `[..., k]`.
pub(crate) trait Router: Parameters + Send {
    fn route(&self, x: &Array) -> Result<(Array, Array), Exception>;
}

/// Experts every token runs besides the routed ones.
pub(crate) enum SharedExperts {
    None,
    /// Added as they are (DeepSeek, GLM-4.5).
    Plain(GatedMlp),
    /// Scaled by `sigmoid(gate(x))` first (Qwen2-MoE's `shared_expert_gate`).
    Gated {
        mlp: GatedMlp,
        gate: Linear,
    },
}

/// A mixture-of-experts block.
pub(crate) struct RoutedExperts<R> {
    pub router: R,
    pub switch_mlp: SwitchGlu,
    pub shared: SharedExperts,
    /// Whether the weighted sum is cast back to the experts' dtype (routers that weigh in
    /// float32 and whose mlx-lm file casts back), else left as the product promotes it.
    pub cast_back: bool,
}

impl<R> RoutedExperts<R> {
    /// `router` over the SwiGLU experts at `<prefix>.switch_mlp` (biased with `bias`), no
    /// shared experts, the sum left uncast.
    pub fn load(w: &mut Weights, prefix: &str, router: R, bias: bool) -> Result<Self, LoadError> {
        Ok(Self {
            router,
            switch_mlp: SwitchGlu::load(
                w,
                &format!("{prefix}.switch_mlp"),
                bias,
                SwitchActivation::SwiGlu,
            )?,
            shared: SharedExperts::None,
            cast_back: false,
        })
    }

    pub fn with_shared(self, shared: SharedExperts) -> Self {
        Self { shared, ..self }
    }

    pub fn cast_back(self) -> Self {
        Self {
            cast_back: true,
            ..self
        }
    }
}

impl<R: Router> FeedForward for RoutedExperts<R> {
    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        let (inds, scores) = self.router.route(x)?;
        let y = self.switch_mlp.forward(x, &inds)?;
        let mut out = weighted_sum(&y, &scores)?;
        if self.cast_back {
            out = out.as_dtype(y.dtype())?;
        }
        match &self.shared {
            SharedExperts::None => Ok(out),
            SharedExperts::Plain(mlp) => out.add(mlp.forward(x)?),
            SharedExperts::Gated { mlp, gate } => {
                let shared = mlp.forward(x)?;
                out.add(sigmoid(gate.forward(x)?)?.multiply(shared)?)
            }
        }
    }
}

impl<R: Router> Parameters for RoutedExperts<R> {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.router).add(&self.switch_mlp);
        match &self.shared {
            SharedExperts::None => {}
            SharedExperts::Plain(mlp) => {
                p.add(mlp);
            }
            SharedExperts::Gated { mlp, gate } => {
                p.add(mlp).add(gate);
            }
        }
    }
}

/// How a router takes the `k` best of its scores (the order of the ids, which fixes the order
/// of the weighted sum, depends on the formula its mlx-lm file uses).
pub(crate) type TopK = fn(&Array, i32) -> Result<Array, Exception>;

/// A precise softmax over all experts, the `k` best, their probabilities (renormalised over
/// the `k` with `renormalize`).
pub(crate) struct SoftmaxRouter {
    pub gate: Linear,
    pub top_k: i32,
    pub select: TopK,
    pub renormalize: bool,
}

impl Router for SoftmaxRouter {
    fn route(&self, x: &Array) -> Result<(Array, Array), Exception> {
        let gates = softmax_axis(self.gate.forward(x)?, -1, true)?;
        let inds = (self.select)(&gates, self.top_k)?;
        let mut scores = gates.take_along_axis(&inds, -1)?;
        if self.renormalize {
            scores = scores.divide(scores.sum_axis(-1, true)?)?;
        }
        Ok((inds, scores))
    }
}

impl Parameters for SoftmaxRouter {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.gate);
    }
}

/// The selection settings of a [`SigmoidRouter`], validated by the family.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GroupSelection {
    pub top_k: i32,
    pub n_group: i32,
    pub topk_group: i32,
    pub routed_scaling_factor: f32,
    pub norm_topk_prob: bool,
}

/// DeepSeek-V3's `MoEGate` (mlx-lm's `group_expert_select`): sigmoid scores in float32; the
/// selection adds the correction bias and, with several groups, keeps the `topk_group`
/// groups whose two best experts score highest; the weights are the uncorrected scores of the
/// chosen experts, normalised when asked, times `routed_scaling_factor`. The weight `[E, D]`
/// is a plain matrix (mlx-lm never quantizes it) and the bias `[E]` stays float32.
pub(crate) struct SigmoidRouter {
    weight: Array,
    e_score_correction_bias: Array,
    selection: GroupSelection,
}

impl SigmoidRouter {
    /// Loads `<prefix>.weight` and `<prefix>.e_score_correction_bias`.
    pub fn load(
        w: &mut Weights,
        prefix: &str,
        selection: GroupSelection,
    ) -> Result<Self, LoadError> {
        Ok(Self {
            weight: w.take(&format!("{prefix}.weight"))?,
            e_score_correction_bias: w.take(&format!("{prefix}.e_score_correction_bias"))?,
            selection,
        })
    }

    /// Zeroes the corrected scores of every group outside the best `topk_group`.
    fn limit_groups(&self, scores: &Array) -> Result<Array, Exception> {
        let GroupSelection {
            n_group,
            topk_group,
            ..
        } = self.selection;
        let grouped = unflatten(scores, -1, &[n_group, -1])?;
        let group_scores = topk_axis(&grouped, 2, -1)?.sum_axis(-1, true)?;
        let dropped = n_group - topk_group;
        if dropped == 0 {
            return flatten(&grouped, -2, -1);
        }
        let group_idx = lowest_groups(&group_scores, dropped)?;
        let zero = weak_scalar(&grouped, 0.0)?;
        flatten(&grouped.put_along_axis(&group_idx, &zero, -2)?, -2, -1)
    }
}

impl Router for SigmoidRouter {
    fn route(&self, x: &Array) -> Result<(Array, Array), Exception> {
        let s = self.selection;
        let gates = x.matmul(self.weight.t())?;
        let scores = sigmoid(gates.as_dtype(Dtype::Float32)?)?;
        let mut corrected = scores.add(&self.e_score_correction_bias)?;
        if s.n_group > 1 {
            corrected = self.limit_groups(&corrected)?;
        }
        let inds = top_k_of_negated(&corrected, s.top_k)?;
        let mut weights = scores.take_along_axis(&inds, -1)?;
        if s.top_k > 1 && s.norm_topk_prob {
            weights = weights.divide(weights.sum_axis(-1, true)?)?;
        }
        Ok((inds, scale_by(&weights, s.routed_scaling_factor)?))
    }
}

impl Parameters for SigmoidRouter {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.weight).add(&self.e_score_correction_bias);
    }
}

/// `argpartition(x, kth=n-1, axis=-2)[..., :n, :]`: the ids of the `n` groups with the lowest
/// scores (`x` `[..., groups, 1]`), the ones a group-limited router zeroes; without gradient,
/// as mlx-lm writes it.
pub(crate) fn lowest_groups(group_scores: &Array, n: i32) -> Result<Array, Exception> {
    mlx_rs::stop_gradient(argpartition_axis(group_scores, n - 1, -2)?.index((Ellipsis, ..n, ..)))
}
