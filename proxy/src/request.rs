//! A JSON request body read once, by the request contract the engine applies too
//! (`mlxd_protocol::request`): its facts (model, token limit, stream, `n`, resumability),
//! the server's token ceiling (`max_tokens_limit`) applied to the effective limit and as the
//! default of a request that gave none, and the bytes the engine gets. Pure: no I/O.

use bytes::Bytes;
use mlxd_protocol::request::{parse_object, RequestFacts, Route};
use serde_json::{Map, Value};

use crate::error::ProxyError;

/// A request body as the proxy routes, admits and forwards it.
#[derive(Debug, Clone)]
pub struct ClientRequest {
    pub facts: RequestFacts,
    /// The most tokens the engine may generate, for the KV pre-check (`None`: to the end of
    /// the context).
    pub max_tokens: Option<u64>,
    /// The request object the engine gets (the base of a resumed request's continuation).
    pub object: Map<String, Value>,
    /// What the engine gets: the client's bytes, or, for a generation request without a
    /// token field under a ceiling, the request with `"max_tokens": ceiling` added.
    pub body: Bytes,
}

impl ClientRequest {
    /// Reads the body of a request to `path`; errors are the engine's 400s for the same body
    /// (field and wording), or `max_tokens_exceeded` above `ceiling`.
    pub fn read(path: &str, body: Bytes, ceiling: Option<u64>) -> Result<Self, ProxyError> {
        let route = Route::for_path(path);
        let value = parse_object(&body).map_err(ProxyError::InvalidRequest)?;
        let facts = RequestFacts::read(route, &value).map_err(ProxyError::InvalidRequest)?;
        let max_tokens = facts
            .effective_max_tokens(ceiling)
            .map_err(ProxyError::MaxTokensExceeded)?;
        let Value::Object(mut object) = value else {
            unreachable!("parse_object returns objects only");
        };
        let body = match max_tokens {
            // The default: the engine would otherwise generate to the end of the context.
            Some(limit) if facts.generation.max_tokens.is_none() => {
                with_max_tokens(&body, &mut object, limit)
            }
            _ => body,
        };
        Ok(Self {
            facts,
            max_tokens,
            object,
            body,
        })
    }
}

