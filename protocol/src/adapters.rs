//! The admin API's adapter objects: `POST /admin/adapters` (engine) and `POST
//! /admin/models/{id}/adapters` (mlxd) take an [`AdapterLoad`] and answer an
//! [`AdapterObject`]; the engine's `GET` answers an [`AdapterList`], mlxd's a
//! [`ModelAdapterList`] (configured adapters and those loaded at run time); mlxd's `DELETE`
//! answers an [`UnloadedAdapter`].
use serde::{Deserialize, Serialize};

/// `object` of an [`AdapterObject`].
pub const OBJECT_ADAPTER: &str = "adapter";

/// Load the mlx-lm adapter directory `path` under `name`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdapterLoad {
    pub name: String,
    /// The adapter's directory (`adapter_config.json` + `adapters.safetensors`), as the
    /// engine's process sees it: absolute, or relative to its working directory.
    pub path: String,
}

/// A loaded adapter.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdapterObject {
    pub object: String,
    /// How requests name it: `<model>:<name>`.
    pub id: String,
    pub name: String,
    /// The model it applies to.
    pub parent: String,
    pub path: String,
    /// `lora` or `dora`, as mlx-lm's `fine_tune_type` (absent from servers before it was
    /// reported: `lora`, the only kind they served).
    #[serde(default = "lora")]
    pub fine_tune_type: String,
    pub rank: usize,
    pub scale: f32,
    /// Linear layers it changes.
    pub layers: usize,
}

fn lora() -> String {
    "lora".into()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdapterList {
    pub object: String,
    pub data: Vec<AdapterObject>,
}

/// One adapter of a model as mlxd lists it (`GET /admin/models/{id}/adapters`): mlxd knows
/// where each came from, not its factors (those are the engine's, in [`AdapterObject`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelAdapter {
    /// How requests name it: `<model>:<name>`.
    pub id: String,
    pub name: String,
    /// The model it applies to.
    pub parent: String,
    /// Its directory, as the engine loads it.
    pub path: String,
    /// Loaded at run time (`POST`, and unloadable by `DELETE`), not configured.
    pub runtime: bool,
}

/// `GET /admin/models/{id}/adapters`: the configured adapters first, then those loaded at
/// run time in load order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelAdapterList {
    pub object: String,
    /// The model's id (the path may have named an alias).
    pub model: String,
    pub data: Vec<ModelAdapter>,
}

/// `DELETE /admin/models/{id}/adapters/{name}`: the adapter that is no longer served. When
/// the model's engine was running the answer is its [`AdapterObject`], of which these are
/// the fields mlxd always has.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UnloadedAdapter {
    pub object: String,
    /// `<model>:<name>`.
    pub id: String,
    pub name: String,
    pub parent: String,
}
