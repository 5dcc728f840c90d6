//! The one place where errors become HTTP responses in OpenAI's error shape.
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlxd_protocol::error::{
    ErrorBody, INVALID_REQUEST_ERROR, SERVER_ERROR, SERVICE_UNAVAILABLE_ERROR,
};

use crate::adapters::AdapterError;
use crate::chat_template::ChatTemplateError;
use crate::runtime::request::{AdapterWorkError, GenerationError};
use crate::tokenizer::TokenizerError;

/// Everything a route can fail with, tagged with whose fault it is.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The request is wrong: 400, naming the field (`param`) where there is one.
    #[error("{message}")]
    Invalid {
        message: String,
        param: Option<String>,
        code: Option<&'static str>,
    },
    /// The body is larger than the server accepts: 413.
    #[error("the request body is larger than {limit} bytes")]
    TooLarge { limit: usize },
    /// No such route: 404.
    #[error("no route for {method} {path}")]
    NotFound { method: String, path: String },
    /// The route exists but not for this method: 405.
    #[error("{method} is not allowed on {path}")]
    MethodNotAllowed { method: String, path: String },
    /// The request's `model` names an adapter this engine does not hold: 404.
    #[error("the model {requested:?} does not exist; available: {}", available.join(", "))]
    UnknownModel {
        requested: String,
        available: Vec<String>,
    },
    /// The MLX thread is gone (shutting down or crashed): 503.
    #[error("the engine is not accepting work: {0}")]
    Unavailable(String),
    /// The MLX thread reported a failure for this request; its kind decides the status.
    #[error("generation failed: {0}")]
    Generation(GenerationError),
    /// Loading or unloading an adapter failed (the admin routes); its kind decides the
    /// status.
    #[error("{0}")]
    Adapter(AdapterWorkError),
    /// A bug or an unexpected state on our side: 500.
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    /// A 400 about `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::Invalid {
            message: message.into(),
            param: Some(param.into()),
            code: None,
        }
    }

    /// A 400 about the request as a whole.
    pub fn invalid_body(message: impl Into<String>) -> Self {
        ApiError::Invalid {
            message: message.into(),
            param: None,
            code: None,
        }
    }

    pub fn with_code(self, code: &'static str) -> Self {
        match self {
            ApiError::Invalid { message, param, .. } => ApiError::Invalid {
                message,
                param,
                code: Some(code),
            },
            other => other,
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Invalid { .. } => StatusCode::BAD_REQUEST,
            ApiError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::NotFound { .. } | ApiError::UnknownModel { .. } => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Generation(e) => match e {
                // The request itself cannot be served as asked: the client's to change.
                GenerationError::KvBudget { .. }
                | GenerationError::Sampling(_)
                | GenerationError::TokenOutOfRange { .. }
                | GenerationError::Unsupported { .. } => StatusCode::BAD_REQUEST,
                // The engine restarts (smaller after running out of memory): try again.
                GenerationError::OutOfMemory(_)
                | GenerationError::DeviceLost(_)
                | GenerationError::Stopped => StatusCode::SERVICE_UNAVAILABLE,
                GenerationError::Mlx(_) | GenerationError::Constraint(_) => {
                    StatusCode::INTERNAL_SERVER_ERROR
                }
                // Unloaded after the request named it: as if it had never been loaded.
                GenerationError::AdapterUnloaded(_) => StatusCode::NOT_FOUND,
            },
            ApiError::Adapter(e) => match e {
                AdapterWorkError::Load(AdapterError::Duplicate(_))
                | AdapterWorkError::InUse { .. } => StatusCode::CONFLICT,
                AdapterWorkError::Unknown { .. } => StatusCode::NOT_FOUND,
                AdapterWorkError::Load(AdapterError::Mlx(_)) => StatusCode::INTERNAL_SERVER_ERROR,
                AdapterWorkError::Load(_)
                | AdapterWorkError::Space { .. }
                | AdapterWorkError::NotAdaptable => StatusCode::BAD_REQUEST,
            },
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The body for this error, also used as the SSE error event.
    pub fn body(&self) -> ErrorBody {
        let kind = match self {
            ApiError::Invalid { .. }
            | ApiError::TooLarge { .. }
            | ApiError::NotFound { .. }
            | ApiError::UnknownModel { .. }
            | ApiError::MethodNotAllowed { .. } => INVALID_REQUEST_ERROR,
            ApiError::Unavailable(_) => SERVICE_UNAVAILABLE_ERROR,
            ApiError::Generation(_) | ApiError::Adapter(_) => match self.status() {
                StatusCode::BAD_REQUEST | StatusCode::NOT_FOUND | StatusCode::CONFLICT => {
                    INVALID_REQUEST_ERROR
                }
                StatusCode::SERVICE_UNAVAILABLE => SERVICE_UNAVAILABLE_ERROR,
                _ => SERVER_ERROR,
            },
            ApiError::Internal(_) => SERVER_ERROR,
        };
        let mut body = ErrorBody::new(kind, self.to_string());
        match self {
            ApiError::Invalid { param, code, .. } => {
                body.error.param = param.clone();
                body.error.code = code.map(str::to_owned);
            }
            ApiError::NotFound { .. } => body.error.code = Some("unknown_url".into()),
            ApiError::UnknownModel { .. } => {
                body.error.code = Some("model_not_found".into());
                body.error.param = Some("model".into());
            }
            ApiError::MethodNotAllowed { .. } => {
                body.error.code = Some("method_not_allowed".into())
            }
            ApiError::TooLarge { .. } => body.error.code = Some("request_too_large".into()),
            ApiError::Generation(e) => {
                let (code, param) = match e {
                    GenerationError::KvBudget { .. } => ("kv_budget_exceeded", Some("max_tokens")),
                    GenerationError::Sampling(_) => ("invalid_sampling", None),
                    GenerationError::TokenOutOfRange { what, .. } => (
                        "token_out_of_range",
                        Some(if *what == "logit_bias" {
                            "logit_bias"
                        } else {
                            "prompt"
                        }),
                    ),
                    GenerationError::OutOfMemory(_) => ("out_of_memory", None),
                    GenerationError::DeviceLost(_) => ("device_error", None),
                    GenerationError::Stopped => ("engine_stopped", None),
                    GenerationError::Mlx(_) => ("mlx_error", None),
                    GenerationError::Constraint(_) => ("constraint_error", None),
                    GenerationError::Unsupported { param, .. } => ("unsupported", *param),
                    GenerationError::AdapterUnloaded(_) => ("model_not_found", Some("model")),
                };
                body.error.code = Some(code.into());
                body.error.param = param.map(str::to_owned);
            }
            ApiError::Adapter(e) => {
                let (code, param) = match e {
                    AdapterWorkError::Load(AdapterError::Read { .. })
                    | AdapterWorkError::Space { .. } => ("adapter_unreadable", Some("path")),
                    AdapterWorkError::Load(AdapterError::Refused(_)) => {
                        ("adapter_refused", Some("path"))
                    }
                    AdapterWorkError::Load(AdapterError::Invalid(m))
                        if m.starts_with("adapter name") =>
                    {
                        ("invalid_adapter_name", Some("name"))
                    }
                    AdapterWorkError::Load(AdapterError::Invalid(_)) => {
                        ("invalid_adapter", Some("path"))
                    }
                    AdapterWorkError::Load(AdapterError::Duplicate(_)) => {
                        ("adapter_exists", Some("name"))
                    }
                    AdapterWorkError::Load(AdapterError::NotAdaptable(_))
                    | AdapterWorkError::NotAdaptable => ("adapters_unsupported", None),
                    AdapterWorkError::Load(AdapterError::Mlx(_)) => ("mlx_error", None),
                    AdapterWorkError::Unknown { .. } => ("adapter_not_found", Some("name")),
                    AdapterWorkError::InUse { .. } => ("adapter_in_use", Some("name")),
                };
                body.error.code = Some(code.into());
                body.error.param = param.map(str::to_owned);
            }
            _ => {}
        }
        body
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::warn!(status = status.as_u16(), error = %self, "request failed");
        } else {
            tracing::debug!(status = status.as_u16(), error = %self, "request rejected");
        }
        let mut response = (status, Json(self.body())).into_response();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        response
    }
}

