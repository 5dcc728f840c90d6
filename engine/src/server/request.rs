//! Request bodies: JSON parsing with OpenAI-shaped errors that name the field, and validation
//! of the generation parameters against the model.
use std::collections::HashMap;

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use mlxd_protocol::openai::{GenerationParams, Prompt};
use mlxd_protocol::request::{decode, parse_object};
use serde::de::DeserializeOwned;

use super::error::ApiError;
use crate::runtime::sampling_params::SamplingParams;
use crate::tokenizer::Tokenizer;

/// Largest request body accepted (long prompts are large).
pub const MAX_BODY_BYTES: usize = 32 * 1024 * 1024;
pub use crate::runtime::request::MAX_TOP_LOGPROBS;
/// Most stop strings per request.
pub const MAX_STOP_STRINGS: usize = 16;

/// A JSON body deserialized into `T`; every failure is a 400 (413 when too large) in the
/// OpenAI error shape, with `param` set to the path of the offending field.
pub struct OpenAiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for OpenAiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            if rejection.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::TooLarge {
                    limit: MAX_BODY_BYTES,
                }
            } else {
                ApiError::invalid_body(format!("cannot read the request body: {rejection}"))
            }
        })?;
        parse_body(&bytes).map(OpenAiJson)
    }
}

/// Parses a request body by the request contract (`mlxd_protocol::request`, the rules the
/// proxy applies too): first as a JSON object, then the shared generation fields (so their
/// errors name the field even though the request type flattens them), then `T`.
pub fn parse_body<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let value = parse_object(bytes)?;
    let _: GenerationParams = decode(&value)?;
    Ok(decode(&value)?)
}

/// The validated generation settings of a request.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub sampling: SamplingParams,
    /// As requested, before clamping to the context (`None`: up to the context's end).
    pub max_tokens: Option<usize>,
    pub stops: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Ids to continue from (the `mlxd.resume_token_ids` extension).
    pub resume: Vec<u32>,
    /// Choices to generate (`n`).
    pub n: usize,
    /// Report log-probabilities with this many alternatives per token (set by the route,
    /// whose field names differ: [`chat_logprobs`], [`completion_logprobs`]).
    pub logprobs: Option<usize>,
    /// The `model` asked for: `"<model>:<adapter>"` selects a LoRA adapter
    /// ([`super::ServerState::adapter_for`]).
    pub model: Option<String>,
}

/// Chat's `logprobs` (bool) and `top_logprobs` (0–20, only with `logprobs`).
pub fn chat_logprobs(logprobs: Option<bool>, top: Option<i64>) -> Result<Option<usize>, ApiError> {
    let top = top
        .map(|k| check_top_logprobs("top_logprobs", k))
        .transpose()?;
    match (logprobs.unwrap_or(false), top) {
        (true, top) => Ok(Some(top.unwrap_or(0))),
        (false, None) => Ok(None),
        (false, Some(_)) => Err(ApiError::invalid(
            "top_logprobs",
            "top_logprobs needs logprobs set to true",
        )),
    }
}

/// Completions' `logprobs`: the number of alternatives (0–20).
pub fn completion_logprobs(logprobs: Option<i64>) -> Result<Option<usize>, ApiError> {
    logprobs
        .map(|k| check_top_logprobs("logprobs", k))
        .transpose()
}

