//! How a request reaches a model: HTTP to `mlxd`, a unix socket to one `mlxd-engine`, or the
//! engine's router in this process. Each sends one request and returns the response head
//! with a streaming body; everything above (JSON, SSE, errors, timeouts) is shared.
use std::path::PathBuf;

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::error::ClientError;

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// A response body from any transport.
pub(crate) type Body = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

pub(crate) enum Transport {
    Http(Box<HttpTransport>),
    Unix(UnixTransport),
    #[cfg(feature = "in-process")]
    InProcess(Box<crate::in_process::InProcessTransport>),
}

impl Transport {
    /// Where requests go, for error messages.
    pub(crate) fn target(&self) -> String {
        match self {
            Self::Http(t) => t.base.clone(),
            Self::Unix(t) => t.socket.display().to_string(),
            #[cfg(feature = "in-process")]
            Self::InProcess(t) => t.target(),
        }
    }

    /// Sends `req` (origin-form path, body in memory). Never retried: a POST that may have
    /// reached the server is not sent twice.
    pub(crate) fn send(
        &self,
        req: Request<Full<Bytes>>,
    ) -> futures::future::BoxFuture<'_, Result<Response<Body>, ClientError>> {
        match self {
            Self::Http(t) => Box::pin(t.send(req)),
            Self::Unix(t) => Box::pin(t.send(req)),
            #[cfg(feature = "in-process")]
            Self::InProcess(t) => Box::pin(t.send(req)),
        }
    }
}

/// HTTP/1.1 over TCP to `mlxd`, keeping connections alive between requests.
pub(crate) struct HttpTransport {
    /// `http://host:port` plus any path prefix, without a trailing slash.
    pub(crate) base: String,
    client: hyper_util::client::legacy::Client<HttpConnector, Full<Bytes>>,
    api_key: Option<HeaderValue>,
}

impl HttpTransport {
    pub(crate) fn new(
        base_url: &str,
        api_key: Option<&str>,
        connect_timeout: std::time::Duration,
    ) -> Result<Self, ClientError> {
        let uri: http::Uri = base_url
            .parse()
            .map_err(|e| ClientError::Config(format!("base URL {base_url:?}: {e}")))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(other) => {
                return Err(ClientError::Config(format!(
                    "base URL {base_url:?}: scheme {other} is not supported; mlxd serves plain \
                     http (put TLS in front of it and use its http side)"
                )))
            }
            None => {
                return Err(ClientError::Config(format!(
                    "base URL {base_url:?} needs a scheme, e.g. http://127.0.0.1:8080"
                )))
            }
        }
        if uri.authority().is_none() {
            return Err(ClientError::Config(format!(
                "base URL {base_url:?} has no host"
            )));
        }
        if uri.query().is_some() {
            return Err(ClientError::Config(format!(
                "base URL {base_url:?} must not have a query"
            )));
        }
        let api_key = api_key
            .map(|k| {
                let mut v = HeaderValue::from_str(&format!("Bearer {k}")).map_err(|_| {
                    ClientError::Config("the API key holds characters a header cannot carry".into())
                })?;
                v.set_sensitive(true);
                Ok::<_, ClientError>(v)
            })
            .transpose()?;
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(connect_timeout));
        connector.set_nodelay(true);
        let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            // hyper retries a request whose pooled connection closed before it was written;
            // a POST that may have reached the server must never be sent twice.
            .retry_canceled_requests(false)
            .build(connector);
        Ok(Self {
            base: base_url.trim_end_matches('/').to_owned(),
            client,
            api_key,
        })
    }

    async fn send(&self, req: Request<Full<Bytes>>) -> Result<Response<Body>, ClientError> {
        let (mut parts, body) = req.into_parts();
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        parts.uri = format!("{}{path}", self.base)
            .parse()
            .map_err(|e| ClientError::Config(format!("request URI: {e}")))?;
        if let Some(key) = &self.api_key {
            parts
                .headers
                .insert(http::header::AUTHORIZATION, key.clone());
        }
        let resp = self
            .client
            .request(Request::from_parts(parts, body))
            .await
            .map_err(|e| {
                let detail = error_chain(&e);
                if e.is_connect() {
                    ClientError::Connect {
                        target: self.base.clone(),
                        detail,
                    }
                } else {
                    ClientError::Transport {
                        target: self.base.clone(),
                        detail,
                    }
                }
            })?;
        Ok(resp.map(|b| b.map_err(|e| -> BoxError { Box::new(e) }).boxed_unsync()))
    }
}

/// HTTP/1.1 over a unix socket to one `mlxd-engine` (`--unix PATH`); a connection per
/// request, so dropping a stream closes it and the engine cancels the generation.
pub(crate) struct UnixTransport {
    pub(crate) socket: PathBuf,
}

impl UnixTransport {
    async fn send(&self, mut req: Request<Full<Bytes>>) -> Result<Response<Body>, ClientError> {
        req.headers_mut()
            .insert(http::header::HOST, HeaderValue::from_static("localhost"));
        let resp = mlxd_ipc::uds::send(&self.socket, req)
            .await
            .map_err(|e| match e {
                mlxd_ipc::uds::UdsError::Connect { path, source } => ClientError::Connect {
                    target: path,
                    detail: source.to_string(),
                },
                other => ClientError::Transport {
                    target: self.socket.display().to_string(),
                    detail: error_chain(&other),
                },
            })?;
        Ok(resp.map(|b| b.map_err(|e| -> BoxError { Box::new(e) }).boxed_unsync()))
    }
}

/// An error and its sources, `: `-separated (hyper's top-level messages alone say little).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        let text = inner.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        source = inner.source();
    }
    s
}
