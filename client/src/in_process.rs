//! The in-process transport: the engine's runtime (its MLX thread) and its HTTP routes run
//! inside the caller, and requests go to the routes directly, without a socket, so answers
//! and errors are exactly those of an engine behind a socket.
use std::path::PathBuf;
use std::sync::Mutex;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use mlxd_engine::app;
use mlxd_engine::runtime::Runtime;
pub use mlxd_engine::runtime::RuntimeLimits;
use tokio::sync::mpsc;
use tower::ServiceExt;

use crate::error::ClientError;
use crate::transport::{Body, BoxError};

/// What an in-process engine loads and with which limits.
#[derive(Default)]
pub struct InProcessOptions {
    /// The model store (`$MLXD_HOME`, else `~/.cache/mlxd`, when not given).
    pub home: Option<PathBuf>,
    /// Batch size, KV budget, prefix cache, KV quantization.
    pub limits: RuntimeLimits,
}

pub(crate) struct InProcessTransport {
    model_id: String,
    /// `None` once closed.
    router: Mutex<Option<axum::Router>>,
    runtime: Mutex<Option<Runtime>>,
    /// Every request in flight holds a clone until its response body ends; `None` once
    /// closing, so no request starts after that.
    active: Mutex<Option<mpsc::Sender<()>>>,
    /// Yields `None` when the last clone of `active` is gone.
    drained: tokio::sync::Mutex<mpsc::Receiver<()>>,
}

impl InProcessTransport {
    pub(crate) async fn start(model: &str, options: InProcessOptions) -> Result<Self, ClientError> {
        let home = match options.home {
            Some(home) => home,
            None => mlxd_store::default_home().map_err(|e| ClientError::Start(e.to_string()))?,
        };
        let spec = model.to_owned();
        let limits = options.limits;
        // Resolving (perhaps converting) and loading the weights block: off the async threads.
        let engine =
            tokio::task::spawn_blocking(move || app::load(&spec, &home, limits, None, None))
                .await
                .map_err(|e| ClientError::Start(format!("the loading thread failed: {e}")))?
                .map_err(|e| ClientError::Start(e.to_string()))?;
        let router = mlxd_engine::server::router(engine.state());
        let (active, drained) = mpsc::channel(1);
        Ok(Self {
            model_id: engine.model.id.clone(),
            router: Mutex::new(Some(router)),
            runtime: Mutex::new(Some(engine.runtime)),
            active: Mutex::new(Some(active)),
            drained: tokio::sync::Mutex::new(drained),
        })
    }

    pub(crate) fn target(&self) -> String {
        format!("the in-process engine for {}", self.model_id)
    }

    pub(crate) async fn send(
        &self,
        req: Request<Full<Bytes>>,
    ) -> Result<Response<Body>, ClientError> {
        let (router, guard) = {
            let router = self.router.lock().unwrap_or_else(|p| p.into_inner());
            let active = self.active.lock().unwrap_or_else(|p| p.into_inner());
            match (router.as_ref(), active.as_ref()) {
                (Some(r), Some(a)) => (r.clone(), a.clone()),
                _ => return Err(ClientError::Closed),
            }
        };
        let resp = match router.oneshot(req.map(axum::body::Body::new)).await {
            Ok(resp) => resp,
            Err(never) => match never {},
        };
        Ok(resp.map(|body| {
            body.map_frame(move |frame| {
                // The request counts as active until its body is finished or dropped.
                let _active = &guard;
                frame
            })
            .map_err(|e| -> BoxError { Box::new(e) })
            .boxed_unsync()
        }))
    }

    /// Refuses new requests, waits for those in flight, then stops the runtime.
    pub(crate) async fn close(&self) {
        self.active.lock().unwrap_or_else(|p| p.into_inner()).take();
        {
            let mut drained = self.drained.lock().await;
            while drained.recv().await.is_some() {}
        }
        // The routes hold the runtime's work queue; the MLX thread ends once both are gone.
        self.router.lock().unwrap_or_else(|p| p.into_inner()).take();
        let runtime = self
            .runtime
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(runtime) = runtime {
            let _ = tokio::task::spawn_blocking(move || runtime.join()).await;
        }
    }
}
