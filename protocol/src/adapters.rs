//! The admin API's adapter objects: `POST /admin/adapters` (engine) and `POST
//! /admin/models/{id}/adapters` (mlxd) take an [`AdapterLoad`] and answer an
//! [`AdapterObject`]; the `GET`s answer an [`AdapterList`].
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
    pub rank: usize,
    pub scale: f32,
    /// Linear layers it changes.
    pub layers: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdapterList {
    pub object: String,
    pub data: Vec<AdapterObject>,
}
