//! Chat formats of model families through the HTTP routes.
//!
//! Each family is served with its chat template (`tests/fixtures/templates/`, or a real one from
//! `tests/fixtures/tokenizers/`), a small byte-level tokenizer that has the family's markers as
//! added tokens (special where the family's vocabulary has them special), and a fake model that
//! writes a given text (or, under a constraint, the allowed token closest to it). The tests
//! check that reasoning and tool calls come out structured through the OpenAI and the Anthropic
//! routes, whole and streamed, with no format markup in the text; that calls round-trip into the
//! next request's prompt; and that forced calls follow each format's grammar.
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use mlxd_engine::runtime::request::{FinishReason, GenerateRequest, TokenEvent};
use mlxd_engine::server::conversation::Piece;
use mlxd_engine::server::formats::{ChatFormat, ReasoningFormat};
use mlxd_engine::server::harmony::HarmonyStream;
use mlxd_engine::server::reasoning::ReasoningSplit;
use mlxd_engine::server::tools::{ToolFormat, ToolSpec, ToolStream};
use mlxd_engine::server::{bind, serve, ServerState};
use mlxd_engine::tokenizer::Tokenizer;
use serde_json::{json, Map, Value};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot};

// ---------------------------------------------------------------------------------------------
// Families
// ---------------------------------------------------------------------------------------------

/// A model family as the server sees it: a chat template and the tokens around it.
struct Family {
    template: String,
    /// Added tokens, in id order after the 256 byte tokens: `(text, special)`.
    added: &'static [(&'static str, bool)],
    eos: &'static str,
    /// Further end-of-sequence tokens (`generation_config.json`).
    more_eos: &'static [&'static str],
    bos: Option<&'static str>,
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn fixture_template(name: &str) -> String {
    std::fs::read_to_string(fixtures().join("templates").join(name)).unwrap()
}

/// The chat template of a real tokenizer fixture.
fn real_template(name: &str) -> String {
    let path = fixtures()
        .join("tokenizers")
        .join(name)
        .join("tokenizer_config.json");
    let config: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    config["chat_template"].as_str().unwrap().to_owned()
}

fn gpt_oss() -> Family {
    Family {
        template: fixture_template("gpt_oss.jinja"),
        added: &[
            ("<|start|>", true),
            ("<|channel|>", true),
            ("<|message|>", true),
            ("<|end|>", true),
            ("<|call|>", true),
            ("<|return|>", true),
            ("<|constrain|>", true),
            ("<|endoftext|>", true),
        ],
        eos: "<|return|>",
        more_eos: &["<|call|>", "<|endoftext|>"],
        bos: None,
    }
}

const CHATML: &[(&str, bool)] = &[
    ("<|im_start|>", true),
    ("<|im_end|>", true),
    ("<tool_call>", false),
    ("</tool_call>", false),
    ("<think>", false),
    ("</think>", false),
];

fn qwen3() -> Family {
    Family {
        template: real_template("qwen3"),
        added: CHATML,
        eos: "<|im_end|>",
        more_eos: &[],
        bos: None,
    }
}

fn qwen3_coder() -> Family {
    Family {
        template: fixture_template("qwen3_coder.jinja"),
        added: CHATML,
        eos: "<|im_end|>",
        more_eos: &[],
        bos: None,
    }
}

fn glm45() -> Family {
    Family {
        template: fixture_template("glm45.jinja"),
        added: &[
            ("[gMASK]", true),
            ("<sop>", true),
            ("<|system|>", true),
            ("<|user|>", true),
            ("<|assistant|>", true),
            ("<|observation|>", true),
            ("<|endoftext|>", true),
            ("<think>", false),
            ("</think>", false),
            ("<tool_call>", false),
            ("</tool_call>", false),
            ("<arg_key>", false),
            ("</arg_key>", false),
            ("<arg_value>", false),
            ("</arg_value>", false),
        ],
        eos: "<|endoftext|>",
        more_eos: &["<|user|>", "<|observation|>"],
        bos: None,
    }
}

const GEMMA: &[(&str, bool)] = &[
    ("<bos>", true),
    ("<eos>", true),
    ("<start_of_turn>", true),
    ("<end_of_turn>", true),
];

