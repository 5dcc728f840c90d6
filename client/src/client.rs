//! [`Client`]: the one implementation of [`CompletionClient`] and [`BatchCompletionClient`]
//! over every transport.
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use mlxd_protocol::error::ErrorBody;
use mlxd_protocol::openai::{ChatCompletionRequest, ChatCompletionResponse, ModelList};

use crate::error::ClientError;
use crate::sse::ChunkReader;
use crate::transport::{Body, HttpTransport, Transport, UnixTransport};
use crate::{BatchCompletionClient, ChunkStream, CompletionClient};

/// The largest JSON answer read (a complete response, an error body).
const MAX_RESPONSE_BYTES: usize = 64 << 20;

/// A handle on one mlxd server, engine socket or in-process engine. Cheap to clone; clones
/// share connections (and, in-process, the engine).
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    transport: Transport,
    timeout: Duration,
    batch_concurrency: usize,
}

/// Settings shared by every transport; [`ClientBuilder::http`], [`ClientBuilder::unix`] and
/// `ClientBuilder::in_process` make the client.
#[derive(Debug, Clone)]
pub struct ClientBuilder {
    api_key: Option<String>,
    connect_timeout: Duration,
    timeout: Duration,
    batch_concurrency: usize,
}

impl Default for ClientBuilder {
    fn default() -> Self {
        Self {
            api_key: None,
            connect_timeout: Duration::from_secs(10),
            timeout: Duration::from_secs(600),
            batch_concurrency: 16,
        }
    }
}

impl ClientBuilder {
    /// The key `mlxd` checks (`--api-key`), sent as `Authorization: Bearer`. HTTP only.
    pub fn api_key(mut self, key: impl Into<String>) -> Self {
        self.api_key = Some(key.into());
        self
    }

    /// The longest wait for a TCP connection (default 10 s).
    pub fn connect_timeout(mut self, limit: Duration) -> Self {
        self.connect_timeout = limit;
        self
    }

    /// For [`CompletionClient::complete`], the longest wait for the whole answer; for
    /// [`CompletionClient::stream`], for the response head and then between two chunks
    /// (default 600 s).
    pub fn timeout(mut self, limit: Duration) -> Self {
        self.timeout = limit;
        self
    }

    /// How many requests of one [`BatchCompletionClient::complete_batch`] are in flight at
    /// once (default 16); the engine batches those it holds into one forward pass.
    pub fn batch_concurrency(mut self, n: usize) -> Self {
        self.batch_concurrency = n.max(1);
        self
    }

    /// HTTP to `mlxd` at `base_url` (`http://127.0.0.1:8080`).
    pub fn http(self, base_url: &str) -> Result<Client, ClientError> {
        let transport =
            HttpTransport::new(base_url, self.api_key.as_deref(), self.connect_timeout)?;
        Ok(self.with(Transport::Http(Box::new(transport))))
    }

    /// A unix socket straight to one `mlxd-engine --unix PATH`.
    pub fn unix(self, socket: impl Into<PathBuf>) -> Result<Client, ClientError> {
        if self.api_key.is_some() {
            return Err(ClientError::Config(
                "an API key is for HTTP to mlxd; an engine's unix socket takes none".into(),
            ));
        }
        Ok(self.with(Transport::Unix(UnixTransport {
            socket: socket.into(),
        })))
    }

    /// Loads a model and runs the engine's runtime inside this process (feature
    /// `in-process`). [`Client::close`] stops it once the requests in flight are done.
    #[cfg(feature = "in-process")]
    pub async fn in_process(
        self,
        model: &str,
        options: crate::in_process::InProcessOptions,
    ) -> Result<Client, ClientError> {
        if self.api_key.is_some() {
            return Err(ClientError::Config(
                "an API key is for HTTP to mlxd; an in-process engine takes none".into(),
            ));
        }
        let transport = crate::in_process::InProcessTransport::start(model, options).await?;
        Ok(self.with(Transport::InProcess(Box::new(transport))))
    }

    fn with(self, transport: Transport) -> Client {
        Client {
            inner: Arc::new(Inner {
                transport,
                timeout: self.timeout,
                batch_concurrency: self.batch_concurrency,
            }),
        }
    }
}

impl Client {
    pub fn builder() -> ClientBuilder {
        ClientBuilder::default()
    }

    /// `GET /v1/models`.
    pub async fn models(&self) -> Result<ModelList, ClientError> {
        self.json(Method::GET, "/v1/models", None).await
    }

    /// Stops using the transport. In-process: new requests get [`ClientError::Closed`], the
    /// requests in flight (streams included) run to their end, then the engine's runtime
    /// stops. Over HTTP or a socket there is nothing to stop.
    pub async fn close(self) {
        match &self.inner.transport {
            #[cfg(feature = "in-process")]
            Transport::InProcess(t) => t.close().await,
            _ => {}
        }
    }

    /// Whether this is an HTTP client (of `mlxd`, whose admin and jobs routes it can use).
    pub(crate) fn is_http(&self) -> bool {
        matches!(self.inner.transport, Transport::Http(_))
    }

    /// Where the transport goes, for error messages.
    pub(crate) fn target(&self) -> String {
        self.inner.transport.target()
    }