fn check_top_logprobs(field: &str, k: i64) -> Result<usize, ApiError> {
    if (0..=MAX_TOP_LOGPROBS as i64).contains(&k) {
        Ok(k as usize)
    } else {
        Err(ApiError::invalid(
            field,
            format!("{field} must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
        ))
    }
}

/// Checks the shared parameters; every error names its field and the limit it broke.
pub fn validate(params: &GenerationParams, tokenizer: &Tokenizer) -> Result<Settings, ApiError> {
    // The contract's fields first, by the rules the proxy applied to the same body.
    let facts = params.facts()?;
    let max_tokens = facts
        .max_tokens
        .map(|l| usize::try_from(l.value).unwrap_or(usize::MAX));

    let mut sampling = SamplingParams::default();
    if let Some(t) = params.temperature {
        // Checked as the f32 the sampler uses: 1e39 is a finite f64 but an infinite f32.
        if !(t >= 0.0 && (t as f32).is_finite()) {
            return Err(ApiError::invalid(
                "temperature",
                format!(
                    "temperature must be at least 0 and at most {:e}, got {t}",
                    f32::MAX
                ),
            ));
        }
        sampling.temperature = t as f32;
    }
    if let Some(p) = params.top_p {
        if !(p > 0.0 && p <= 1.0) {
            return Err(ApiError::invalid(
                "top_p",
                format!("top_p must be in (0, 1], got {p}"),
            ));
        }
        sampling.top_p = p as f32;
    }
    if let Some(k) = params.top_k {
        if k < -1 {
            return Err(ApiError::invalid(
                "top_k",
                format!("top_k must be at least 0 (or -1 to disable it), got {k}"),
            ));
        }
        sampling.top_k = usize::try_from(k.max(0)).unwrap_or(usize::MAX);
    }
    if let Some(p) = params.min_p {
        if !(0.0..=1.0).contains(&p) {
            return Err(ApiError::invalid(
                "min_p",
                format!("min_p must be in [0, 1], got {p}"),
            ));
        }
        sampling.min_p = p as f32;
    }
    if let Some(r) = params.repetition_penalty {
        if !(r > 0.0 && (r as f32).is_finite()) {
            return Err(ApiError::invalid(
                "repetition_penalty",
                format!("repetition_penalty must be greater than 0, got {r}"),
            ));
        }
        sampling.repetition_penalty = r as f32;
    }
    for (field, value, slot) in [
        (
            "presence_penalty",
            params.presence_penalty,
            &mut sampling.presence_penalty,
        ),
        (
            "frequency_penalty",
            params.frequency_penalty,
            &mut sampling.frequency_penalty,
        ),
    ] {
        if let Some(v) = value {
            if !(-2.0..=2.0).contains(&v) {
                return Err(ApiError::invalid(
                    field,
                    format!("{field} must be in [-2, 2], got {v}"),
                ));
            }
            *slot = v as f32;
        }
    }
    if let Some(bias) = &params.logit_bias {
        sampling.logit_bias = logit_bias(bias, tokenizer)?;
    }
    sampling.seed = params.seed.map(|s| s as u64);

    let stops = params.stop.as_ref().map(|s| s.to_vec()).unwrap_or_default();
    if stops.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "at most {MAX_STOP_STRINGS} stop strings are supported, got {}",
                stops.len()
            ),
        ));
    }
    let resume = facts.resume_token_ids;
    if let Some(bad) = resume.iter().find(|&&id| !tokenizer.contains_id(id)) {
        return Err(ApiError::invalid(
            "mlxd.resume_token_ids",
            format!(
                "resume token id {bad} is not in the vocabulary (size {})",
                tokenizer.vocab_size()
            ),
        ));
    }
    Ok(Settings {
        sampling,
        max_tokens,
        stops,
        stream: facts.stream,
        include_usage: facts.include_usage,
        resume,
        n: facts.n as usize,
        logprobs: None,
        // Set by the route, which holds the body's `model`.
        model: None,
    })
}

fn logit_bias(
    bias: &std::collections::BTreeMap<String, f64>,
    tokenizer: &Tokenizer,
) -> Result<HashMap<u32, f32>, ApiError> {
    let vocab = tokenizer.vocab_size();
    let mut out = HashMap::with_capacity(bias.len());
    for (key, &value) in bias {
        let id: u32 = key.trim().parse().map_err(|_| {
            ApiError::invalid(
                "logit_bias",
                format!("logit_bias keys must be token ids, got {key:?}"),
            )
        })?;
        if !tokenizer.contains_id(id) {
            return Err(ApiError::invalid(
                "logit_bias",
                format!(
                    "logit_bias names token id {id}, which is not in the vocabulary (size {vocab})"
                ),
            ));
        }
        if !(-100.0..=100.0).contains(&value) {
            return Err(ApiError::invalid(
                "logit_bias",
                format!("logit_bias values must be in [-100, 100], got {value} for token {id}"),
            ));
        }
        out.insert(id, value as f32);
    }
    Ok(out)
}