fn gemma2() -> Family {
    Family {
        template: fixture_template("gemma2.jinja"),
        added: GEMMA,
        eos: "<eos>",
        more_eos: &["<end_of_turn>"],
        bos: Some("<bos>"),
    }
}

fn gemma3() -> Family {
    Family {
        template: real_template("gemma3"),
        ..gemma2()
    }
}

fn mistral() -> Family {
    Family {
        template: fixture_template("mistral.jinja"),
        added: &[
            ("<s>", true),
            ("</s>", true),
            ("[INST]", true),
            ("[/INST]", true),
            ("[TOOL_CALLS]", true),
            ("[AVAILABLE_TOOLS]", true),
            ("[/AVAILABLE_TOOLS]", true),
            ("[TOOL_RESULTS]", true),
            ("[/TOOL_RESULTS]", true),
            ("[ARGS]", true),
        ],
        eos: "</s>",
        more_eos: &[],
        bos: Some("<s>"),
    }
}

// ---------------------------------------------------------------------------------------------
// A byte-level tokenizer with the family's added tokens
// ---------------------------------------------------------------------------------------------

/// GPT-2's printable stand-in for each byte (byte-level BPE vocabularies spell bytes so).
fn byte_chars() -> Vec<char> {
    let printable: Vec<u32> = (0x21..=0x7e)
        .chain(0xa1..=0xac)
        .chain(0xae..=0xff)
        .collect();
    let mut chars = vec!['\0'; 256];
    let mut shifted = 0;
    for byte in 0..256u32 {
        chars[byte as usize] = if printable.contains(&byte) {
            char::from_u32(byte).unwrap()
        } else {
            shifted += 1;
            char::from_u32(255 + shifted).unwrap()
        };
    }
    chars
}

/// `tokenizer.json`: one token per byte (id = the byte), then the added tokens.
fn tokenizer_json(added: &[(&str, bool)]) -> Value {
    let vocab: Map<String, Value> = byte_chars()
        .iter()
        .enumerate()
        .map(|(byte, c)| (c.to_string(), json!(byte)))
        .collect();
    let added: Vec<Value> = added
        .iter()
        .enumerate()
        .map(|(i, (content, special))| {
            json!({"id": 256 + i, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": special})
        })
        .collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": byte_level, "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
                  "byte_fallback": false, "vocab": vocab, "merges": []}
    })
}

/// A model directory with the family's tokenizer files.
fn model_dir(family: &Family) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, value: Value| {
        std::fs::write(dir.path().join(name), value.to_string()).unwrap();
    };
    write("tokenizer.json", tokenizer_json(family.added));
    let mut config = json!({"chat_template": family.template, "eos_token": family.eos});
    if let Some(bos) = family.bos {
        config["bos_token"] = json!(bos);
        config["add_bos_token"] = json!(false);
    }
    write("tokenizer_config.json", config);
    let id = |t: &str| 256 + family.added.iter().position(|(a, _)| *a == t).unwrap();
    let eos: Vec<usize> = std::iter::once(family.eos)
        .chain(family.more_eos.iter().copied())
        .map(id)
        .collect();
    write("generation_config.json", json!({"eos_token_id": eos}));
    dir
}

// ---------------------------------------------------------------------------------------------
// The server with a fake model
// ---------------------------------------------------------------------------------------------

struct Server {
    _dir: tempfile::TempDir,
    socket: PathBuf,
    tokenizer: Arc<Tokenizer>,
    /// What the model writes for the next requests.
    output: Arc<Mutex<String>>,
    prompts: Arc<Mutex<Vec<Vec<u32>>>>,
    shutdown: Option<oneshot::Sender<()>>,
}

