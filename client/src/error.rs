//! The client's one error type: what the server said (with its error body), or why no answer
//! came.
use std::time::Duration;

use mlxd_protocol::error::{ErrorBody, ErrorType};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server answered with an error status and its error body.
    #[error("HTTP {status}: {}", body.error.message)]
    Api {
        status: u16,
        body: ErrorBody,
        /// From the `Retry-After` header (429, 503), when the server sent one.
        retry_after: Option<Duration>,
    },
    /// The server answered with an error status but not with an error body.
    #[error("HTTP {status} without an error body: {body}")]
    UnexpectedStatus { status: u16, body: String },
    /// A stream that had started ended with an error event (for example the engine died).
    #[error("the stream failed: {}", .0.error.message)]
    Stream(ErrorBody),
    /// The stream's body ended without the closing `[DONE]`: the answer is incomplete.
    #[error("the stream ended before [DONE]: the response is incomplete")]
    Truncated,
    /// No answer within the configured limit.
    #[error("{what} took longer than the timeout of {limit:?}")]
    Timeout { what: &'static str, limit: Duration },
    /// The server could not be reached.
    #[error("connecting to {target}: {detail}")]
    Connect { target: String, detail: String },
    /// The connection failed after it was made.
    #[error("talking to {target}: {detail}")]
    Transport { target: String, detail: String },
    /// The answer is not what the API promises.
    #[error("unexpected response: {0}")]
    Decode(String),
    /// The request could not be encoded.
    #[error("encoding the request: {0}")]
    Encode(String),
    /// The client was built with settings that cannot work.
    #[error("client configuration: {0}")]
    Config(String),
    /// The in-process engine could not start.
    #[error("starting the in-process engine: {0}")]
    Start(String),
    /// A managed job ended without succeeding ([`crate::TaskClient::wait`]); the job says why
    /// (`state`, `error`).
    #[error("job {} {}: {}", .0.id, .0.state.as_str(), .0.error.as_deref().unwrap_or("no reason given"))]
    Job(Box<mlxd_protocol::jobs::Job>),
    /// The client was closed (in-process: the engine has stopped).
    #[error("the client is closed")]
    Closed,
}

impl ClientError {
    /// The HTTP status, for errors the server answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Api { status, .. } | Self::UnexpectedStatus { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The server's error body, for an error status or a failed stream.
    pub fn body(&self) -> Option<&ErrorBody> {
        match self {
            Self::Api { body, .. } | Self::Stream(body) => Some(body),
            _ => None,
        }
    }

    /// The error `type` of the server's body, when it is one of mlxd's vocabulary.
    pub fn error_type(&self) -> Option<ErrorType> {
        self.body().and_then(ErrorBody::error_type)
    }

    /// The error `code` of the server's body (`model_not_found`, `adapter_in_use`, ...).
    pub fn code(&self) -> Option<&str> {
        self.body().and_then(|b| b.error.code.as_deref())
    }

    /// A 404: the server does not know what the request names (a model, a model's adapter,
    /// an adapter loaded at run time to unload, a job).
    pub fn is_not_found(&self) -> bool {
        self.status() == Some(404)
    }

    /// A 409: the request conflicts with the server's state and may succeed later or under
    /// another name: an adapter name already taken (`adapter_exists`), an adapter in use by
    /// requests in flight (`adapter_in_use`: unload it once they finish), a job that has
    /// already ended.
    pub fn is_conflict(&self) -> bool {
        self.status() == Some(409)
    }
}
