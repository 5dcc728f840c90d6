//! Property tests standing in for fuzz targets (`cargo fuzz` needs nightly Rust, which
//! CI does not have): request JSON types and the config parser take arbitrary input
//! without panicking. The SSE splitter and the control-frame decoder have theirs beside
//! the code (`ipc/src/sse.rs`, `ipc/src/frame.rs`). Case counts are small so the whole
//! file runs in seconds on 2 cores; raise `PROPTEST_CASES` for a longer run.

use mlxd_protocol::error::ErrorBody;
use mlxd_protocol::openai::{ChatCompletionRequest, CompletionRequest};
use proptest::prelude::*;
use serde_json::Value;

/// Arbitrary JSON values, biased towards the fields the request types know.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        "[a-z ]{0,12}".prop_map(Value::String),
        prop_oneof![
            Just("user"),
            Just("assistant"),
            Just("system"),
            Just("tool"),
            Just("text")
        ]
        .prop_map(|s| Value::String(s.into())),
    ];
    leaf.prop_recursive(4, 64, 8, |inner| {
        let key = prop_oneof![
            Just("model".to_string()),
            Just("messages".to_string()),
            Just("role".to_string()),
            Just("content".to_string()),
            Just("prompt".to_string()),
            Just("max_tokens".to_string()),
            Just("stop".to_string()),
            Just("stream".to_string()),
            Just("temperature".to_string()),
            Just("type".to_string()),
            Just("text".to_string()),
            "[a-z_]{1,10}",
        ];
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::btree_map(key, inner, 0..8)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(std::env::var("MLXD_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)))]

    #[test]
    fn request_types_take_arbitrary_json(v in json_value()) {
        let text = v.to_string();
        let _ = serde_json::from_str::<ChatCompletionRequest>(&text);
        let _ = serde_json::from_str::<CompletionRequest>(&text);
        let _ = serde_json::from_str::<ErrorBody>(&text);
    }

    #[test]
    fn request_types_take_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = serde_json::from_slice::<ChatCompletionRequest>(&bytes);
        let _ = serde_json::from_slice::<CompletionRequest>(&bytes);
    }

    /// Any text: a config or an error naming a line, never a panic.
    #[test]
    fn the_config_parser_takes_arbitrary_text(text in "(\\[\\[model\\]\\]\n|\\[server\\]\n|\\[pool\\]\n|[a-z_]{1,16} = (\"[0-9a-zA-Z .]{0,24}\"|[0-9]{1,24}|true|\\[\\])\n|.{0,40}\n){0,12}") {
        match mlxd_proxy::Config::from_toml_str(&text, "fuzz.toml") {
            Ok(_) => {}
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }

    /// Durations and sizes of any spelling: a value or an error, never a panic.
    #[test]
    fn durations_and_sizes_never_panic(s in "[0-9.]{0,30}(h|m|s|ms|min|GiB|MB|TiB|b|x|)") {
        let _ = mlxd_proxy::config::parse_duration(&s);
        let _ = mlxd_proxy::config::parse_bytes(&s);
        let toml = format!("[pool]\nttl = \"{s}\"\ncapacity_wait = \"{s}\"\nmemory_budget = \"{s}\"\n");
        let _ = mlxd_proxy::Config::from_toml_str(&toml, "fuzz.toml");
    }
}
