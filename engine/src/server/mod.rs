//! The engine's HTTP API (OpenAI-compatible) on a unix socket.
//!
//! Handlers tokenize, render chat templates and validate on the tokio side, send a
//! [`GenerateRequest`](crate::runtime::request::GenerateRequest) to the MLX thread through a
//! [`WorkSender`], and turn the [`TokenEvent`](crate::runtime::request::TokenEvent)s that come back into
//! JSON or SSE responses. Routes:
//!
//! - `POST /v1/chat/completions`, `POST /v1/completions` (JSON or SSE with `"stream": true`)
//! - `POST /v1/messages` (Anthropic Messages, JSON or SSE), `POST /v1/messages/count_tokens`
//! - `GET /v1/models`, `GET /v1/models/{id}`
//! - `GET /health`
//! - `GET`, `POST /admin/adapters`, `DELETE /admin/adapters/{name}`: LoRA adapters loaded
//!   and unloaded at run time ([`admin`])
//!
//! Everything else is a 404 (unknown route) or 405 (wrong method) in OpenAI's error shape;
//! the `/v1/messages` routes answer errors in Anthropic's.
use std::future::Future;
use std::io;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use axum::extract::DefaultBodyLimit;
use axum::routing::{delete, get, post};
use axum::Router;
use tokio::net::UnixListener;

use crate::constraint::grammar::GrammarCompiler;
use crate::runtime::request::{AdapterWorkSender, WorkSender};
use crate::tokenizer::Tokenizer;

mod admin;
mod chat;
mod choices;
mod completions;
pub mod conversation;
pub mod error;
pub mod formats;
pub mod generation;
pub mod harmony;
mod logprobs;
pub mod markup_calls;
mod messages;
pub mod reasoning;
pub mod request;
mod routes;
pub mod stop;
pub mod tools;

pub use error::ApiError;

/// What the handlers share. Cheap to clone.
#[derive(Clone)]
pub struct ServerState {
    /// The id the engine answers to (`model` in responses, `/v1/models`).
    pub model_id: String,
    pub tokenizer: Arc<Tokenizer>,
    /// Prompt plus generated tokens may not exceed this.
    pub context_length: usize,
    /// Where generation jobs go (the MLX thread).
    pub work: WorkSender,
    /// Unix time reported as the model's `created`.
    pub created: u64,
    /// Rows of the model's output layer: the length of a constraint's token mask.
    pub model_vocab: usize,
    /// The grammar engine over this model's vocabulary, built by the first constrained
    /// request (structured output, forced tool calls).
    pub grammar: Arc<OnceLock<Result<Arc<GrammarCompiler>, String>>>,
    /// The LoRA adapters the model serves (`"model": "<model>:<adapter>"`); `None`: none.
    pub adapters: Option<Arc<crate::adapters::AdapterTable>>,
    /// Where adapter loads and unloads go (the MLX thread); `None`: the admin routes refuse
    /// them.
    pub adapter_work: Option<AdapterWorkSender>,
}

impl ServerState {
    pub fn new(
        model_id: impl Into<String>,
        tokenizer: Arc<Tokenizer>,
        context_length: usize,
        work: WorkSender,
    ) -> Self {
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Self {
            model_id: model_id.into(),
            model_vocab: tokenizer.vocab_size(),
            tokenizer,
            context_length,
            work,
            created,
            grammar: Arc::new(OnceLock::new()),
            adapters: None,
            adapter_work: None,
        }
    }

    /// Serves the adapters in `table` too.
    pub fn with_adapters(mut self, table: Option<Arc<crate::adapters::AdapterTable>>) -> Self {
        self.adapters = table;
        self
    }

    /// Loads and unloads adapters through `sender` (the admin routes).
    pub fn with_adapter_work(mut self, sender: AdapterWorkSender) -> Self {
        self.adapter_work = Some(sender);
        self
    }

    /// The adapter a request's `model` selects: `"<anything>:<name>"` where `name` is a
    /// loaded adapter, or a loaded adapter's bare `name` that is not this model's id (how
    /// `mlxd` routes an adapter entry of `mlxd.toml`, whose id is the adapter's name).
    /// `"<this model's id>:<name>"` naming no loaded adapter is a 404; anything else is the
    /// base model (a standalone engine answers to any model name).
    pub fn adapter_for(
        &self,
        model: Option<&str>,
    ) -> Result<Option<crate::adapters::AdapterId>, error::ApiError> {
        let Some((base, name)) = model.and_then(|m| m.trim().rsplit_once(':')) else {
            let bare = model.map(str::trim).filter(|m| *m != self.model_id);
            return Ok(bare.and_then(|m| self.adapters.as_ref()?.id_of(m)));
        };
        if let Some(id) = self.adapters.as_ref().and_then(|t| t.id_of(name)) {
            return Ok(Some(id));
        }
        if base != self.model_id {
            return Ok(None);
        }
        let mut available = vec![self.model_id.clone()];
        if let Some(table) = &self.adapters {
            available.extend(
                table
                    .list()
                    .into_iter()
                    .map(|a| format!("{}:{}", self.model_id, a.name)),
            );
        }
        Err(error::ApiError::UnknownModel {
            requested: format!("{base}:{name}"),
            available,
        })
    }

    /// The model's output vocabulary when it differs from the tokenizer's.
    pub fn with_model_vocab(mut self, vocab: usize) -> Self {
        self.model_vocab = vocab;
        self
    }
}

/// The API's routes, for [`serve`] or for driving in tests.
pub fn router(state: ServerState) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/messages", post(messages::messages))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/models", get(routes::list_models))
        .route("/v1/models/{id}", get(routes::get_model))
        .route("/health", get(routes::health))
        .route("/admin/adapters", get(admin::list).post(admin::load))
        .route("/admin/adapters/{name}", delete(admin::unload))
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(DefaultBodyLimit::max(request::MAX_BODY_BYTES))
        .with_state(state)
}

/// Serves the API on `listener` until `shutdown` completes; then stops accepting connections
/// and returns once in-flight requests have finished.
pub async fn serve(
    listener: UnixListener,
    state: ServerState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}

/// Binds a unix socket at `path`, removing a stale socket file left by an earlier process.
/// Must be called inside a tokio runtime.
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) => {
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_socket() {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("{} exists and is not a socket", path.display()),
                ));
            }
            std::fs::remove_file(path)?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    UnixListener::bind(path)
}

#[cfg(test)]
mod tests;
