//! Start-up glue for the `mlxd-engine` binary: resolve the model, load it on the MLX thread,
//! serve HTTP on a unix socket, and (under `mlxd`) speak the control channel.
pub mod group;
mod group_launch;
mod load;
mod memory;
mod memory_watch;
mod options;
mod ssh_rank;
mod standalone;
mod start_error;
mod step_watch;
mod supervised;

pub use load::{load, load_in_group, load_reporting, store_event_progress, Engine};
pub use options::{launch_options, runtime_options, DraftChoice, DraftOptions, LaunchOptions};
pub use ssh_rank::exit_when_stdin_closes;
pub use standalone::serve_standalone;
pub use start_error::StartError;
pub use supervised::{run_supervised, worth_reporting};

/// The engine options `mlxd` passes in `Launch.options` (`[server.engine_options]` and a
/// model's `options` in `mlxd.toml`), each with what it takes: the one definition in
/// `mlxd_protocol::engine_options`.
pub use mlxd_protocol::engine_options::KEYS as ENGINE_OPTIONS;
