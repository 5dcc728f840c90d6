//! The response body every route of `mlxd` answers with, and the whole-body helper the routes
//! share (named so as not to shadow the `http_body` crate). It is a leaf module (nothing of the crate below it), so the routing in `server.rs`
//! and the route modules it calls (`chat_page`, `auth`, `jobs::api`) all build on it without
//! importing one another.
use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};

/// A boxed, possibly streamed body; its error is `forward::BoxError` (the same type, spelled
/// out here so this module depends on nothing of the crate).
pub type ResponseBody = UnsyncBoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

/// A body that is all there at once.
pub fn full(bytes: impl Into<Bytes>) -> ResponseBody {
    Full::new(bytes.into())
        .map_err(|e| match e {})
        .boxed_unsync()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn full_body_yields_its_bytes_once() {
        let body = full("hello").collect().await.unwrap().to_bytes();
        assert_eq!(body, Bytes::from_static(b"hello"));
    }
}
