//! The OpenAI error body: `{"error": {"message", "type", "param", "code"}}`.
//!
//! Every error response of the HTTP API — from the proxy or from an engine — has this shape,
//! and so has the error event sent in the middle of an SSE stream.
use serde::{Deserialize, Serialize};

/// `type` of an error caused by the request (status 400, 404, 405, 413, 422).
pub const INVALID_REQUEST_ERROR: &str = "invalid_request_error";
/// `type` of an error on our side (status 500, 502, 504).
pub const SERVER_ERROR: &str = "server_error";
/// `type` of a refusal because the service is busy or not ready (status 429, 503).
pub const SERVICE_UNAVAILABLE_ERROR: &str = "service_unavailable_error";

/// The one vocabulary of error `type`s, for the proxy, the engine and the fake engine.
/// The first three are OpenAI's; the rest say which side failed and how, so clients and
/// the proxy can act on the type instead of parsing messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorType {
    /// The request is at fault (400, 404 for an unknown model, 408, 413, 422).
    InvalidRequestError,
    /// Our side failed (500, 502, 504).
    ServerError,
    /// Busy or not ready (503).
    ServiceUnavailableError,
    /// No or wrong API key (401).
    AuthenticationError,
    /// Not allowed whatever the key: foreign Host or Origin, admin-only route (403).
    PermissionError,
    /// No such route or resource (404).
    NotFoundError,
    /// A queue or in-flight limit is full (429).
    RateLimitError,
    /// The model's engine is starting, restarting, draining or queued for (503).
    EngineUnavailable,
    /// The model failed repeatedly and waits for a reset or cool-down (503).
    EngineFailed,
    /// The engine died during the request (502 or an SSE error event).
    EngineCrashed,
    /// The engine was stopped on purpose during the request.
    EngineStopped,
    /// Not enough memory or engine slots for the model (503).
    InsufficientResources,
    /// The engine connection failed, the engine still alive (502).
    UpstreamError,
    /// A bug: an invariant did not hold (500).
    InternalError,
}

impl ErrorType {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidRequestError => INVALID_REQUEST_ERROR,
            Self::ServerError => SERVER_ERROR,
            Self::ServiceUnavailableError => SERVICE_UNAVAILABLE_ERROR,
            Self::AuthenticationError => "authentication_error",
            Self::PermissionError => "permission_error",
            Self::NotFoundError => "not_found_error",
            Self::RateLimitError => "rate_limit_error",
            Self::EngineUnavailable => "engine_unavailable",
            Self::EngineFailed => "engine_failed",
            Self::EngineCrashed => "engine_crashed",
            Self::EngineStopped => "engine_stopped",
            Self::InsufficientResources => "insufficient_resources",
            Self::UpstreamError => "upstream_error",
            Self::InternalError => "internal_error",
        }
    }
}

impl std::fmt::Display for ErrorType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The whole error body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// What went wrong, and which request field (if any) is to blame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// Human-readable; quotes the offending value and the limit it broke.
    pub message: String,
    /// One of the `*_ERROR` constants of this module (OpenAI's `type`).
    #[serde(rename = "type")]
    pub kind: String,
    /// The request field at fault, e.g. `max_tokens` or `messages[1].role`.
    #[serde(default)]
    pub param: Option<String>,
    /// A short machine-readable code, e.g. `context_length_exceeded`.
    #[serde(default)]
    pub code: Option<String>,
}

impl ErrorBody {
    pub fn new(kind: &str, message: impl Into<String>) -> Self {
        Self {
            error: ErrorDetail {
                message: message.into(),
                kind: kind.to_owned(),
                param: None,
                code: None,
            },
        }
    }

    /// An error of one of the shared [`ErrorType`]s.
    pub fn typed(kind: ErrorType, message: impl Into<String>) -> Self {
        Self::new(kind.as_str(), message)
    }

    /// The [`ErrorType`] of `kind`, if it is one of the vocabulary.
    pub fn error_type(&self) -> Option<ErrorType> {
        serde_json::from_value(serde_json::Value::String(self.error.kind.clone())).ok()
    }

    /// A 4xx error caused by the request.
    pub fn invalid_request(message: impl Into<String>) -> Self {
        Self::new(INVALID_REQUEST_ERROR, message)
    }

    /// A 5xx error on the server's side.
    pub fn server_error(message: impl Into<String>) -> Self {
        Self::new(SERVER_ERROR, message)
    }

    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.error.param = Some(param.into());
        self
    }

    pub fn with_code(mut self, code: impl Into<String>) -> Self {
        self.error.code = Some(code.into());
        self
    }
}

impl std::fmt::Display for ErrorBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.error.kind, self.error.message)?;
        if let Some(param) = &self.error.param {
            write!(f, " (param {param})")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn serializes_in_openai_shape_with_nulls() {
        let body = ErrorBody::invalid_request("bad");
        assert_eq!(
            serde_json::to_value(&body).unwrap(),
            json!({"error": {"message": "bad", "type": "invalid_request_error", "param": null, "code": null}})
        );
    }

    #[test]
    fn param_and_code_round_trip() {
        let body = ErrorBody::invalid_request("too long")
            .with_param("messages")
            .with_code("context_length_exceeded");
        let text = serde_json::to_string(&body).unwrap();
        let back: ErrorBody = serde_json::from_str(&text).unwrap();
        assert_eq!(back, body);
        assert_eq!(back.error.param.as_deref(), Some("messages"));
    }

    #[test]
    fn the_type_vocabulary_round_trips_through_its_names() {
        for t in [
            ErrorType::InvalidRequestError,
            ErrorType::ServerError,
            ErrorType::ServiceUnavailableError,
            ErrorType::AuthenticationError,
            ErrorType::PermissionError,
            ErrorType::NotFoundError,
            ErrorType::RateLimitError,
            ErrorType::EngineUnavailable,
            ErrorType::EngineFailed,
            ErrorType::EngineCrashed,
            ErrorType::EngineStopped,
            ErrorType::InsufficientResources,
            ErrorType::UpstreamError,
            ErrorType::InternalError,
        ] {
            assert_eq!(serde_json::to_value(t).unwrap(), json!(t.as_str()));
            let body = ErrorBody::typed(t, "m");
            assert_eq!(body.error_type(), Some(t));
        }
        assert_eq!(ErrorBody::new("something_else", "m").error_type(), None);
    }

    #[test]
    fn deserializes_without_optional_fields() {
        let body: ErrorBody =
            serde_json::from_str(r#"{"error":{"message":"m","type":"server_error"}}"#).unwrap();
        assert_eq!(body, ErrorBody::server_error("m"));
        assert_eq!(body.to_string(), "server_error: m");
    }
}
