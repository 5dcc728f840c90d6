//! Wire types shared by `mlxd` and `mlxd-engine`. Plain serde types: no tokio, no hyper.
pub mod adapters;
pub mod anthropic;
pub mod control;
pub mod engine_options;
pub mod error;
pub mod group_hosts;
pub mod jobs;
pub mod openai;
pub mod request;