/// Token ids of a `/v1/completions` prompt. Text is encoded with the tokenizer's special
/// tokens (BOS where the model wants it); token ids are taken as they are.
pub fn completion_prompt(prompt: &Prompt, tokenizer: &Tokenizer) -> Result<Vec<u32>, ApiError> {
    let one = |n: usize| {
        ApiError::invalid(
            "prompt",
            format!("only one prompt per request is supported, got {n}"),
        )
    };
    let ids = match prompt {
        Prompt::Text(text) => tokenizer.encode(text, true)?,
        Prompt::Texts(texts) => match texts.as_slice() {
            [text] => tokenizer.encode(text, true)?,
            _ => return Err(one(texts.len())),
        },
        Prompt::Tokens(ids) => checked_ids(ids.clone(), tokenizer)?,
        Prompt::TokenLists(lists) => match lists.as_slice() {
            [ids] => checked_ids(ids.clone(), tokenizer)?,
            _ => return Err(one(lists.len())),
        },
    };
    if ids.is_empty() {
        return Err(ApiError::invalid(
            "prompt",
            "the prompt is empty (it has no tokens)",
        ));
    }
    Ok(ids)
}

fn checked_ids(ids: Vec<u32>, tokenizer: &Tokenizer) -> Result<Vec<u32>, ApiError> {
    if let Some(bad) = ids.iter().find(|&&id| !tokenizer.contains_id(id)) {
        return Err(ApiError::invalid(
            "prompt",
            format!(
                "prompt token id {bad} is not in the vocabulary (size {})",
                tokenizer.vocab_size()
            ),
        ));
    }
    Ok(ids)
}