/// A request that breaks the shared request contract (`mlxd_protocol::request`): a 400
/// naming the field, worded as the proxy words it.
impl From<mlxd_protocol::request::FieldError> for ApiError {
    fn from(e: mlxd_protocol::request::FieldError) -> Self {
        ApiError::Invalid {
            message: e.message,
            param: e.param,
            code: None,
        }
    }
}

impl From<TokenizerError> for ApiError {
    fn from(e: TokenizerError) -> Self {
        match e {
            TokenizerError::NoChatTemplate => ApiError::invalid("messages", e.to_string()),
            TokenizerError::Template(
                ChatTemplateError::Raised(_) | ChatTemplateError::Render(_),
            ) => ApiError::invalid("messages", e.to_string()).with_code("chat_template_error"),
            other => ApiError::Internal(other.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_error_table() {
        let cases = [
            (ApiError::invalid("n", "x"), 400, "invalid_request_error"),
            (
                ApiError::TooLarge { limit: 1 },
                413,
                "invalid_request_error",
            ),
            (
                ApiError::NotFound {
                    method: "GET".into(),
                    path: "/x".into(),
                },
                404,
                "invalid_request_error",
            ),
            (
                ApiError::MethodNotAllowed {
                    method: "GET".into(),
                    path: "/v1/completions".into(),
                },
                405,
                "invalid_request_error",
            ),
            (
                ApiError::Unavailable("gone".into()),
                503,
                "service_unavailable_error",
            ),
            (
                ApiError::Generation(GenerationError::Mlx("device lost".into())),
                500,
                "server_error",
            ),
            (
                ApiError::Generation(GenerationError::OutOfMemory("oom".into())),
                503,
                "service_unavailable_error",
            ),
            (
                ApiError::Generation(GenerationError::KvBudget {
                    needed: 10,
                    budget: 5,
                    prompt_tokens: 1,
                    max_tokens: 9,
                }),
                400,
                "invalid_request_error",
            ),
            (ApiError::Internal("bug".into()), 500, "server_error"),
        ];
        for (err, status, kind) in cases {
            assert_eq!(err.status().as_u16(), status, "{err}");
            assert_eq!(err.body().error.kind, kind, "{err}");
        }
        let body = ApiError::invalid("max_tokens", "too small")
            .with_code("bad")
            .body();
        assert_eq!(body.error.param.as_deref(), Some("max_tokens"));
        assert_eq!(body.error.code.as_deref(), Some("bad"));
        assert_eq!(body.error.message, "too small");
    }

    #[test]
    fn template_errors_are_the_clients_fault() {
        let err: ApiError =
            TokenizerError::Template(ChatTemplateError::Raised("roles must alternate".into()))
                .into();
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
        assert_eq!(
            err.body().error.message,
            "the chat template rejected the messages: roles must alternate"
        );
        let err: ApiError = TokenizerError::Decode("x".into()).into();
        assert_eq!(err.status(), StatusCode::INTERNAL_SERVER_ERROR);
    }
}
