//! The request contract: how a request body is read and which of its generation fields are
//! valid, written once for both sides. The proxy reads the [`RequestFacts`] it routes and
//! admits by (before any engine wakes); the engine checks the same fields with the same
//! functions before it generates, so the two cannot disagree about what a request asked for
//! (issue 22: the proxy once read `max_tokens` first where the engine, as OpenAI specifies,
//! reads `max_completion_tokens` first).
//!
//! Errors name the field at fault (`param`, a JSON path such as `messages[0].role`) and say
//! what the limit was and what broke it, as the OpenAI error object expects.
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

use crate::openai::GenerationParams;

/// Most choices (`n`) per request; each is its own sequence in the engine's batch.
pub const MAX_CHOICES: u32 = 8;

/// A request that breaks the contract: the field at fault, if one is, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct FieldError {
    /// The JSON path of the field (`max_tokens`, `messages[0].content`); `None` when the
    /// body as a whole is wrong.
    pub param: Option<String>,
    pub message: String,
}

impl FieldError {
    pub fn field(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            param: Some(param.into()),
            message: message.into(),
        }
    }

    pub fn body(message: impl Into<String>) -> Self {
        Self {
            param: None,
            message: message.into(),
        }
    }
}

/// Parses a request body as JSON that must be an object; the value returned is always
/// `Value::Object`.
pub fn parse_object(body: &[u8]) -> Result<Value, FieldError> {
    if body.is_empty() {
        return Err(FieldError::body(
            "the request body is empty; expected a JSON object",
        ));
    }
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| FieldError::body(format!("the request body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(FieldError::body(format!(
            "the request body must be a JSON object, not {}",
            json_kind(&value)
        )));
    }
    Ok(value)
}

/// Deserializes `T` from a parsed body; a failure names the path of the offending field (a
/// missing field is named itself: "`messages` is required").
pub fn decode<T: DeserializeOwned>(value: &Value) -> Result<T, FieldError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        if path == "." || path.is_empty() {
            // Missing fields are reported at the parent: "missing field `messages`".
            let param = inner
                .strip_prefix("missing field `")
                .and_then(|rest| rest.strip_suffix('`'))
                .map(str::to_owned);
            match param {
                Some(param) => FieldError::field(param.clone(), format!("`{param}` is required")),
                None => FieldError::body(format!("invalid request: {inner}")),
            }
        } else {
            let last = path.rsplit('.').next().unwrap_or(&path);
            let field = last.split('[').next().unwrap_or(last);
            let hint = match field {
                "prompt" => "must be a string, a list of one string, or a list of token ids",
                "stop" => "must be a string or a list of strings",
                "content" => {
                    "must be a string, null, or a list of {\"type\": \"text\", \"text\": ...} parts"
                }
                _ => "",
            };
            let message = if hint.is_empty() || !inner.contains("untagged") {
                format!("invalid `{path}`: {inner}")
            } else {
                format!("invalid `{path}`: {hint}")
            };
            FieldError::field(path, message)
        }
    })
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A request's token limit and the field it came in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenLimit {
    /// `max_completion_tokens` or `max_tokens`.
    pub field: &'static str,
    pub value: u64,
}

/// The generation fields both sides act on, checked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GenerationFacts {
    /// As requested (`None`: up to the end of the context).
    pub max_tokens: Option<TokenLimit>,
    pub stream: bool,
    pub include_usage: bool,
    /// Choices to generate (`n`), 1 to [`MAX_CHOICES`].
    pub n: u32,
    /// Ids to continue from (the `mlxd.resume_token_ids` extension).
    pub resume_token_ids: Vec<u32>,
}

impl GenerationParams {
    /// The token limit asked for: `max_completion_tokens` when given, else `max_tokens` (as
    /// OpenAI specifies: the newer name wins); at least 1.
    pub fn max_tokens(&self) -> Result<Option<TokenLimit>, FieldError> {
        let given = match (self.max_completion_tokens, self.max_tokens) {
            (Some(v), _) => Some(("max_completion_tokens", v)),
            (None, Some(v)) => Some(("max_tokens", v)),
            (None, None) => None,
        };
        match given {
            None => Ok(None),
            Some((field, v)) if v < 1 => Err(FieldError::field(
                field,
                format!("{field} must be at least 1, got {v}"),
            )),
            Some((field, v)) => Ok(Some(TokenLimit {
                field,
                value: v as u64,
            })),
        }
    }

    /// `n`: 1 when absent, else 1 to [`MAX_CHOICES`].
    pub fn choices(&self) -> Result<u32, FieldError> {
        match self.n {
            None => Ok(1),
            Some(n) if (1..=i64::from(MAX_CHOICES)).contains(&n) => Ok(n as u32),
            Some(n) => Err(FieldError::field(
                "n",
                format!("n must be between 1 and {MAX_CHOICES}, got n = {n}"),
            )),
        }
    }

