//! The one place where proxy errors become HTTP responses, in the OpenAI error shape
//! `{"error":{"message","type","param","code"}}` (mirrors `mlxd_protocol::error::ErrorBody`).

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use mlxd_protocol::error::{ErrorBody, ErrorType};

use crate::exit::ExitReport;

#[derive(Debug, Clone, thiserror::Error)]
pub enum ProxyError {
    /// The client sent something we cannot route (their fault).
    #[error("{0}")]
    BadRequest(String),
    #[error("request body exceeds the limit of {limit} bytes{}", got.map(|g| format!(" (content-length {g})")).unwrap_or_default())]
    BodyTooLarge { limit: usize, got: Option<u64> },
    #[error("{0}")]
    NotFound(String),
    #[error("model {requested:?} not found; available models: {}", available.join(", "))]
    ModelNotFound {
        requested: String,
        available: Vec<String>,
    },
    #[error("model {model} needs {needed} bytes of memory ({}) but only {available} bytes ({}) are available within the memory budget of {budget} bytes{}", crate::config::Bytes(*needed), crate::config::Bytes(*available), if retry_after.is_some() { " while other engines are busy" } else { " beside pinned models" })]
    InsufficientMemory {
        model: String,
        needed: u64,
        available: u64,
        budget: u64,
        /// Set when waiting longer could help (busy engines), unset when it cannot.
        retry_after: Option<Duration>,
    },
    #[error("no engine slot for model {model}: all {max_engines} engines (max_engines) are {why}")]
    NoEngineAvailable {
        model: String,
        max_engines: usize,
        why: &'static str,
        retry_after: Option<Duration>,
    },
    #[error("engine for model {model} is {state}; retry in {}s", retry_after.as_secs().max(1))]
    Unavailable {
        model: String,
        state: &'static str,
        retry_after: Duration,
    },
    #[error("request queue for model {model} is full ({capacity} waiting); retry in {}s", retry_after.as_secs().max(1))]
    QueueFull {
        model: String,
        capacity: usize,
        retry_after: Duration,
    },
    /// The request's smallest KV reservation exceeds the configured KV budget: no engine
    /// of this model can ever serve it (the client's fault).
    #[error("max_tokens {max_tokens} needs at least {needed} bytes of KV cache for model {model}, more than its KV budget of {budget} bytes; ask for fewer tokens")]
    ExceedsKvBudget {
        model: String,
        max_tokens: u64,
        needed: u64,
        budget: u64,
    },
    /// It would fit the configured KV budget, but out-of-memory exits halved the budget
    /// for now; it comes back after a stable period.
    #[error("model {model} runs with reduced limits after out-of-memory exits: the request needs at least {needed} bytes of KV cache, the reduced KV budget is {budget} bytes (configured: {}); retry in {}s", configured.map_or("unlimited".to_string(), |c| format!("{c} bytes")), retry_after.as_secs().max(1))]
    LimitsReduced {
        model: String,
        needed: u64,
        budget: u64,
        configured: Option<u64>,
        retry_after: Duration,
    },
    #[error("model {model} already has {limit} requests in flight, the limit of server.max_in_flight_per_model; retry in {}s", retry_after.as_secs().max(1))]
    TooManyInFlight {
        model: String,
        limit: u32,
        retry_after: Duration,
    },
    /// The request's token limit is above `server.max_tokens_limit`.
    #[error(transparent)]
    MaxTokensExceeded(mlxd_protocol::request::LimitExceeded),
    /// The body breaks the request contract (`mlxd_protocol::request`), worded as the
    /// engine words it (400, `param` the field's path).
    #[error(transparent)]
    InvalidRequest(mlxd_protocol::request::FieldError),
    /// The client did not send what it announced in time (408).
    #[error("the {what} did not arrive within the limit of {limit_ms} ms (server.{setting})")]
    RequestTimeout {
        what: &'static str,
        limit_ms: u64,
        setting: &'static str,
    },
    #[error("model {model} has failed after repeated crashes: {cause}")]
    Failed {
        model: String,
        cause: String,
        retry_after: Duration,
    },
    /// The engine the request waited for exited before it was ready; the pool retries the
    /// load after `retry_after` (until the crash limit marks the model failed).
    #[error("model {model} failed to load: {cause}")]
    LoadFailed {
        model: String,
        cause: String,
        retry_after: Duration,
    },
    /// The engine said the load cannot succeed as asked (no such model, a refused option,
    /// a download impossible offline); `cause` says why and what to do. Not retried: the
    /// next attempt comes after the failed cool-down, an admin reset or a reload.
    #[error("model {model} cannot be loaded: {cause}")]
    CannotLoad {
        model: String,
        cause: String,
        retry_after: Duration,
    },
    /// The engine exited while handling the request (upstream's fault, and we know why).
    #[error("engine for model {model} exited during the request: {}", report.summary())]
    EngineCrashed { model: String, report: ExitReport },
    /// The engine died during the request and the request could not be continued on
    /// its successor (transparent resumption, `resume.rs`).
    #[error("engine for model {model} exited during the request ({crash}) and the request could not be resumed: {reason}")]
    NotResumed {
        model: String,
        crash: String,
        reason: String,
    },
    /// The engine connection failed and the engine is still alive.
    #[error("engine for model {model} failed the request: {detail}")]
    Upstream { model: String, detail: String },
    #[error("the server is shutting down")]
    ShuttingDown,
    /// No key, or a key that is not valid (401).
    #[error("{message}")]
    Unauthorized { message: String },
    /// Refused whatever the credentials: foreign Host or Origin, or an API key on an
    /// admin route (403).
    #[error("{message}")]
    Forbidden { code: &'static str, message: String },
    /// A request field with a bad value (400, `param` names the field).
    #[error("{field}: {message}")]
    InvalidField {
        field: &'static str,
        message: String,
    },
    /// A managed job that cannot fit in the memory budget even with every unpinned engine
    /// and every other job gone.
    #[error("the {kind} job needs an estimated {needed} bytes of memory ({}) but at most {available} bytes ({}) can ever be free for it within the memory budget of {budget} bytes, beside pinned models", crate::config::Bytes(*needed), crate::config::Bytes(*available))]
    JobTooLarge {
        kind: &'static str,
        needed: u64,
        available: u64,
        budget: u64,
    },
    /// A job that has already finished cannot be cancelled (409).
    #[error("job {id} has already {state}; nothing to cancel")]
    JobFinished { id: String, state: &'static str },
    #[error("internal error: {0}")]
    Internal(String),
}

/// Which API's error body a route answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorShape {
    /// `{"error":{"message","type","param","code"}}`.
    OpenAi,
    /// `{"type":"error","error":{"type","message"}}`, for `/v1/messages*`.
    Anthropic,
    /// `{"error": "message"}`, for Ollama's `/api/*` (`crate::ollama`).
    Ollama,
}

impl ErrorShape {
    pub fn for_path(path: &str) -> Self {
        if path == "/v1/messages" || path.starts_with("/v1/messages/") {
            Self::Anthropic
        } else if path.starts_with("/api/") {
            Self::Ollama
        } else {
            Self::OpenAi
        }
    }
}

/// Serializes the OpenAI error object (`mlxd_protocol::error::ErrorBody`).
pub fn error_json(
    message: &str,
    kind: ErrorType,
    code: Option<&str>,
    param: Option<&str>,
) -> String {
    let mut body = ErrorBody::typed(kind, message);
    body.error.code = code.map(String::from);
    body.error.param = param.map(String::from);
    serde_json::to_string(&body).unwrap_or_else(|_| String::from("{\"error\":{\"message\":\"unencodable error\",\"type\":\"internal_error\",\"param\":null,\"code\":null}}"))
}

impl ProxyError {
    pub fn status(&self) -> StatusCode {
        match self {
            Self::BadRequest(_) | Self::InvalidField { .. } | Self::InvalidRequest(_) => {
                StatusCode::BAD_REQUEST
            }
            Self::JobTooLarge { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::JobFinished { .. } => StatusCode::CONFLICT,
            Self::Unauthorized { .. } => StatusCode::UNAUTHORIZED,
            Self::Forbidden { .. } => StatusCode::FORBIDDEN,
            Self::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::NotFound(_) | Self::ModelNotFound { .. } => StatusCode::NOT_FOUND,
            Self::InsufficientMemory { .. } | Self::NoEngineAvailable { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Self::ExceedsKvBudget { .. } | Self::MaxTokensExceeded { .. } => {
                StatusCode::BAD_REQUEST
            }
            Self::RequestTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            Self::QueueFull { .. } | Self::TooManyInFlight { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::Unavailable { .. }
            | Self::LimitsReduced { .. }
            | Self::Failed { .. }
            | Self::LoadFailed { .. }
            | Self::CannotLoad { .. }
            | Self::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
            Self::EngineCrashed { .. } | Self::NotResumed { .. } | Self::Upstream { .. } => {
                StatusCode::BAD_GATEWAY
            }
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// `(type, code)` of the OpenAI error object.
    pub fn kind(&self) -> (ErrorType, Option<&'static str>) {
        match self {
            Self::BadRequest(_) | Self::InvalidRequest(_) => (ErrorType::InvalidRequestError, None),
            Self::InvalidField { .. } => (ErrorType::InvalidRequestError, Some("invalid_field")),
            Self::JobTooLarge { .. } => (
                ErrorType::InsufficientResources,
                Some("insufficient_memory"),
            ),
            Self::JobFinished { .. } => (ErrorType::InvalidRequestError, Some("job_finished")),
            Self::Unauthorized { .. } => (ErrorType::AuthenticationError, Some("invalid_api_key")),
            Self::Forbidden { code, .. } => (ErrorType::PermissionError, Some(code)),
            Self::BodyTooLarge { .. } => (ErrorType::InvalidRequestError, Some("body_too_large")),
            Self::NotFound(_) => (ErrorType::NotFoundError, None),
            Self::ModelNotFound { .. } => (ErrorType::InvalidRequestError, Some("model_not_found")),
            Self::InsufficientMemory { .. } => (
                ErrorType::InsufficientResources,
                Some("insufficient_memory"),
            ),
            Self::NoEngineAvailable { .. } => {
                (ErrorType::EngineUnavailable, Some("no_engine_available"))
            }
            Self::Unavailable { .. } => (ErrorType::EngineUnavailable, Some("engine_starting")),
            Self::QueueFull { .. } => (ErrorType::RateLimitError, Some("queue_full")),
            Self::ExceedsKvBudget { .. } => {
                (ErrorType::InvalidRequestError, Some("kv_budget_exceeded"))
            }
            Self::MaxTokensExceeded { .. } => {
                (ErrorType::InvalidRequestError, Some("max_tokens_exceeded"))
            }
            Self::RequestTimeout { .. } => {
                (ErrorType::InvalidRequestError, Some("request_timeout"))
            }
            Self::TooManyInFlight { .. } => (ErrorType::RateLimitError, Some("too_many_requests")),
            Self::LimitsReduced { .. } => (ErrorType::EngineUnavailable, Some("limits_reduced")),
            Self::Failed { .. } => (ErrorType::EngineFailed, Some("engine_failed")),
            Self::LoadFailed { .. } | Self::CannotLoad { .. } => {
                (ErrorType::EngineFailed, Some("load_failed"))
            }
            Self::EngineCrashed { report, .. } if report.cause.is_requested() => {
                (ErrorType::EngineStopped, Some(report.cause.code()))
            }
            Self::EngineCrashed { report, .. } => {
                (ErrorType::EngineCrashed, Some(report.cause.code()))
            }
            Self::NotResumed { .. } => (ErrorType::EngineCrashed, Some("resume_failed")),
            Self::Upstream { .. } => (ErrorType::UpstreamError, None),
            Self::ShuttingDown => (ErrorType::EngineUnavailable, Some("shutting_down")),
            Self::Internal(_) => (ErrorType::InternalError, None),
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Unavailable { retry_after, .. }
            | Self::LimitsReduced { retry_after, .. }
            | Self::TooManyInFlight { retry_after, .. }
            | Self::QueueFull { retry_after, .. }
            | Self::Failed { retry_after, .. }
            | Self::LoadFailed { retry_after, .. }
            | Self::CannotLoad { retry_after, .. } => Some(*retry_after),
            Self::ShuttingDown => Some(Duration::from_secs(5)),
            Self::InsufficientMemory { retry_after, .. }
            | Self::NoEngineAvailable { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    /// The request field at fault, when one is.
    pub fn param(&self) -> Option<&'static str> {
        match self {
            Self::MaxTokensExceeded(e) => Some(e.field),
            Self::ExceedsKvBudget { .. } => Some("max_tokens"),
            Self::ModelNotFound { .. } => Some("model"),
            Self::InvalidField { field, .. } => Some(field),
            _ => None,
        }
    }

    /// The body as a JSON error object.
    pub fn body_json(&self) -> String {
        let (kind, code) = self.kind();
        let param = match self {
            // A path such as `messages[0].role`, not a static name.
            Self::InvalidRequest(e) => e.param.as_deref(),
            other => other.param(),
        };
        error_json(&self.to_string(), kind, code, param)
    }

    /// The body in Anthropic's shape, `{"type":"error","error":{"type","message"}}`,
    /// with Anthropic's error types for the status.
    pub fn anthropic_body_json(&self) -> String {
        let kind = match self.status().as_u16() {
            400 | 422 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            408 | 504 => "timeout_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 => "overloaded_error",
            _ => "api_error",
        };
        serde_json::json!({"type": "error", "error": {"type": kind, "message": self.to_string()}})
            .to_string()
    }

    /// The full HTTP response, in the OpenAI shape.
    pub fn into_response<B: From<Bytes>>(self) -> Response<B> {
        self.into_response_shaped(ErrorShape::OpenAi)
    }

    /// The full HTTP response, in the error shape of the route that failed.
    pub fn into_response_shaped<B: From<Bytes>>(self, shape: ErrorShape) -> Response<B> {
        let body = match shape {
            ErrorShape::OpenAi => self.body_json(),
            ErrorShape::Anthropic => self.anthropic_body_json(),
            ErrorShape::Ollama => serde_json::json!({ "error": self.to_string() }).to_string(),
        };
        let mut resp = Response::new(B::from(Bytes::from(body)));
        *resp.status_mut() = self.status();
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if matches!(self, Self::Unauthorized { .. }) {
            h.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if let Some(after) = self.retry_after() {
            // Whole seconds, rounded up, at least 1.
            let secs = after.as_millis().div_ceil(1000).max(1);
            h.insert(header::RETRY_AFTER, HeaderValue::from(secs as u64));
        }
        resp
    }

    /// The error as one SSE `data:` event, for failures after a stream has started.
    pub fn sse_event(&self) -> Bytes {
        mlxd_ipc::sse::data_event(&self.body_json())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exit::ExitCause;

    #[test]
    fn status_table_and_shape() {
        let cases = [
            (ProxyError::BadRequest("x".into()), 400),
            (
                ProxyError::BodyTooLarge {
                    limit: 1,
                    got: Some(2),
                },
                413,
            ),
            (ProxyError::NotFound("x".into()), 404),
            (
                ProxyError::QueueFull {
                    model: "m".into(),
                    capacity: 1,
                    retry_after: Duration::from_millis(1500),
                },
                429,
            ),
            (
                ProxyError::EngineCrashed {
                    model: "m".into(),
                    report: ExitReport::new(
                        ExitCause::Crash {
                            signal: Some(6),
                            code: None,
                        },
                        vec![],
                    ),
                },
                502,
            ),
            (ProxyError::Internal("x".into()), 500),
            (
                ProxyError::ModelNotFound {
                    requested: "x".into(),
                    available: vec!["a".into()],
                },
                404,
            ),
            (
                ProxyError::InsufficientMemory {
                    model: "m".into(),
                    needed: 10,
                    available: 5,
                    budget: 8,
                    retry_after: None,
                },
                503,
            ),
        ];
        for (e, status) in cases {
            let resp: Response<Bytes> = e.clone().into_response();
            assert_eq!(resp.status().as_u16(), status, "{e}");
            let v: serde_json::Value = serde_json::from_slice(resp.body()).unwrap();
            assert!(v["error"]["message"].is_string());
            assert!(v["error"]["type"].is_string());
            assert!(v["error"].get("code").is_some());
            assert!(v["error"].get("param").is_some());
        }
        let resp: Response<Bytes> = ProxyError::QueueFull {
            model: "m".into(),
            capacity: 1,
            retry_after: Duration::from_millis(1500),
        }
        .into_response();
        assert_eq!(resp.headers()["retry-after"], "2");
    }

    #[test]
    fn ollama_shape() {
        assert_eq!(ErrorShape::for_path("/api/chat"), ErrorShape::Ollama);
        assert_eq!(
            ErrorShape::for_path("/v1/chat/completions"),
            ErrorShape::OpenAi
        );
        let e = ProxyError::QueueFull {
            model: "m".into(),
            capacity: 1,
            retry_after: Duration::from_millis(1500),
        };
        let resp: Response<Bytes> = e.clone().into_response_shaped(ErrorShape::Ollama);
        assert_eq!(resp.status().as_u16(), 429);
        assert_eq!(resp.headers()["retry-after"], "2");
        let v: serde_json::Value = serde_json::from_slice(resp.body()).unwrap();
        assert_eq!(v, serde_json::json!({ "error": e.to_string() }));
    }

    #[test]
    fn messages_quote_limits() {
        let e = ProxyError::BodyTooLarge {
            limit: 10,
            got: Some(11),
        };
        assert_eq!(
            e.to_string(),
            "request body exceeds the limit of 10 bytes (content-length 11)"
        );
    }

    #[test]
    fn pool_errors_quote_numbers() {
        let e = ProxyError::InsufficientMemory {
            model: "big".into(),
            needed: 3 << 30,
            available: 1 << 30,
            budget: 4 << 30,
            retry_after: None,
        };
        assert_eq!(
            e.to_string(),
            "model big needs 3221225472 bytes of memory (3.0 GiB) but only 1073741824 bytes (1.0 GiB) are available within the memory budget of 4294967296 bytes beside pinned models"
        );
        assert_eq!(e.kind().1, Some("insufficient_memory"));
        let e = ProxyError::ModelNotFound {
            requested: "gpt-4".into(),
            available: vec!["a".into(), "b".into()],
        };
        assert_eq!(
            e.to_string(),
            "model \"gpt-4\" not found; available models: a, b"
        );
    }
}