impl Server {
    async fn start(family: &Family) -> Self {
        let model = model_dir(family);
        let tokenizer = Arc::new(Tokenizer::from_dir(model.path()).unwrap());
        let socket = model.path().join("engine.sock");
        let listener = bind(&socket).unwrap();
        let (work_tx, mut work_rx) = mpsc::unbounded_channel::<GenerateRequest>();
        let output = Arc::new(Mutex::new(String::new()));
        let prompts = Arc::new(Mutex::new(Vec::new()));
        {
            let (output, prompts, tokenizer) = (output.clone(), prompts.clone(), tokenizer.clone());
            tokio::spawn(async move {
                while let Some(req) = work_rx.recv().await {
                    prompts.lock().unwrap().push(req.prompt.clone());
                    let text = output.lock().unwrap().clone();
                    let ids = tokenizer.encode(&text, false).unwrap();
                    let vocab = tokenizer.vocab_size();
                    tokio::spawn(async move { fake_model(req, ids, vocab) });
                }
            });
        }
        let state = ServerState::new("test-model", tokenizer.clone(), 8192, work_tx);
        let (shutdown, stopped) = oneshot::channel::<()>();
        tokio::spawn(serve(listener, state, async {
            let _ = stopped.await;
        }));
        Self {
            _dir: model,
            socket,
            tokenizer,
            output,
            prompts,
            shutdown: Some(shutdown),
        }
    }

    fn will_write(&self, text: &str) {
        *self.output.lock().unwrap() = text.to_owned();
    }

    /// The last prompt, special tokens and all.
    fn last_prompt(&self) -> String {
        let ids = self.prompts.lock().unwrap().last().cloned().unwrap();
        self.tokenizer.decode(&ids, false).unwrap()
    }

    async fn send(&self, uri: &str, body: &Value) -> (StatusCode, Bytes) {
        let stream = UnixStream::connect(&self.socket).await.unwrap();
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        let req = Request::builder()
            .method("POST")
            .uri(uri)
            .header("host", "engine")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap();
        let resp = sender.send_request(req).await.unwrap();
        let status = resp.status();
        (status, resp.into_body().collect().await.unwrap().to_bytes())
    }

    async fn post(&self, uri: &str, body: &Value) -> (StatusCode, Value) {
        let (status, bytes) = self.send(uri, body).await;
        (status, serde_json::from_slice(&bytes).unwrap())
    }

    /// A request that must succeed.
    async fn ok(&self, uri: &str, body: &Value) -> Value {
        let (status, v) = self.post(uri, body).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        v
    }