    /// Every rule on the fields in [`GenerationFacts`], in the order the engine has always
    /// checked them (so the first error reported is the same).
    pub fn facts(&self) -> Result<GenerationFacts, FieldError> {
        let n = self.choices()?;
        let max_tokens = self.max_tokens()?;
        let resume_token_ids = self.resume_token_ids().to_vec();
        if let Some(limit) = max_tokens {
            if resume_token_ids.len() as u64 >= limit.value {
                return Err(FieldError::field(
                    "mlxd.resume_token_ids",
                    format!(
                        "{} resumed tokens leave nothing to generate within {} = {}",
                        resume_token_ids.len(),
                        limit.field,
                        limit.value
                    ),
                ));
            }
        }
        Ok(GenerationFacts {
            max_tokens,
            stream: self.is_stream(),
            include_usage: self.include_usage(),
            n,
            resume_token_ids,
        })
    }
}

/// The routes whose bodies the contract knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `/v1/chat/completions`.
    ChatCompletions,
    /// `/v1/completions`.
    Completions,
    /// Anthropic's `/v1/messages` (`max_tokens` required).
    Messages,
    /// Any other JSON route: only `model` is read.
    Other,
}

impl Route {
    pub fn for_path(path: &str) -> Self {
        match path {
            "/v1/chat/completions" => Self::ChatCompletions,
            "/v1/completions" => Self::Completions,
            "/v1/messages" => Self::Messages,
            _ => Self::Other,
        }
    }

    /// Whether the route generates tokens (and so has a token limit).
    pub fn generates(self) -> bool {
        !matches!(self, Self::Other)
    }

    /// Whether a stream of this route can be continued on another engine (the engine tags
    /// its chunks with token ids).
    pub fn resumable(self) -> bool {
        matches!(self, Self::ChatCompletions | Self::Completions)
    }
}

/// What the proxy needs to know of a request: where it goes and what it may cost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestFacts {
    pub route: Route,
    pub model: Option<String>,
    /// Default (`n` = 1, no limit, not streamed) for a route that does not generate.
    pub generation: GenerationFacts,
}

#[derive(Deserialize)]
struct ModelField {
    #[serde(default)]
    model: Option<String>,
}

/// The fields of an Anthropic request the contract reads, in one struct so that their
/// errors come in the order the engine's `MessagesRequest` reports them.
#[derive(Deserialize)]
struct MessagesFields {
    #[serde(default)]
    model: Option<String>,
    max_tokens: i64,
    #[serde(default)]
    stream: Option<bool>,
}

impl RequestFacts {
    /// Reads and checks a parsed body ([`parse_object`]) of `route` in the engine's order:
    /// the shared generation fields' types, the route's own fields, then the rules.
    pub fn read(route: Route, body: &Value) -> Result<Self, FieldError> {
        let (model, generation) = match route {
            Route::Other => {
                let ModelField { model } = decode(body)?;
                let generation = GenerationFacts {
                    n: 1,
                    ..GenerationFacts::default()
                };
                (model, generation)
            }
            Route::ChatCompletions | Route::Completions => {
                let params: GenerationParams = decode(body)?;
                let ModelField { model } = decode(body)?;
                (model, params.facts()?)
            }
            Route::Messages => {
                decode::<GenerationParams>(body)?;
                let fields: MessagesFields = decode(body)?;
                let generation = messages_params(fields.max_tokens, fields.stream).facts()?;
                (fields.model, generation)
            }
        };
        Ok(Self {
            route,
            model,
            generation,
        })
    }

    /// Whether the request can be continued on another engine: a resumable route and one
    /// choice (`n` > 1 interleaves choices whose token ids a record does not separate).
    pub fn resumable(&self) -> bool {
        self.route.resumable() && self.generation.n == 1
    }

    /// The most tokens the request may generate under the server's `ceiling`
    /// (`max_tokens_limit`): the requested limit, refused above the ceiling; the ceiling
    /// itself when the request gave none; `None` (up to the end of the context) without
    /// either.
    pub fn effective_max_tokens(&self, ceiling: Option<u64>) -> Result<Option<u64>, LimitExceeded> {
        match (self.generation.max_tokens, ceiling) {
            (Some(asked), Some(limit)) if asked.value > limit => Err(LimitExceeded {
                field: asked.field,
                value: asked.value,
                limit,
            }),
            (Some(asked), _) => Ok(Some(asked.value)),
            (None, ceiling) if self.route.generates() => Ok(ceiling),
            (None, _) => Ok(None),
        }
    }
}

/// The generation parameters of an Anthropic request, as the engine runs it.
pub fn messages_params(max_tokens: i64, stream: Option<bool>) -> GenerationParams {
    GenerationParams {
        max_tokens: Some(max_tokens),
        stream,
        ..GenerationParams::default()
    }
}

/// A token limit above the server's ceiling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{field} {value} exceeds the limit of {limit} (server.max_tokens_limit)")]
pub struct LimitExceeded {
    pub field: &'static str,
    pub value: u64,
    pub limit: u64,
}

