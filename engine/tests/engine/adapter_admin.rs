//! LoRA adapters loaded and unloaded at run time through the engine's admin routes
//! (`POST`/`GET /admin/adapters`, `DELETE /admin/adapters/{name}`), beside adapters loaded at
//! start, on the real tiny model: an adapter loaded at run time gives the tokens of the same
//! adapter loaded at start, an unload frees it (later requests naming it are 404s) without
//! disturbing the adapters loaded after it, and every bad input gets its status and code.
use std::path::{Path, PathBuf};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use mlxd_engine::adapters::AdapterId;
use mlxd_engine::runtime::request::{AdapterWork, AdapterWorkError, GenerationError, TokenEvent};
use mlxd_engine::runtime::{Runtime, RuntimeLimits};
use mlxd_engine::server::ServerState;
use serde_json::{json, Value};

use crate::common::{adapter_dir, collect, submit_greedy, tiny_model, Output};

const PROMPT: &[u32] = &[1, 20, 31, 42, 53, 64, 75];
const NEW_TOKENS: usize = 8;

fn send(runtime: &Runtime, adapter: Option<AdapterId>, max_tokens: usize) -> Receiver {
    submit_greedy(runtime, PROMPT, max_tokens, adapter)
}

type Receiver = tokio::sync::mpsc::UnboundedReceiver<TokenEvent>;

fn tokens(runtime: &Runtime, adapter: Option<AdapterId>) -> Vec<u32> {
    let Output { tokens, .. } = collect(send(runtime, adapter, NEW_TOKENS));
    tokens
}

fn id(runtime: &Runtime, name: &str) -> Option<AdapterId> {
    runtime.adapters.as_ref().expect("a table").id_of(name)
}

/// The engine's routes on a unix socket, driven from a current-thread tokio runtime.
struct Api {
    rt: tokio::runtime::Runtime,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl Api {
    fn serve(state: ServerState) -> Self {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("engine.sock");
        let listener = rt.block_on(async { mlxd_engine::server::bind(&socket).unwrap() });
        rt.spawn(mlxd_engine::server::serve(
            listener,
            state,
            std::future::pending(),
        ));
        Api {
            rt,
            socket,
            _dir: dir,
        }
    }

    fn call(&self, method: &str, uri: &str, body: Option<Value>) -> (StatusCode, Value) {
        self.rt.block_on(async {
            let stream = tokio::net::UnixStream::connect(&self.socket).await.unwrap();
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .unwrap();
            tokio::spawn(conn);
            let req = Request::builder()
                .method(method)
                .uri(uri)
                .header("host", "engine")
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(
                    body.map(|b| b.to_string()).unwrap_or_default(),
                )))
                .unwrap();
            let resp = sender.send_request(req).await.unwrap();
            let status = resp.status();
            let bytes = resp.into_body().collect().await.unwrap().to_bytes();
            let value = serde_json::from_slice(&bytes)
                .unwrap_or_else(|e| panic!("{uri}: not JSON ({e}): {bytes:?}"));
            (status, value)
        })
    }

    fn load(&self, name: &str, path: &Path) -> (StatusCode, Value) {
        self.call(
            "POST",
            "/admin/adapters",
            Some(json!({"name": name, "path": path})),
        )
    }
}

fn names(list: &Value) -> Vec<&str> {
    list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["name"].as_str().unwrap())
        .collect()
}