/// `body` (a JSON object without a token limit) with `"max_tokens": limit`, also set in
/// `object`. Where neither token field appears at all, the field is written in after the
/// opening brace, so the client's bytes are otherwise kept; a `null` token field is replaced
/// by serializing the object again.
fn with_max_tokens(body: &Bytes, object: &mut Map<String, Value>, limit: u64) -> Bytes {
    let present = object.contains_key("max_tokens") || object.contains_key("max_completion_tokens");
    object.remove("max_completion_tokens");
    object.insert("max_tokens".into(), Value::from(limit));
    let brace = body.iter().position(|b| !b.is_ascii_whitespace());
    match brace {
        Some(at) if !present && body[at] == b'{' => {
            let rest = &body[at + 1..];
            let empty = rest
                .iter()
                .find(|b| !b.is_ascii_whitespace())
                .is_some_and(|b| *b == b'}');
            let field = format!("\"max_tokens\":{limit}{}", if empty { "" } else { "," });
            let mut out = Vec::with_capacity(body.len() + field.len());
            out.extend_from_slice(&body[..=at]);
            out.extend_from_slice(field.as_bytes());
            out.extend_from_slice(rest);
            Bytes::from(out)
        }
        _ => Bytes::from(Value::Object(object.clone()).to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(path: &str, body: &str, ceiling: Option<u64>) -> Result<ClientRequest, ProxyError> {
        ClientRequest::read(path, Bytes::from(body.to_owned()), ceiling)
    }

    fn sent(r: &ClientRequest) -> Value {
        serde_json::from_slice(&r.body).unwrap()
    }

    #[test]
    fn both_token_fields_in_either_order_use_max_completion_tokens() {
        for body in [
            r#"{"max_tokens": 1, "max_completion_tokens": 400, "messages": []}"#,
            r#"{"max_completion_tokens": 400, "max_tokens": 1, "messages": []}"#,
        ] {
            let e = read("/v1/chat/completions", body, Some(8)).unwrap_err();
            assert_eq!(
                e.to_string(),
                "max_completion_tokens 400 exceeds the limit of 8 (server.max_tokens_limit)"
            );
            assert_eq!(e.param(), Some("max_completion_tokens"));
        }
        for body in [
            r#"{"max_tokens": 400, "max_completion_tokens": 1, "messages": []}"#,
            r#"{"max_completion_tokens": 1, "max_tokens": 400, "messages": []}"#,
        ] {
            let r = read("/v1/chat/completions", body, Some(8)).unwrap();
            assert_eq!(r.max_tokens, Some(1));
            assert_eq!(&r.body[..], body.as_bytes(), "forwarded as sent");
        }
    }

    #[test]
    fn the_ceiling_is_the_default_limit() {
        let body = r#" { "model": "m", "messages": [] }"#;
        let r = read("/v1/chat/completions", body, Some(8)).unwrap();
        assert_eq!(r.max_tokens, Some(8));
        assert_eq!(
            std::str::from_utf8(&r.body).unwrap(),
            r#" {"max_tokens":8, "model": "m", "messages": [] }"#
        );
        assert_eq!(r.object["max_tokens"], 8);
        let r = read("/v1/completions", "{}", Some(8)).unwrap();
        assert_eq!(&r.body[..], br#"{"max_tokens":8}"#);
        // A null field is no limit: replaced.
        let r = read(
            "/v1/completions",
            r#"{"prompt": "p", "max_completion_tokens": null}"#,
            Some(8),
        )
        .unwrap();
        assert_eq!(sent(&r), json!({"prompt": "p", "max_tokens": 8}));
        // No ceiling: the engine picks (the rest of the context).
        let r = read("/v1/completions", "{}", None).unwrap();
        assert_eq!((r.max_tokens, &r.body[..]), (None, &b"{}"[..]));
        // Routes that do not generate are left alone.
        let r = read("/v1/messages/count_tokens", r#"{"model": "m"}"#, Some(8)).unwrap();
        assert_eq!(
            (r.max_tokens, &r.body[..]),
            (None, &br#"{"model": "m"}"#[..])
        );
    }

    #[test]
    fn anthropic_requests_need_their_max_tokens() {
        let e = read("/v1/messages", r#"{"messages": []}"#, Some(8)).unwrap_err();
        assert_eq!(e.to_string(), "`max_tokens` is required");
        assert_eq!(e.status(), http::StatusCode::BAD_REQUEST);
        let e = read(
            "/v1/messages",
            r#"{"messages": [], "max_tokens": 9}"#,
            Some(8),
        )
        .unwrap_err();
        assert!(matches!(e, ProxyError::MaxTokensExceeded(_)), "{e}");
        let r = read(
            "/v1/messages",
            r#"{"messages": [], "max_tokens": 8}"#,
            Some(8),
        )
        .unwrap();
        assert_eq!(r.max_tokens, Some(8));
        assert!(!r.facts.resumable());
    }

    #[test]
    fn bad_bodies_are_refused_as_the_engine_refuses_them() {
        for (body, param, needle) in [
            ("[1]", None, "must be a JSON object, not an array"),
            ("{\"model\":\"a", None, "not valid JSON"),
            (
                r#"{"model": 1}"#,
                Some("model"),
                "invalid type: integer `1`",
            ),
            (
                r#"{"max_tokens": -1}"#,
                Some("max_tokens"),
                "at least 1, got -1",
            ),
            (r#"{"max_tokens": 1.5}"#, Some("max_tokens"), "invalid type"),
            (
                r#"{"max_tokens": "10"}"#,
                Some("max_tokens"),
                "invalid type",
            ),
            (r#"{"n": 0}"#, Some("n"), "between 1 and 8"),
        ] {
            let e = read("/v1/completions", body, Some(8)).unwrap_err();
            let v: Value = serde_json::from_str(&e.body_json()).unwrap();
            assert_eq!(v["error"]["param"].as_str(), param, "{body}");
            assert!(e.to_string().contains(needle), "{body}: {e}");
        }
    }
}
