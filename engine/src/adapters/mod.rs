//! LoRA and DoRA adapters served beside one base model, applied per row inside the batch.
//!
//! - [`config`]: `adapter_config.json` as mlx-lm writes it (LoRA or DoRA; full fine-tunes
//!   are refused with the reason);
//! - [`dora`]: DoRA's per-output-row rescale, its starting magnitude and its fuse;
//! - [`experts`]: LoRA on expert stacks (each routed pair takes its expert's factors);
//! - [`group`]: the update of linear layers computed as one stacked product, in one product
//!   pair;
//! - [`lora_kernel`]: a served update as two CUDA kernels (decode-sized passes);
//! - [`checkpoint`]: gradient checkpointing of a training step's transformer layers;
//! - [`table`]: the adapters a model holds, the linear layers they apply to, and each forward
//!   pass's choice of adapter per row;
//! - [`widened`]: a served update whose `x @ A` comes out of the base product (a switch);
//! - [`model`]: the loaded model with its table, which the runtime reaches through
//!   [`CausalLm::adapters`](crate::models::CausalLm::adapters).
//!
//! The base model is never reloaded to switch adapters: a row's adapter is a property of the
//! row, and rows of several adapters and rows of none decode in one forward pass.
pub mod checkpoint;
pub mod config;
pub mod dora;
pub mod experts;
pub mod group;
pub mod lora_kernel;
pub mod model;
pub mod table;
pub mod widened;

use std::path::PathBuf;

pub use experts::PairAdapters;
pub use group::GroupUpdate;
pub use table::{
    layer_of, loading_into, site_for, AdapterSummary, AdapterTable, LoraSite, Selected, SiteInfo,
    TrainingDropout, TrainingFactors,
};

/// A loaded adapter, stable while it stays loaded (an adapter loaded again gets a new id).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AdapterId(pub u64);

/// Why an adapter could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum AdapterError {
    #[error("cannot read {path}: {message}")]
    Read { path: PathBuf, message: String },
    /// An adapter kind this engine does not serve, with what to do instead.
    #[error("{0}")]
    Refused(String),
    #[error("invalid adapter: {0}")]
    Invalid(String),
    #[error("an adapter named {0:?} is already loaded")]
    Duplicate(String),
    #[error("this model takes no adapters: {0}")]
    NotAdaptable(String),
    #[error("MLX failed while loading the adapter: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
}

/// Makes `rows` (each batch row's adapter, in order) the selection of `model`'s forward
/// passes while the returned guard lives ([`AdapterTable::select`]); rows without adapters
/// select nothing and cost nothing. A row with an adapter on a model without a table is an
/// error (the server resolves adapter names against the table, so it cannot happen).
pub fn select<'m>(
    model: &'m dyn crate::models::CausalLm,
    rows: impl IntoIterator<Item = Option<AdapterId>>,
) -> Result<Selected<'m>, mlx_rs::error::Exception> {
    let rows: Vec<Option<AdapterId>> = rows.into_iter().collect();
    match model.adapters() {
        Some(table) => table.select(&rows),
        None if rows.iter().all(Option::is_none) => Ok(Selected::none()),
        None => Err(mlx_rs::error::Exception::custom(
            "a row asks for an adapter, but this model holds no adapter table",
        )),
    }
}