    async fn stream(&self, uri: &str, body: &Value) -> String {
        let (status, bytes) = self.send(uri, body).await;
        let text = String::from_utf8(bytes.to_vec()).unwrap();
        assert_eq!(status, StatusCode::OK, "{text}");
        text
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// Writes `ids` as the runtime would: up to `max_tokens`, ending (unsent) at a stop token. Under
/// a constraint, each step takes the wanted token if the mask allows it, else ends where the
/// end is allowed, else takes the lowest allowed id.
fn fake_model(mut req: GenerateRequest, ids: Vec<u32>, vocab: usize) {
    let events = req.events.clone();
    let _ = events.send(TokenEvent::PromptDone {
        prompt_tokens: req.prompt.len(),
        cached: 0,
    });
    let stops = req.stop_token_ids.clone();
    let mut wanted = ids.into_iter();
    let mut constraint = req.constraint.take();
    let mut row = Vec::new();
    for _ in 0..req.max_tokens {
        let next = wanted.next();
        let id = match constraint.as_mut() {
            None => match next {
                Some(id) => id,
                None => break,
            },
            Some(c) => {
                row.clear();
                row.resize(vocab, 0.0f32);
                c.mask(&mut row).unwrap();
                let allowed = |id: u32| row[id as usize] == 0.0;
                match next.filter(|&id| allowed(id)) {
                    Some(id) => id,
                    None if stops.iter().any(|&s| allowed(s)) => break,
                    None => (0..row.len() as u32).find(|&id| allowed(id)).unwrap(),
                }
            }
        };
        if stops.contains(&id) {
            break;
        }
        let _ = events.send(TokenEvent::Token(id));
        if let Some(c) = constraint.as_mut() {
            if c.commit(id).unwrap() {
                break;
            }
        }
    }
    let _ = events.send(TokenEvent::Finished(FinishReason::Stop));
}

// ---------------------------------------------------------------------------------------------
// Requests and what comes back, the same for every route
// ---------------------------------------------------------------------------------------------

fn weather_schema() -> Value {
    json!({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]})
}

fn openai_body(tools: bool, stream: bool) -> Value {
    let mut body = json!({"model": "test-model", "max_tokens": 300, "stream": stream,
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Weather in Oslo?"}]});
    if tools {
        body["tools"] = json!([{"type": "function", "function": {"name": "get_weather",
            "description": "The weather in a city", "parameters": weather_schema()}}]);
    }
    body
}

fn anthropic_body(tools: bool, stream: bool) -> Value {
    let mut body = json!({"model": "test-model", "max_tokens": 300, "stream": stream,
        "system": "Be brief.", "messages": [{"role": "user", "content": "Weather in Oslo?"}]});
    if tools {
        body["tools"] = json!([{"name": "get_weather", "description": "The weather in a city",
                                "input_schema": weather_schema()}]);
    }
    body
}

/// A response, in the same terms for every route.
#[derive(Debug, Default, PartialEq)]
struct Outcome {
    reasoning: String,
    content: String,
    /// `(name, arguments)`.
    calls: Vec<(String, Value)>,
    ids: Vec<String>,
    /// `stop` or `tool_calls` (Anthropic's `end_turn` and `tool_use`).
    finish: String,
}

impl Outcome {
    fn tidy(mut self) -> Self {
        self.content = self.content.trim().to_owned();
        self
    }
}

fn openai_whole(v: &Value) -> Outcome {
    let choice = &v["choices"][0];
    let message = &choice["message"];
    let calls = message["tool_calls"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    Outcome {
        reasoning: message["reasoning_content"]
            .as_str()
            .unwrap_or("")
            .to_owned(),
        content: message["content"].as_str().unwrap_or("").to_owned(),
        calls: calls
            .iter()
            .map(|c| {
                let args = c["function"]["arguments"].as_str().unwrap();
                (
                    c["function"]["name"].as_str().unwrap().to_owned(),
                    serde_json::from_str(args).unwrap(),
                )
            })
            .collect(),
        ids: calls
            .iter()
            .map(|c| c["id"].as_str().unwrap().to_owned())
            .collect(),
        finish: choice["finish_reason"].as_str().unwrap().to_owned(),
    }
    .tidy()
}

fn openai_stream(text: &str) -> Outcome {
    let mut out = Outcome::default();
    for event in text.split_terminator("\n\n") {
        // A choice chunk opens with its token ids' meta line.
        let event = match mlxd_protocol::openai::EventMeta::split(event.as_bytes()) {
            Some((_, at)) => &event[at..],
            None => event,
        };
        let data = event.strip_prefix("data: ").unwrap();
        if data == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        let Some(choice) = chunk["choices"].get(0) else {
            continue;
        };
        let delta = &choice["delta"];
        out.reasoning
            .push_str(delta["reasoning_content"].as_str().unwrap_or(""));
        out.content
            .push_str(delta["content"].as_str().unwrap_or(""));
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            let f = &call["function"];
            let args = f["arguments"].as_str().unwrap();
            out.calls.push((
                f["name"].as_str().unwrap().to_owned(),
                serde_json::from_str(args).unwrap(),
            ));
            out.ids.push(call["id"].as_str().unwrap().to_owned());
        }
        if let Some(finish) = choice["finish_reason"].as_str() {
            out.finish = finish.to_owned();
        }
    }
    out.tidy()
}

fn anthropic_finish(stop_reason: &Value) -> String {
    match stop_reason.as_str().unwrap() {
        "tool_use" => "tool_calls".into(),
        "end_turn" => "stop".into(),
        other => other.into(),
    }
}

fn anthropic_whole(v: &Value) -> Outcome {
    let mut out = Outcome::default();
    for block in v["content"].as_array().unwrap() {
        match block["type"].as_str().unwrap() {
            "thinking" => out.reasoning.push_str(block["thinking"].as_str().unwrap()),
            "text" => out.content.push_str(block["text"].as_str().unwrap()),
            "tool_use" => {
                out.calls.push((
                    block["name"].as_str().unwrap().to_owned(),
                    block["input"].clone(),
                ));
                out.ids.push(block["id"].as_str().unwrap().to_owned());
            }
            other => panic!("unexpected block {other}"),
        }
    }
    out.finish = anthropic_finish(&v["stop_reason"]);
    out.tidy()
}

fn anthropic_stream(text: &str) -> Outcome {
    let mut out = Outcome::default();
    let mut json_parts = String::new();
    for event in text.split_terminator("\n\n") {
        let (_, data) = event.split_once("\ndata: ").unwrap();
        let data: Value = serde_json::from_str(data).unwrap();
        match data["type"].as_str().unwrap() {
            "content_block_start" if data["content_block"]["type"] == "tool_use" => {
                let block = &data["content_block"];
                out.calls
                    .push((block["name"].as_str().unwrap().to_owned(), Value::Null));
                out.ids.push(block["id"].as_str().unwrap().to_owned());
            }
            "content_block_delta" => {
                let delta = &data["delta"];
                match delta["type"].as_str().unwrap() {
                    "thinking_delta" => out.reasoning.push_str(delta["thinking"].as_str().unwrap()),
                    "text_delta" => out.content.push_str(delta["text"].as_str().unwrap()),
                    "input_json_delta" => {
                        json_parts.push_str(delta["partial_json"].as_str().unwrap())
                    }
                    other => panic!("unexpected delta {other}"),
                }
            }
            "content_block_stop" => {
                if let Some(last) = out.calls.last_mut().filter(|c| c.1.is_null()) {
                    last.1 = serde_json::from_str(&std::mem::take(&mut json_parts)).unwrap();
                }
            }
            "message_delta" => out.finish = anthropic_finish(&data["delta"]["stop_reason"]),
            _ => {}
        }
    }
    out.tidy()
}

/// The same request through all four routes (OpenAI and Anthropic, whole and streamed).
async fn all_routes(server: &Server, tools: bool) -> [Outcome; 4] {
    let openai = server
        .ok("/v1/chat/completions", &openai_body(tools, false))
        .await;
    let openai_streamed = server
        .stream("/v1/chat/completions", &openai_body(tools, true))
        .await;
    let anthropic = server
        .ok("/v1/messages", &anthropic_body(tools, false))
        .await;
    let anthropic_streamed = server
        .stream("/v1/messages", &anthropic_body(tools, true))
        .await;
    [
        openai_whole(&openai),
        openai_stream(&openai_streamed),
        anthropic_whole(&anthropic),
        anthropic_stream(&anthropic_streamed),
    ]
}

/// Checks every route's outcome against the expected one; ids must satisfy `id_ok`.
fn expect(outcomes: [Outcome; 4], want: &Outcome, id_ok: impl Fn(&str) -> bool) {
    let routes = ["openai", "openai stream", "anthropic", "anthropic stream"];
    for (route, mut got) in routes.into_iter().zip(outcomes) {
        for id in &got.ids {
            assert!(id_ok(id), "{route}: call id {id:?}");
        }
        assert_eq!(got.ids.len(), got.calls.len(), "{route}");
        got.ids.clear();
        assert_eq!(&got, want, "{route}");
    }
}

fn prefixed_id(id: &str) -> bool {
    id.starts_with("call_") || id.starts_with("toolu_")
}

fn nine_alphanumeric(id: &str) -> bool {
    id.len() == 9 && id.bytes().all(|b| b.is_ascii_alphanumeric())
}

fn weather_call(arguments: Value) -> Vec<(String, Value)> {
    vec![("get_weather".to_owned(), arguments)]
}

/// A follow-up request carrying an earlier call (`id`) and its result, on both routes.
async fn follow_up(server: &Server, id: &str) -> [String; 2] {
    let openai = json!({"model": "m", "max_tokens": 5, "tools": openai_body(true, false)["tools"],
        "messages": [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"days\": 2}"}}]},
            {"role": "tool", "tool_call_id": id, "content": "Sunny"}]});
    server.ok("/v1/chat/completions", &openai).await;
    let openai_prompt = server.last_prompt();
    let anthropic = json!({"model": "m", "max_tokens": 5, "tools": anthropic_body(true, false)["tools"],
        "messages": [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": id, "name": "get_weather",
                "input": {"city": "Oslo", "days": 2}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": id, "content": "Sunny"}]}]});
    server.ok("/v1/messages", &anthropic).await;
    [openai_prompt, server.last_prompt()]
}

/// A request whose `tool_choice` forces a call, on both routes (whole): the outcomes.
async fn forced(server: &Server) -> [Outcome; 2] {
    let mut openai = openai_body(true, false);
    openai["tool_choice"] = json!("required");
    let mut anthropic = anthropic_body(true, false);
    anthropic["tool_choice"] = json!({"type": "tool", "name": "get_weather"});
    [
        openai_whole(&server.ok("/v1/chat/completions", &openai).await),
        anthropic_whole(&server.ok("/v1/messages", &anthropic).await),
    ]
}

// ---------------------------------------------------------------------------------------------
// Families through the routes
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn harmony_channels_become_reasoning_answer_and_calls() {
    let server = Server::start(&gpt_oss()).await;
    server.will_write(
        "<|channel|>analysis<|message|>The user wants the weather.<|end|>\
         <|start|>assistant<|channel|>final<|message|>Ask a weather service.<|return|>",
    );
    let want = Outcome {
        reasoning: "The user wants the weather.".into(),
        content: "Ask a weather service.".into(),
        finish: "stop".into(),
        ..Default::default()
    };
    expect(all_routes(&server, false).await, &want, prefixed_id);
    assert!(server.last_prompt().ends_with("<|start|>assistant"));

    server.will_write(
        "<|channel|>analysis<|message|>Need the weather tool.<|end|>\
         <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json\
         <|message|>{\"city\": \"Oslo\", \"days\": 2}<|call|>",
    );
    let want = Outcome {
        reasoning: "Need the weather tool.".into(),
        calls: weather_call(json!({"city": "Oslo", "days": 2})),
        finish: "tool_calls".into(),
        ..Default::default()
    };
    expect(all_routes(&server, true).await, &want, prefixed_id);
    let prompt = server.last_prompt();
    assert!(
        prompt.contains("type get_weather = (_: {\"type\": \"object\""),
        "{prompt}"
    );

    // The call and its result go back into the next prompt in harmony's form.
    for prompt in follow_up(&server, "call_1").await {
        assert!(prompt.contains(
            "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>\
             {\"city\": \"Oslo\", \"days\": 2}<|call|>\
             <|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>Sunny<|end|>"
        ), "{prompt}");
    }

    server.will_write(
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}",
    );
    for got in forced(&server).await {
        assert_eq!(got.calls, weather_call(json!({"city": "Oslo"})));
        assert_eq!(got.finish, "tool_calls");
    }
}

#[tokio::test]
async fn harmony_markup_never_reaches_a_streamed_delta() {
    let server = Server::start(&gpt_oss()).await;
    // A preamble on the commentary channel, then the answer; streamed token by token.
    server.will_write(
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>commentary\
         <|message|>One moment.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
    );
    let text = server
        .stream("/v1/chat/completions", &openai_body(false, true))
        .await;
    assert!(!text.contains("<|"), "{text}");
    let got = openai_stream(&text);
    assert_eq!(
        (got.reasoning.as_str(), got.content.as_str()),
        ("Think.", "One moment.Done.")
    );
    let text = server
        .stream("/v1/messages", &anthropic_body(false, true))
        .await;
    assert!(!text.contains("<|"), "{text}");
}

#[tokio::test]
async fn qwen3_json_calls_and_thinking() {
    let server = Server::start(&qwen3()).await;
    server.will_write(
        "<think>\nWeather needed.\n</think>\n\nLet me check.\n<tool_call>\n\
         {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>",
    );
    let want = Outcome {
        reasoning: "\nWeather needed.\n".into(),
        content: "Let me check.".into(),
        calls: weather_call(json!({"city": "Oslo"})),
        finish: "tool_calls".into(),
        ..Default::default()
    };
    expect(all_routes(&server, true).await, &want, prefixed_id);
    for prompt in follow_up(&server, "call_1").await {
        assert!(prompt.contains("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"days\": 2}}\n</tool_call>"), "{prompt}");
    }
}

#[tokio::test]
async fn qwen3_coder_xml_calls_are_typed_by_the_schema() {
    let server = Server::start(&qwen3_coder()).await;
    let call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n\
                <parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
    server.will_write(&format!("I'll check.\n{call}"));
    let want = Outcome {
        content: "I'll check.".into(),
        calls: weather_call(json!({"city": "New York", "days": 3})),
        finish: "tool_calls".into(),
        ..Default::default()
    };
    expect(all_routes(&server, true).await, &want, prefixed_id);
    for prompt in follow_up(&server, "call_1").await {
        assert!(prompt.contains("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"), "{prompt}");
        assert!(
            prompt.contains("<tool_response>\nSunny\n</tool_response>"),
            "{prompt}"
        );
    }
    server.will_write(call);
    for got in forced(&server).await {
        assert_eq!(
            got.calls,
            weather_call(json!({"city": "New York", "days": 3}))
        );
    }
}

#[tokio::test]
async fn glm_calls_and_thinking() {
    let server = Server::start(&glm45()).await;
    let call = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n\
                <arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>";
    server.will_write(&format!(
        "\n<think>The user wants the weather.</think>\nChecking.\n{call}"
    ));
    let want = Outcome {
        reasoning: "The user wants the weather.".into(),
        content: "Checking.".into(),
        calls: weather_call(json!({"city": "Oslo", "days": 2})),
        finish: "tool_calls".into(),
        ..Default::default()
    };
    expect(all_routes(&server, true).await, &want, prefixed_id);
    for prompt in follow_up(&server, "call_1").await {
        assert!(prompt.contains("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"), "{prompt}");
    }
    server.will_write(call);
    for got in forced(&server).await {
        assert_eq!(got.calls, weather_call(json!({"city": "Oslo", "days": 2})));
    }
}

#[tokio::test]
async fn gemma_without_a_system_role_gets_the_system_text_in_the_first_turn() {
    let gemma2 = Server::start(&gemma2()).await;
    let gemma3 = Server::start(&gemma3()).await;
    let body = |system: bool| {
        let mut messages = vec![json!({"role": "user", "content": "Hi!"})];
        if system {
            messages.insert(0, json!({"role": "system", "content": "Be brief."}));
        }
        json!({"model": "m", "max_tokens": 20, "messages": messages})
    };
    let want = "<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n<start_of_turn>model\n";
    for server in [&gemma2, &gemma3] {
        server.will_write("Hello.");
        let v = server.ok("/v1/chat/completions", &body(true)).await;
        assert_eq!(v["choices"][0]["message"]["content"], "Hello.");
        assert_eq!(server.last_prompt(), want);
        let anthropic = json!({"model": "m", "max_tokens": 5, "system": "Be brief.",
                               "messages": [{"role": "user", "content": "Hi!"}]});
        server.ok("/v1/messages", &anthropic).await;
        assert_eq!(server.last_prompt(), want);
        let (status, v) = gemma2.post("/v1/messages/count_tokens", &anthropic).await;
        assert_eq!(status, StatusCode::OK, "{v}");
    }
    gemma2.ok("/v1/chat/completions", &body(false)).await;
    assert_eq!(
        gemma2.last_prompt(),
        "<bos><start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\n"
    );
    // Other refusals of the template still reach the client.
    let (status, v) = gemma2
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "system", "content": "s"},
                {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("roles must alternate"),
        "{v}"
    );
}

