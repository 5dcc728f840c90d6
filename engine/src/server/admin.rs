//! The admin routes: LoRA adapters loaded and unloaded at run time, beside the base model
//! (which is never reloaded).
//!
//! - `GET /admin/adapters`: the loaded adapters;
//! - `POST /admin/adapters` `{"name", "path"}`: loads one on the MLX thread;
//! - `DELETE /admin/adapters/{name}`: unloads one no request in flight runs with (409 naming
//!   how many do, otherwise).
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::Json;
use mlxd_protocol::adapters::{AdapterList, AdapterLoad, AdapterObject, OBJECT_ADAPTER};
use mlxd_protocol::openai::OBJECT_LIST;
use tokio::sync::oneshot;

use super::error::ApiError;
use super::ServerState;
use crate::adapters::AdapterSummary;
use crate::runtime::request::{AdapterWork, AdapterWorkError};

fn object(state: &ServerState, a: AdapterSummary) -> AdapterObject {
    AdapterObject {
        object: OBJECT_ADAPTER.into(),
        id: format!("{}:{}", state.model_id, a.name),
        name: a.name,
        parent: state.model_id.clone(),
        path: a.dir.display().to_string(),
        fine_tune_type: a.kind.name().into(),
        rank: a.rank,
        scale: a.scale,
        layers: a.layers,
    }
}

pub(super) async fn list(State(state): State<ServerState>) -> Json<AdapterList> {
    let data = state
        .adapters
        .iter()
        .flat_map(|t| t.list())
        .map(|a| object(&state, a))
        .collect();
    Json(AdapterList {
        object: OBJECT_LIST.into(),
        data,
    })
}

pub(super) async fn load(
    State(state): State<ServerState>,
    body: Bytes,
) -> Result<Json<AdapterObject>, ApiError> {
    let load: AdapterLoad = serde_json::from_slice(&body).map_err(|e| {
        ApiError::invalid_body(format!(
            "the body must be {{\"name\": ..., \"path\": ...}}: {e}"
        ))
    })?;
    if load.path.trim().is_empty() {
        return Err(ApiError::invalid("path", "path is empty"));
    }
    let summary = send(&state, |reply| AdapterWork::Load {
        name: load.name,
        dir: load.path.into(),
        reply,
    })
    .await?;
    Ok(Json(object(&state, summary)))
}

pub(super) async fn unload(
    State(state): State<ServerState>,
    Path(name): Path<String>,
) -> Result<Json<AdapterObject>, ApiError> {
    let summary = send(&state, |reply| AdapterWork::Unload { name, reply }).await?;
    Ok(Json(object(&state, summary)))
}

/// Sends adapter work to the MLX thread and waits for its answer.
async fn send(
    state: &ServerState,
    work: impl FnOnce(oneshot::Sender<Result<AdapterSummary, AdapterWorkError>>) -> AdapterWork,
) -> Result<AdapterSummary, ApiError> {
    let (Some(_), Some(sender)) = (&state.adapters, &state.adapter_work) else {
        return Err(ApiError::Adapter(AdapterWorkError::NotAdaptable));
    };
    let (tx, rx) = oneshot::channel();
    sender
        .send(work(tx))
        .map_err(|_| ApiError::Unavailable("the model thread has stopped".into()))?;
    rx.await
        .map_err(|_| ApiError::Unavailable("the model thread has stopped".into()))?
        .map_err(ApiError::Adapter)
}
