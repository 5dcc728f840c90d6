//! The control channel, the unix-socket HTTP client and SSE framing.