#[tokio::test]
async fn mistral_calls_carry_nine_character_ids_that_round_trip() {
    let server = Server::start(&mistral()).await;
    let want = Outcome {
        calls: weather_call(json!({"city": "Oslo"})),
        finish: "tool_calls".into(),
        ..Default::default()
    };
    for output in [
        "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}]",
        "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Oslo\"}",
    ] {
        server.will_write(output);
        expect(all_routes(&server, true).await, &want, nine_alphanumeric);
    }
    let v = server
        .ok("/v1/chat/completions", &openai_body(true, false))
        .await;
    let id = openai_whole(&v).ids[0].clone();
    for prompt in follow_up(&server, &id).await {
        assert!(
            prompt.contains(&format!("\"id\": \"{id}\"}}]</s>")),
            "{prompt}"
        );
        assert!(
            prompt.contains(&format!("\"call_id\": \"{id}\"}}[/TOOL_RESULTS]")),
            "{prompt}"
        );
    }
    // Ids of another model's calls are turned into ids the template accepts, the same for a
    // call and its result.
    for prompt in follow_up(&server, "call_f00d0123456789abcdef").await {
        let at = prompt.find("\"id\": \"").unwrap() + 7;
        let id = &prompt[at..at + 9];
        assert!(nine_alphanumeric(id), "{prompt}");
        assert!(
            prompt.contains(&format!("\"call_id\": \"{id}\"")),
            "{prompt}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Choosing the parser, and the parsers on any input
// ---------------------------------------------------------------------------------------------

#[test]
fn each_family_template_picks_its_parser() {
    let cases = [
        (gpt_oss(), ToolFormat::Harmony, ReasoningFormat::Harmony),
        (qwen3(), ToolFormat::Hermes, ReasoningFormat::ThinkTags),
        (qwen3_coder(), ToolFormat::QwenXml, ReasoningFormat::None),
        (glm45(), ToolFormat::Glm, ReasoningFormat::ThinkTags),
        (gemma2(), ToolFormat::Llama3Json, ReasoningFormat::None),
        (gemma3(), ToolFormat::Llama3Json, ReasoningFormat::None),
        (mistral(), ToolFormat::Mistral, ReasoningFormat::None),
    ];
    for (family, tools, reasoning) in cases {
        let format = ChatFormat::detect(&family.template);
        assert_eq!((format.tools, format.reasoning), (tools, reasoning));
    }
}

/// Pieces of markup of every format, and text, for random outputs.
const FRAGMENTS: &[&str] = &[
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "<function=",
    "<parameter=",
    "</parameter>",
    "</function>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "<|python_tag|>",
    "<|channel|>",
    "<|message|>",
    "<|start|>",
    "<|end|>",
    "<|call|>",
    "<|constrain|>",
    " to=functions.",
    "analysis",
    "final",
    "commentary",
    "get_weather",
    "{",
    "}",
    "[",
    "]",
    "\"",
    ":",
    ",",
    "\n",
    " ",
    "<",
    ">",
    "é",
    "🫠",
    "name",
    "arguments",
    "1",
    "x",
];

fn tools() -> Vec<ToolSpec> {
    vec![ToolSpec {
        name: "get_weather".into(),
        description: None,
        parameters: weather_schema(),
    }]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]

    /// Any output, cut anywhere: no parser panics, and what a parser lets out as text is
    /// all of the input when it finds no structure (nothing is lost silently).
    #[test]
    fn parsers_take_any_output(
        picks in proptest::collection::vec(0..FRAGMENTS.len(), 0..40),
        cuts in proptest::collection::vec(1usize..8, 1..8),
    ) {
        let text: String = picks.iter().map(|&i| FRAGMENTS[i]).collect();
        let chars: Vec<char> = text.chars().collect();
        let mut chunks = Vec::new();
        let (mut at, mut k) = (0, 0);
        while at < chars.len() {
            let n = cuts[k % cuts.len()].min(chars.len() - at);
            chunks.push(chars[at..at + n].iter().collect::<String>());
            at += n;
            k += 1;
        }
        for format in [ToolFormat::Llama3Json, ToolFormat::Hermes, ToolFormat::QwenXml,
                       ToolFormat::Glm, ToolFormat::Mistral, ToolFormat::Harmony] {
            let mut p = ToolStream::with_tools(format, tools());
            let mut calls = 0;
            let mut text_out = String::new();
            for chunk in &chunks {
                for piece in p.push(chunk) {
                    match piece {
                        mlxd_engine::server::tools::ToolPiece::Text(t) => text_out.push_str(&t),
                        mlxd_engine::server::tools::ToolPiece::Call(_) => calls += 1,
                    }
                }
            }
            for piece in p.finish() {
                match piece {
                    mlxd_engine::server::tools::ToolPiece::Text(t) => text_out.push_str(&t),
                    mlxd_engine::server::tools::ToolPiece::Call(_) => calls += 1,
                }
            }
            if calls == 0 {
                proptest::prop_assert_eq!(&text_out, &text, "{:?}", format);
            }
        }
        for parse_calls in [false, true] {
            let mut h = HarmonyStream::new(parse_calls);
            let mut pieces: Vec<Piece> = Vec::new();
            for chunk in &chunks {
                pieces.extend(h.push(chunk));
            }
            pieces.extend(h.finish());
            if !text.contains("<|") {
                // No harmony markup at all: all of it is answer text.
                let all: String = pieces.iter().map(|p| match p {
                    Piece::Content(t) => t.clone(),
                    other => panic!("{other:?} from {text:?}"),
                }).collect();
                proptest::prop_assert_eq!(&all, &text);
            }
        }
        let mut r = ReasoningSplit::new("");
        for chunk in &chunks {
            r.push(chunk);
        }
        r.finish();
    }
}