#[test]
fn adapters_load_and_unload_at_run_time_and_serve_as_if_loaded_at_start() {
    let model = tiny_model("tiny-llama");
    let (lora_a, lora_b) = (
        adapter_dir("tiny-llama-lora-a"),
        adapter_dir("tiny-llama-lora-b"),
    );
    let limits = RuntimeLimits {
        prompt_cache_bytes: 0,
        adapters: vec![("a".into(), lora_a.clone())],
        ..Default::default()
    };
    let runtime = Runtime::start(model.clone(), limits, None).expect("load");
    let tokenizer = mlxd_engine::tokenizer::Tokenizer::from_dir(&model).expect("tokenizer");
    let state = ServerState::new(
        "tiny",
        std::sync::Arc::new(tokenizer),
        512,
        runtime.work.clone(),
    )
    .with_adapters(runtime.adapters.clone())
    .with_adapter_work(runtime.adapter_work.clone());
    let api = Api::serve(state.clone());

    let base = tokens(&runtime, None);
    let at_start = tokens(&runtime, id(&runtime, "a"));
    assert_ne!(base, at_start, "the adapter changes the tokens");

    // The same directory under another name, at run time: the same tokens.
    let (status, loaded) = api.load("a2", &lora_a);
    assert_eq!(status, StatusCode::OK, "{loaded}");
    assert_eq!(loaded["object"], "adapter");
    assert_eq!(loaded["id"], "tiny:a2");
    assert_eq!(loaded["parent"], "tiny");
    assert_eq!(
        (loaded["rank"].as_u64(), loaded["scale"].as_f64()),
        (Some(4), Some(10.0))
    );
    assert_eq!(loaded["fine_tune_type"], "lora");
    let a2 = id(&runtime, "a2");
    assert_eq!(state.adapter_for(Some("tiny:a2")).unwrap(), a2);
    assert_eq!(tokens(&runtime, a2), at_start);
    let (status, loaded) = api.load("b", &lora_b);
    assert_eq!(status, StatusCode::OK, "{loaded}");
    let b = id(&runtime, "b");
    let b_tokens = tokens(&runtime, b);
    assert_ne!(b_tokens, at_start);
    let (status, list) = api.call("GET", "/admin/adapters", None);
    assert_eq!(status, StatusCode::OK);
    assert_eq!(names(&list), ["a", "a2", "b"]);

    // A request in flight with `a2` keeps it loaded: the unload is refused, naming the count.
    let mut long = send(&runtime, a2, 500 - PROMPT.len());
    while !matches!(long.blocking_recv(), Some(TokenEvent::Token(_))) {}
    let (tx, rx) = tokio::sync::oneshot::channel();
    runtime
        .adapter_work
        .send(AdapterWork::Unload {
            name: "a2".into(),
            reply: tx,
        })
        .unwrap();
    match rx.blocking_recv().unwrap() {
        Err(AdapterWorkError::InUse { name, requests }) => {
            assert_eq!((name.as_str(), requests), ("a2", 1))
        }
        other => panic!("expected in use, got {other:?}"),
    }
    let finished = collect(long);
    // The first token was read above.
    assert_eq!(finished.tokens.len() + 1, 500 - PROMPT.len());

    // Unloading the first adapter shifts the others in the table: they keep their tokens.
    let a = id(&runtime, "a");
    let (status, gone) = api.call("DELETE", "/admin/adapters/a", None);
    assert_eq!(status, StatusCode::OK, "{gone}");
    assert_eq!(gone["name"], "a");
    assert_eq!(id(&runtime, "a"), None);
    assert_eq!(tokens(&runtime, a2), at_start);
    assert_eq!(tokens(&runtime, b), b_tokens);
    assert_eq!(tokens(&runtime, None), base);
    // A request that resolved the name before the unload is refused at admission.
    let mut stale = send(&runtime, a, NEW_TOKENS);
    let failed = loop {
        match stale.blocking_recv() {
            Some(TokenEvent::Failed(e)) => break e,
            Some(TokenEvent::Finished(_)) | None => panic!("a stale adapter id generated"),
            Some(_) => {}
        }
    };
    assert_eq!(failed, GenerationError::AdapterUnloaded(a.unwrap()));
    // Later requests naming it are 404s.
    let (status, err) = api.call(
        "POST",
        "/v1/completions",
        Some(json!({"model": "tiny:a", "prompt": "hi", "max_tokens": 2})),
    );
    assert_eq!(status, StatusCode::NOT_FOUND, "{err}");
    assert_eq!(err["error"]["code"], "model_not_found");
    let (_, list) = api.call("GET", "/admin/adapters", None);
    assert_eq!(names(&list), ["a2", "b"]);
    // Loaded again, it gets a new id (ids are never reused) and its tokens.
    assert_eq!(api.load("a", &lora_a).0, StatusCode::OK);
    let again = id(&runtime, "a");
    assert!(again > b, "{again:?} after {b:?}");
    assert_eq!(tokens(&runtime, again), at_start);

    // Bad input: status, code and a message naming what is wrong.
    let check = |(status, body): (StatusCode, Value), want: StatusCode, code: &str, says: &str| {
        assert_eq!(status, want, "{body}");
        if !code.is_empty() {
            assert_eq!(body["error"]["code"], code, "{body}");
        }
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{message:?} should say {says:?}");
    };
    check(
        api.load("b", &lora_b),
        StatusCode::CONFLICT,
        "adapter_exists",
        "\"b\"",
    );
    let missing = model.join("no-such-adapter");
    check(
        api.load("m", &missing),
        StatusCode::BAD_REQUEST,
        "adapter_unreadable",
        "no-such-adapter",
    );
    // A full fine-tune is a model, not an adapter.
    let full = tempfile::tempdir().unwrap();
    for f in ["adapter_config.json", "adapters.safetensors"] {
        std::fs::copy(lora_a.join(f), full.path().join(f)).unwrap();
    }
    let config = full.path().join("adapter_config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace("\"lora\"", "\"full\"")).unwrap();
    check(
        api.load("d", full.path()),
        StatusCode::BAD_REQUEST,
        "adapter_refused",
        "full",
    );
    // A DoRA adapter loads beside the LoRA ones and says which it is.
    let (status, dora) = api.load("dora", &adapter_dir("tiny-llama-dora"));
    assert_eq!(status, StatusCode::OK, "{dora}");
    assert_eq!(dora["fine_tune_type"], "dora");
    let (status, _) = api.call("DELETE", "/admin/adapters/dora", None);
    assert_eq!(status, StatusCode::OK);
    check(
        api.load("bad name", &lora_a),
        StatusCode::BAD_REQUEST,
        "invalid_adapter_name",
        "bad name",
    );
    check(
        api.call("POST", "/admin/adapters", Some(json!({"name": "x"}))),
        StatusCode::BAD_REQUEST,
        "",
        "path",
    );
    check(
        api.call("DELETE", "/admin/adapters/zzz", None),
        StatusCode::NOT_FOUND,
        "adapter_not_found",
        "zzz",
    );
    let (_, list) = api.call("GET", "/admin/adapters", None);
    assert_eq!(names(&list), ["a2", "b", "a"], "failed loads leave nothing");

    drop(api);
    drop(state);
    runtime.join();
}
