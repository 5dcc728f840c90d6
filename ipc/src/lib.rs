//! The control channel, the unix-socket HTTP client and SSE framing, shared by `mlxd`
//! (parent side) and every engine (child side, including the test fake engine); and the
//! C heap settings both processes run with (`heap`).

pub mod control;
pub mod frame;
pub mod heap;
pub mod socket;
pub mod sse;
pub mod uds;

pub use frame::FrameError;
