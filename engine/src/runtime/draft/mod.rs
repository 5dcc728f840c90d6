//! Speculative decoding inside the batch: cheap drafts, verified by one forward pass of the
//! main model for every row, each row with its own draft length and acceptance.
//!
//! - [`ngram`]: prompt-lookup drafts from the row's own text (`--draft ngram`);
//! - [`model`]: drafts from a smaller model with the same tokenizer (`--draft-model`);
//! - [`verify`]: which drafts a pass accepts, and what is rolled back;
//! - [`adaptive`]: which rows are worth drafting for, from their recent acceptance;
//! - [`governor`]: whether the batch drafts at all, from the measured throughput of both
//!   kinds of step.
//!
//! The batch's speculative step (`DecodeBatch::step` with a [`Speculator`]) runs
//! synchronously: the drafts of step `t + 1` depend on the tokens accepted at step `t`. A
//! batch in which no row drafts (all paused by [`adaptive`], or none able to) takes the
//! pipelined step instead.
pub mod adaptive;
pub mod governor;
pub mod model;
pub mod ngram;
pub mod verify;

use std::path::PathBuf;

pub use model::ModelDrafter;
pub use ngram::NgramSizes;

/// Drafts per verification pass when none is given (mlx_lm.server's `--num-draft-tokens`).
pub const DEFAULT_NUM_DRAFT: usize = 3;
/// The most drafts one pass may verify.
pub const MAX_NUM_DRAFT: usize = 16;
/// Default n-gram sizes of prompt lookup.
pub const DEFAULT_NGRAM: NgramSizes = NgramSizes { min: 2, max: 4 };

/// Where drafts come from, as configured.
#[derive(Debug, Clone, PartialEq)]
pub enum DraftSource {
    Ngram(NgramSizes),
    /// A model directory, already resolved and checked to share the main tokenizer.
    Model(PathBuf),
}

/// Speculative decoding, as configured (`--draft`/`--draft-model`, `--num-draft-tokens`).
#[derive(Debug, Clone, PartialEq)]
pub struct Speculation {
    pub source: DraftSource,
    pub num_draft: usize,
}

/// The drafter the MLX thread runs.
pub enum Drafter {
    Ngram(NgramSizes),
    Model(ModelDrafter),
}

/// Counters of drafted and accepted tokens, for `Stats` and `/metrics`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DraftCounts {
    pub drafted: u64,
    pub accepted: u64,
}

/// Speculation as the decode batch runs it.
pub struct Speculator {
    pub drafter: Drafter,
    pub num_draft: usize,
    pub governor: governor::DraftGovernor,
}

impl Speculator {
    pub fn kv_bytes(&self) -> usize {
        match &self.drafter {
            Drafter::Ngram(_) => 0,
            Drafter::Model(m) => m.kv_bytes(),
        }
    }
}