/// KV positions a request reserves in the engine: its prompt and the tokens it may generate
/// (`None`: up to the end of the context), at most the context length. The engine reserves
/// this for every sequence it admits; the proxy, which does not tokenize, checks the
/// shortest prompt (1 token), the smallest reservation the engine could make.
pub fn kv_reservation_tokens(
    prompt_tokens: u64,
    max_tokens: Option<u64>,
    context_length: u64,
) -> u64 {
    match max_tokens {
        Some(m) => prompt_tokens.saturating_add(m).min(context_length),
        None => context_length,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn facts(route: Route, body: Value) -> Result<RequestFacts, FieldError> {
        RequestFacts::read(route, &body)
    }

    #[test]
    fn max_completion_tokens_wins_in_either_order() {
        for body in [
            r#"{"max_tokens": 1, "max_completion_tokens": 400}"#,
            r#"{"max_completion_tokens": 400, "max_tokens": 1}"#,
        ] {
            let f = RequestFacts::read(
                Route::ChatCompletions,
                &parse_object(body.as_bytes()).unwrap(),
            )
            .unwrap();
            assert_eq!(
                f.generation.max_tokens,
                Some(TokenLimit {
                    field: "max_completion_tokens",
                    value: 400
                }),
                "{body}"
            );
            assert_eq!(
                f.effective_max_tokens(Some(8)),
                Err(LimitExceeded {
                    field: "max_completion_tokens",
                    value: 400,
                    limit: 8
                })
            );
        }
        let f = facts(
            Route::ChatCompletions,
            json!({"max_completion_tokens": 1, "max_tokens": 400}),
        )
        .unwrap();
        assert_eq!(f.effective_max_tokens(Some(8)), Ok(Some(1)));
    }

    #[test]
    fn the_ceiling_is_the_default_of_generation_routes_only() {
        let chat = facts(Route::ChatCompletions, json!({"messages": []})).unwrap();
        assert_eq!(chat.effective_max_tokens(Some(8)), Ok(Some(8)));
        assert_eq!(chat.effective_max_tokens(None), Ok(None));
        let other = facts(Route::Other, json!({"model": "m", "max_tokens": 99})).unwrap();
        assert_eq!(other.effective_max_tokens(Some(8)), Ok(None));
        assert_eq!(other.model.as_deref(), Some("m"));
    }

    #[test]
    fn errors_name_the_field_and_the_value() {
        let cases = [
            (
                json!({"max_tokens": 0}),
                "max_tokens",
                "max_tokens must be at least 1, got 0",
            ),
            (
                json!({"max_tokens": 5, "max_completion_tokens": -2}),
                "max_completion_tokens",
                "max_completion_tokens must be at least 1, got -2",
            ),
            (json!({"n": 9}), "n", "n must be between 1 and 8, got n = 9"),
            (
                json!({"max_tokens": "10"}),
                "max_tokens",
                "invalid `max_tokens`: invalid type: string \"10\", expected i64",
            ),
            (
                json!({"model": 1}),
                "model",
                "invalid `model`: invalid type: integer `1`, expected a string",
            ),
            (
                json!({"max_tokens": 2, "mlxd": {"resume_token_ids": [1, 2]}}),
                "mlxd.resume_token_ids",
                "2 resumed tokens leave nothing to generate within max_tokens = 2",
            ),
        ];
        for (body, param, message) in cases {
            let e = facts(Route::ChatCompletions, body.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
            assert_eq!(e.message, message, "{body}");
        }
        let e = facts(Route::Messages, json!({"messages": []})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert_eq!(e.message, "`max_tokens` is required");
        let e = facts(Route::Messages, json!({"max_tokens": 0})).unwrap_err();
        assert_eq!(e.message, "max_tokens must be at least 1, got 0");
    }

    #[test]
    fn bodies_must_be_objects() {
        for (body, message) in [
            (
                &b""[..],
                "the request body is empty; expected a JSON object",
            ),
            (
                b"[1]",
                "the request body must be a JSON object, not an array",
            ),
        ] {
            assert_eq!(parse_object(body).unwrap_err(), FieldError::body(message));
        }
        let e = parse_object(b"{\"model\":\"a").unwrap_err();
        assert!(
            e.message.starts_with("the request body is not valid JSON"),
            "{e}"
        );
    }

    #[test]
    fn facts_of_a_stream() {
        let f = facts(
            Route::Completions,
            json!({"model": "m", "stream": true, "stream_options": {"include_usage": true},
                   "n": 2, "mlxd": {"resume_token_ids": [4]}}),
        )
        .unwrap();
        assert_eq!(
            f.generation,
            GenerationFacts {
                max_tokens: None,
                stream: true,
                include_usage: true,
                n: 2,
                resume_token_ids: vec![4],
            }
        );
        assert!(!f.resumable(), "n = 2");
        let f = facts(Route::Messages, json!({"max_tokens": 3, "stream": true})).unwrap();
        assert!(f.generation.stream && !f.resumable());
        assert_eq!(f.effective_max_tokens(Some(2)).unwrap_err().limit, 2);
    }

    #[test]
    fn kv_reservation() {
        assert_eq!(kv_reservation_tokens(1, Some(99), 2048), 100);
        assert_eq!(kv_reservation_tokens(1, Some(u64::MAX), 2048), 2048);
        assert_eq!(kv_reservation_tokens(10, None, 2048), 2048);
    }
}