/// How many tokens to generate: the request's `max_tokens`, at most what the context has
/// left. Fails when the prompt leaves no room for even one token.
pub fn token_budget(
    prompt_tokens: usize,
    requested: Option<usize>,
    context_length: usize,
    param: &str,
) -> Result<usize, ApiError> {
    if prompt_tokens + 1 > context_length {
        return Err(ApiError::invalid(
            param,
            format!(
                "the prompt is too long: {prompt_tokens} tokens, and the model's context length is \
                 {context_length} tokens (prompt tokens + 1 must be at most {context_length})"
            ),
        )
        .with_code("context_length_exceeded"));
    }
    let room = context_length - prompt_tokens;
    Ok(requested.map_or(room, |r| r.min(room)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tests::load_fixture;
    use mlxd_protocol::openai::{ChatCompletionRequest, CompletionRequest};

    fn err_of<T: DeserializeOwned + std::fmt::Debug>(body: &str) -> (Option<String>, String) {
        let e = parse_body::<T>(body.as_bytes()).unwrap_err();
        let b = e.body();
        assert_eq!(e.status().as_u16(), 400, "{body}: {e}");
        (b.error.param, b.error.message)
    }

    #[test]
    fn body_errors_name_the_field() {
        let (param, msg) = err_of::<ChatCompletionRequest>("{not json");
        assert_eq!(param, None);
        assert!(msg.contains("not valid JSON"), "{msg}");
        let (param, msg) = err_of::<ChatCompletionRequest>("[1]");
        assert_eq!(param, None);
        assert!(msg.contains("JSON object, not an array"), "{msg}");
        let (param, _) = err_of::<ChatCompletionRequest>("");
        assert_eq!(param, None);
        let (param, msg) = err_of::<ChatCompletionRequest>(r#"{"model": "m"}"#);
        assert_eq!(param.as_deref(), Some("messages"));
        assert_eq!(msg, "`messages` is required");
        let (param, _) = err_of::<ChatCompletionRequest>(r#"{"messages": "hi"}"#);
        assert_eq!(param.as_deref(), Some("messages"));
        let (param, msg) =
            err_of::<ChatCompletionRequest>(r#"{"messages": [{"role": "robot", "content": "x"}]}"#);
        assert_eq!(param.as_deref(), Some("messages[0].role"));
        assert!(msg.contains("robot"), "{msg}");
        let (param, msg) =
            err_of::<ChatCompletionRequest>(r#"{"messages": [{"role": "user", "content": 5}]}"#);
        assert_eq!(param.as_deref(), Some("messages[0].content"));
        assert!(msg.contains("list of"), "{msg}");
        let (param, _) = err_of::<ChatCompletionRequest>(
            r#"{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}"#,
        );
        assert_eq!(param.as_deref(), Some("temperature"));
        let (param, msg) = err_of::<ChatCompletionRequest>(
            r#"{"messages": [{"role": "user", "content": "x"}], "stop": 3}"#,
        );
        assert_eq!(param.as_deref(), Some("stop"));
        assert!(msg.contains("string or a list of strings"), "{msg}");
        let (param, msg) = err_of::<ChatCompletionRequest>(
            r#"{"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": 1}}"#,
        );
        assert_eq!(param.as_deref(), Some("stream_options"));
        assert!(msg.contains("include_usage must be a boolean"), "{msg}");
        // A sequence is not an object, though serde's derived form would read it as one.
        let (param, msg) = err_of::<ChatCompletionRequest>(
            r#"{"messages": [{"role": "user", "content": "x"}], "stream_options": []}"#,
        );
        assert_eq!(param.as_deref(), Some("stream_options"));
        assert!(msg.contains("must be an object"), "{msg}");
        let (param, msg) = err_of::<CompletionRequest>(r#"{"prompt": {"a": 1}}"#);
        assert_eq!(param.as_deref(), Some("prompt"));
        assert!(msg.contains("list of token ids"), "{msg}");
    }

    fn params(json: &str) -> GenerationParams {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn validation_quotes_value_and_limit() {
        let tok = load_fixture("qwen3");
        let cases = [
            (r#"{"n": 9}"#, "n", "n must be between 1 and 8, got n = 9"),
            (
                r#"{"max_tokens": 0}"#,
                "max_tokens",
                "max_tokens must be at least 1, got 0",
            ),
            (
                r#"{"max_completion_tokens": -5}"#,
                "max_completion_tokens",
                "max_completion_tokens must be at least 1, got -5",
            ),
            (
                r#"{"temperature": -0.5}"#,
                "temperature",
                "temperature must be at least 0 and at most 3.4028235e38, got -0.5",
            ),
            (
                r#"{"temperature": 1e39}"#,
                "temperature",
                "temperature must be at least 0 and at most 3.4028235e38, got 1000000000000000000000000000000000000000",
            ),
            (r#"{"top_p": 0}"#, "top_p", "top_p must be in (0, 1], got 0"),
            (
                r#"{"top_p": 1.5}"#,
                "top_p",
                "top_p must be in (0, 1], got 1.5",
            ),
            (
                r#"{"top_k": -2}"#,
                "top_k",
                "top_k must be at least 0 (or -1 to disable it), got -2",
            ),
            (r#"{"min_p": 2}"#, "min_p", "min_p must be in [0, 1], got 2"),
            (
                r#"{"repetition_penalty": 0}"#,
                "repetition_penalty",
                "repetition_penalty must be greater than 0, got 0",
            ),
            (
                r#"{"presence_penalty": 3}"#,
                "presence_penalty",
                "presence_penalty must be in [-2, 2], got 3",
            ),
            (
                r#"{"logit_bias": {"abc": 1}}"#,
                "logit_bias",
                "logit_bias keys must be token ids, got \"abc\"",
            ),
            (
                r#"{"logit_bias": {"999999999": 1}}"#,
                "logit_bias",
                "logit_bias names token id 999999999, which is not in the vocabulary (size 151669)",
            ),
            (
                r#"{"logit_bias": {"5": 101}}"#,
                "logit_bias",
                "logit_bias values must be in [-100, 100], got 101 for token 5",
            ),
        ];
        for (json, param, message) in cases {
            let e = validate(&params(json), &tok).unwrap_err();
            let body = e.body();
            assert_eq!(body.error.param.as_deref(), Some(param), "{json}");
            assert_eq!(body.error.message, message, "{json}");
        }
    }

    #[test]
    fn valid_parameters_become_sampling_params() {
        let tok = load_fixture("qwen3");
        let s = validate(
            &params(
                r#"{"max_tokens": 10, "max_completion_tokens": 7, "temperature": 0.7, "top_p": 0.9,
                    "top_k": -1, "min_p": 0.1, "repetition_penalty": 1.2, "presence_penalty": 0.5,
                    "frequency_penalty": -1, "logit_bias": {"42": -100}, "seed": -1,
                    "stop": ["a", ""], "stream": true, "stream_options": {"include_usage": true}, "n": 1}"#,
            ),
            &tok,
        )
        .unwrap();
        assert_eq!(s.max_tokens, Some(7));
        assert_eq!(s.sampling.temperature, 0.7);
        assert_eq!(s.sampling.top_k, 0);
        assert_eq!(s.sampling.logit_bias, HashMap::from([(42, -100.0)]));
        assert_eq!(s.sampling.seed, Some(u64::MAX));
        assert_eq!(s.stops, vec!["a"]);
        assert!(s.stream && s.include_usage);
        let s = validate(&GenerationParams::default(), &tok).unwrap();
        assert_eq!(s.sampling, SamplingParams::default());
        assert_eq!(s.max_tokens, None);
    }

    #[test]
    fn prompts_and_budget() {
        let tok = load_fixture("gemma3");
        assert_eq!(
            completion_prompt(&Prompt::Text("Hello".into()), &tok).unwrap()[0],
            2,
            "gemma adds <bos>"
        );
        assert_eq!(
            completion_prompt(&Prompt::TokenLists(vec![vec![2, 9259]]), &tok).unwrap(),
            vec![2, 9259]
        );
        let e = completion_prompt(&Prompt::Texts(vec!["a".into(), "b".into()]), &tok).unwrap_err();
        assert_eq!(
            e.body().error.message,
            "only one prompt per request is supported, got 2"
        );
        let e = completion_prompt(&Prompt::Tokens(vec![]), &tok).unwrap_err();
        assert_eq!(e.body().error.param.as_deref(), Some("prompt"));
        let e = completion_prompt(&Prompt::Tokens(vec![4_000_000]), &tok).unwrap_err();
        assert!(e.body().error.message.contains("4000000"));

        assert_eq!(token_budget(10, None, 16, "messages").unwrap(), 6);
        assert_eq!(token_budget(10, Some(3), 16, "messages").unwrap(), 3);
        assert_eq!(token_budget(15, Some(100), 16, "messages").unwrap(), 1);
        let e = token_budget(16, None, 16, "messages").unwrap_err();
        let body = e.body();
        assert_eq!(body.error.code.as_deref(), Some("context_length_exceeded"));
        assert!(
            body.error.message.contains("16 tokens"),
            "{}",
            body.error.message
        );
    }

    /// The proxy (`RequestFacts::read`, on the bytes it received) and the engine (its
    /// extractor and `validate`) agree on every request: both accept it with the same model,
    /// token limit, stream, `n` and resume ids, or both refuse it naming the same field with
    /// the same message. Token fields come in both orders, with values of every kind.
    mod contract {
        use super::*;
        use mlxd_protocol::anthropic::MessagesRequest;
        use mlxd_protocol::request::{messages_params, RequestFacts, Route};
        use proptest::prelude::*;
        use serde_json::{json, Value};

        fn number_field() -> impl Strategy<Value = Option<Value>> {
            prop_oneof![
                3 => Just(None),
                1 => Just(Some(Value::Null)),
                4 => (-2i64..600).prop_map(|n| Some(json!(n))),
                1 => Just(Some(json!(u64::MAX))),
                1 => Just(Some(json!(i64::MIN))),
                1 => Just(Some(json!("10"))),
                1 => Just(Some(json!(1.5))),
                1 => Just(Some(json!(true))),
            ]
        }

        fn flag_field() -> impl Strategy<Value = Option<Value>> {
            prop_oneof![
                Just(None),
                Just(Some(Value::Null)),
                any::<bool>().prop_map(|b| Some(json!(b))),
                Just(Some(json!("yes"))),
            ]
        }

        #[derive(Debug, Clone)]
        struct Body {
            route: Route,
            /// The fields in the order they are written.
            fields: Vec<(&'static str, Value)>,
        }

        impl Body {
            fn bytes(&self) -> Vec<u8> {
                let fields: Vec<String> = self
                    .fields
                    .iter()
                    .map(|(k, v)| format!("{}: {v}", json!(k)))
                    .collect();
                format!("{{{}}}", fields.join(", ")).into_bytes()
            }
        }

        fn body() -> impl Strategy<Value = Body> {
            let route = prop_oneof![
                Just(Route::ChatCompletions),
                Just(Route::Completions),
                Just(Route::Messages)
            ];
            let model = prop_oneof![
                Just(None),
                Just(Some(json!("m"))),
                Just(Some(json!(7))),
                Just(Some(Value::Null))
            ];
            let resume = prop_oneof![
                Just(None),
                proptest::collection::vec(1u32..100, 0..4)
                    .prop_map(|v| Some(json!({"resume_token_ids": v}))),
            ];
            let include_usage = prop_oneof![
                Just(None),
                any::<bool>().prop_map(|b| Some(json!({"include_usage": b}))),
            ];
            (
                route,
                model,
                number_field(),
                number_field(),
                number_field(),
                flag_field(),
                include_usage,
                resume,
                any::<bool>(),
            )
                .prop_map(
                    |(route, model, max_tokens, max_completion, n, stream, usage, resume, swap)| {
                        let mut fields = vec![match route {
                            Route::Completions => ("prompt", json!("Hello")),
                            _ => ("messages", json!([{"role": "user", "content": "hi"}])),
                        }];
                        let mut tokens = vec![
                            ("max_tokens", max_tokens),
                            ("max_completion_tokens", max_completion),
                        ];
                        if swap {
                            tokens.reverse();
                        }
                        let rest = [
                            ("model", model),
                            ("n", n),
                            ("stream", stream),
                            ("stream_options", usage),
                            ("mlxd", resume),
                        ];
                        for (k, v) in tokens.into_iter().chain(rest) {
                            if let Some(v) = v {
                                fields.push((k, v));
                            }
                        }
                        Body { route, fields }
                    },
                )
        }

        /// What the engine makes of `bytes` on `route`: the model and the settings, or the
        /// error's (param, message).
        fn engine(
            route: Route,
            bytes: &[u8],
            tok: &Tokenizer,
        ) -> Result<(Option<String>, Settings), (Option<String>, String)> {
            let failed = |e: ApiError| {
                let b = e.body();
                (b.error.param, b.error.message)
            };
            match route {
                Route::ChatCompletions => {
                    let r: ChatCompletionRequest = parse_body(bytes).map_err(failed)?;
                    Ok((r.model, validate(&r.params, tok).map_err(failed)?))
                }
                Route::Completions => {
                    let r: CompletionRequest = parse_body(bytes).map_err(failed)?;
                    Ok((r.model, validate(&r.params, tok).map_err(failed)?))
                }
                _ => {
                    let r: MessagesRequest = parse_body(bytes).map_err(failed)?;
                    let params = messages_params(r.max_tokens, r.stream);
                    Ok((r.model, validate(&params, tok).map_err(failed)?))
                }
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]
            #[test]
            fn proxy_and_engine_agree_on_every_request(body in body()) {
                let tok = load_fixture("qwen3");
                let bytes = body.bytes();
                let proxy = mlxd_protocol::request::parse_object(&bytes)
                    .and_then(|v| RequestFacts::read(body.route, &v))
                    .map_err(|e| (e.param, e.message));
                let engine = engine(body.route, &bytes, &tok);
                let text = String::from_utf8_lossy(&bytes).into_owned();
                match (proxy, engine) {
                    (Ok(facts), Ok((model, s))) => {
                        let g = &facts.generation;
                        prop_assert_eq!(facts.model, model, "{}", text);
                        prop_assert_eq!(g.max_tokens.map(|l| l.value as usize), s.max_tokens, "{}", text);
                        prop_assert_eq!(g.stream, s.stream, "{}", text);
                        prop_assert_eq!(g.include_usage, s.include_usage, "{}", text);
                        prop_assert_eq!(g.n as usize, s.n, "{}", text);
                        prop_assert_eq!(&g.resume_token_ids, &s.resume, "{}", text);
                    }
                    (Err(p), Err(e)) => prop_assert_eq!(p, e, "{}", text),
                    (p, e) => prop_assert!(false, "{text}: proxy {p:?}, engine {e:?}"),
                }
            }
        }
    }
}