    fn timeout_error(&self, what: &'static str) -> ClientError {
        ClientError::Timeout {
            what,
            limit: self.inner.timeout,
        }
    }

    /// Sends one request and returns the response if its status is a success; otherwise the
    /// server's error body as [`ClientError::Api`].
    pub(crate) async fn exchange(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Response<Body>, ClientError> {
        let mut req = Request::builder().method(method).uri(path);
        if body.is_some() {
            req = req.header(header::CONTENT_TYPE, "application/json");
        }
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| ClientError::Encode(e.to_string()))?;
        let resp = tokio::time::timeout(self.inner.timeout, self.inner.transport.send(req))
            .await
            .map_err(|_| self.timeout_error("waiting for the response"))??;
        if resp.status().is_success() {
            return Ok(resp);
        }
        Err(self.error_from(resp).await)
    }

    /// [`Self::exchange`] for a route that answers with server-sent events: a success that is
    /// not a `200` event stream is [`ClientError::Decode`], naming `what` was asked for.
    pub(crate) async fn exchange_events(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
        what: &str,
    ) -> Result<Response<Body>, ClientError> {
        let resp = self.exchange(method, path, body).await?;
        let is_sse = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if resp.status() != StatusCode::OK || !is_sse {
            return Err(ClientError::Decode(format!(
                "{what}: the answer is {} {:?}, not an event stream",
                resp.status(),
                resp.headers().get(header::CONTENT_TYPE)
            )));
        }
        Ok(resp)
    }

    async fn error_from(&self, resp: Response<Body>) -> ClientError {
        let status = resp.status();
        let retry_after = resp
            .headers()
            .get(header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let bytes = match self.read_body(resp.into_body()).await {
            Ok(b) => b,
            Err(e) => return e,
        };
        match serde_json::from_slice::<ErrorBody>(&bytes) {
            Ok(body) => ClientError::Api {
                status: status.as_u16(),
                body,
                retry_after,
            },
            Err(_) => ClientError::UnexpectedStatus {
                status: status.as_u16(),
                body: String::from_utf8_lossy(&bytes).into_owned(),
            },
        }
    }

    /// The whole body, up to [`MAX_RESPONSE_BYTES`], within the timeout.
    async fn read_body(&self, mut body: Body) -> Result<Bytes, ClientError> {
        let read = async {
            let mut buf = BytesMut::new();
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| ClientError::Transport {
                    target: self.inner.transport.target(),
                    detail: e.to_string(),
                })?;
                if let Ok(data) = frame.into_data() {
                    if buf.len() + data.len() > MAX_RESPONSE_BYTES {
                        return Err(ClientError::Decode(format!(
                            "the response is larger than {MAX_RESPONSE_BYTES} bytes"
                        )));
                    }
                    buf.extend_from_slice(&data);
                }
            }
            Ok(buf.freeze())
        };
        tokio::time::timeout(self.inner.timeout, read)
            .await
            .map_err(|_| self.timeout_error("reading the response body"))?
    }

    pub(crate) async fn json<T: serde::de::DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<T, ClientError> {
        let run = async {
            let resp = self.exchange(method, path, body).await?;
            let bytes = self.read_body(resp.into_body()).await?;
            serde_json::from_slice(&bytes).map_err(|e| {
                ClientError::Decode(format!(
                    "{path}: {e}: {}",
                    String::from_utf8_lossy(&bytes[..bytes.len().min(512)])
                ))
            })
        };
        tokio::time::timeout(self.inner.timeout, run)
            .await
            .map_err(|_| self.timeout_error("the whole exchange"))?
    }
}

fn encode(request: &ChatCompletionRequest, stream: bool) -> Result<Vec<u8>, ClientError> {
    let mut request = request.clone();
    request.params.stream = Some(stream);
    if !stream {
        request.params.stream_options = None;
    }
    serde_json::to_vec(&request).map_err(|e| ClientError::Encode(e.to_string()))
}

impl CompletionClient for Client {
    async fn complete(
        &self,
        request: ChatCompletionRequest,
    ) -> Result<ChatCompletionResponse, ClientError> {
        let body = encode(&request, false)?;
        self.json(Method::POST, "/v1/chat/completions", Some(body))
            .await
    }

    async fn stream(&self, request: ChatCompletionRequest) -> Result<ChunkStream, ClientError> {
        let body = encode(&request, true)?;
        let resp = self
            .exchange_events(
                Method::POST,
                "/v1/chat/completions",
                Some(body),
                "a streamed completion",
            )
            .await?;
        let reader = ChunkReader::new(
            resp.into_body(),
            self.inner.timeout,
            self.inner.transport.target(),
        );
        let chunks = futures::stream::unfold(reader, |mut reader| async move {
            reader.next().await.map(|item| (item, reader))
        });
        Ok(Box::pin(chunks) as ChunkStream)
    }
}

impl BatchCompletionClient for Client {
    async fn complete_batch(
        &self,
        requests: Vec<ChatCompletionRequest>,
    ) -> Vec<Result<ChatCompletionResponse, ClientError>> {
        // `buffered` keeps the input order while up to `batch_concurrency` run at once.
        futures::stream::iter(requests.into_iter().map(|r| self.complete(r)))
            .buffered(self.inner.batch_concurrency)
            .collect()
            .await
    }
}
