//! `mlxd-client`: call mlxd from Rust the same way whichever way the model is reached.
//!
//! - **HTTP to `mlxd`** ([`ClientBuilder::http`]): API key, connect and response timeouts,
//!   kept-alive connections.
//! - **A unix socket straight to one `mlxd-engine --unix PATH`** ([`ClientBuilder::unix`]).
//! - **In-process** (`ClientBuilder::in_process`, cargo feature `in-process`, which links the
//!   engine and MLX): the engine's runtime runs inside the caller, and [`Client::close`] waits
//!   for the requests in flight before stopping it.
//!
//! Every transport takes the same request ([`ChatCompletionRequest`]) and gives the same
//! result ([`ChatCompletionResponse`], or a stream of [`ChatCompletionChunk`]s), because all
//! three speak the engine's own OpenAI-compatible API. Errors are typed ([`ClientError`]) and
//! carry the server's error body. Requests are never retried: a POST that may have reached
//! the server is not sent again.
//!
//! ```no_run
//! use mlxd_client::{ChatCompletionRequest, ChatMessage, Client, CompletionClient, Role};
//! # async fn run() -> Result<(), mlxd_client::ClientError> {
//! let client = Client::builder().api_key("secret").http("http://127.0.0.1:8080")?;
//! let answer = client
//!     .complete(ChatCompletionRequest {
//!         messages: vec![ChatMessage::new(Role::User, "What is the capital of France?")],
//!         ..Default::default()
//!     })
//!     .await?;
//! println!("{:?}", answer.choices[0].message.content);
//! # Ok(()) }
//! ```
//!
//! Managed jobs on `mlxd` (quantize, convert a GGUF, fetch, fine-tune a LoRA adapter, fuse
//! one into its base; progress, cancel) go through [`TaskClient`]. LoRA adapters are loaded
//! into a model's engine at run time with [`Client::load_adapter`] (listed with
//! [`Client::adapters`], unloaded with [`Client::unload_adapter`]) and then named like a
//! model in any request: `"model": "<model>:<adapter>"`.
//!
//! Runnable examples: `cargo run -p mlxd-client --example http_chat`, `--example unix_chat`,
//! `--example quantize_job`, and `--features in-process --example in_process_chat`.
use std::future::Future;
use std::pin::Pin;

mod adapters;
mod client;
mod error;
#[cfg(feature = "in-process")]
mod in_process;
mod sse;
mod task;
mod transport;

pub use client::{Client, ClientBuilder};
pub use error::ClientError;
#[cfg(feature = "in-process")]
pub use in_process::{InProcessOptions, RuntimeLimits};
pub use mlxd_protocol::adapters::{AdapterObject, ModelAdapter, ModelAdapterList, UnloadedAdapter};
pub use mlxd_protocol::error::{ErrorBody, ErrorType};
pub use mlxd_protocol::jobs::{
    Job, JobKind, JobProgress, JobRequest, JobResult, JobState, LrSchedule, Optimizer, TrainParams,
    TrainingProgress,
};
pub use mlxd_protocol::openai::{
    ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatMessage,
    GenerationParams, ModelList, Role, Usage,
};
pub use task::{JobUpdate, JobUpdates, TaskClient};

/// The chunks of one streaming answer, in order. It ends after the server's `[DONE]`; an
/// error event, a timeout or a body cut short ends it with one `Err`, never silently.
pub type ChunkStream =
    Pin<Box<dyn futures::Stream<Item = Result<ChatCompletionChunk, ClientError>> + Send>>;

/// One chat completion at a time: the whole answer, or its chunks as they are generated.
pub trait CompletionClient {
    /// The complete answer (`stream` is set to false).
    fn complete(
        &self,
        request: ChatCompletionRequest,
    ) -> impl Future<Output = Result<ChatCompletionResponse, ClientError>> + Send;

    /// The answer as a stream of chunks (`stream` is set to true). Dropping the stream
    /// cancels the generation.
    fn stream(
        &self,
        request: ChatCompletionRequest,
    ) -> impl Future<Output = Result<ChunkStream, ClientError>> + Send;
}

/// Many chat completions at once.
pub trait BatchCompletionClient {
    /// One result per request, in the order of `requests`. The implementation chooses how to
    /// group them ([`Client`] keeps up to `batch_concurrency` in flight, which the engine
    /// batches); one failing does not fail the others.
    fn complete_batch(
        &self,
        requests: Vec<ChatCompletionRequest>,
    ) -> impl Future<Output = Vec<Result<ChatCompletionResponse, ClientError>>> + Send;
}
