//! The client against each transport with the real default model (SmolLM2-135M): HTTP to
//! `mlxd` (with an API key), a unix socket to one `mlxd-engine`, and the engine in this
//! process. The same greedy request gives the same answer over all three, streamed or not;
//! a batch comes back in input order; errors carry the server's body; closing the in-process
//! client waits for the stream in flight.
//!
//! Needs the `mlxd` and `mlxd-engine` binaries (`cargo build --workspace --bins`, as
//! `scripts/test.sh` does) and the converted default model (`MLXD_TEST_HOME`, `MLXD_SMOLLM2_GGUF`).
use std::time::Duration;

use futures::StreamExt;
use mlxd_client::{
    BatchCompletionClient, ChatCompletionRequest, ChatCompletionResponse, ChatMessage, Client,
    ClientError, CompletionClient, ErrorType, GenerationParams, InProcessOptions, Role,
};
use mlxd_tests::{engine_bin, smollm2_gguf, test_home, EngineProcess, MlxdProcess};

const API_KEY: &str = "transport-test-key";

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
    // Both wait until they serve (the first run converts the default model).
    let engine = EngineProcess::start("smollm2-135m")
        .await
        .expect("mlxd-engine serves");
    let mlxd = MlxdProcess::builder()
        .model("smollm2-135m")
        .engine(engine_bin().expect("mlxd-engine is built"))
        .home(test_home())
        .env(
            "MLXD_SMOLLM2_GGUF",
            smollm2_gguf().expect("the default model's GGUF"),
        )
        .args(&["--api-key", API_KEY])
        .ready_within(Duration::from_secs(300))
        .start()
        .await
        .expect("mlxd serves");
    let http = Client::builder()
        .api_key(API_KEY)
        .http(&mlxd.url())
        .expect("http client");
    let unix = Client::builder().unix(&engine.socket).expect("unix client");
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
    let no_key = Client::builder().http(&mlxd.url()).expect("http client");
    match no_key.complete(greedy(question, 4)).await {
        Err(e @ ClientError::Api { status: 401, .. }) => {
            assert_eq!(e.error_type(), Some(ErrorType::AuthenticationError), "{e}")
        }
        other => panic!("no API key gave {other:?}"),
    }
    let short = Client::builder()
        .timeout(Duration::from_millis(1))
        .unix(&engine.socket)
        .expect("unix client");
    assert!(
        matches!(
            short.complete(greedy(question, 64)).await,
            Err(ClientError::Timeout { .. })
        ),
        "a 1 ms timeout did not fire"
    );
    let nowhere_dir = tempfile::tempdir().expect("tempdir");
    let nowhere = Client::builder()
        .unix(nowhere_dir.path().join("no-such.sock"))
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
