//! The control channel, the unix-socket HTTP client and SSE framing, shared by `mlxd`
//! (parent side) and every engine (child side, including the test fake engine).

pub mod control;
pub mod frame;
pub mod socket;
pub mod sse;
pub mod uds;

pub use frame::FrameError;
