//! Hugging Face chat templates rendered with `minijinja`, matching what Python `transformers`
//! renders with `apply_chat_template(..., tokenize=False)`.
//!
//! `transformers` renders with Jinja2 (`trim_blocks`, `lstrip_blocks`, loop controls), adds
//! `raise_exception`, `strftime_now` and its own `tojson` (Python's `json.dumps`, which does not
//! escape HTML and puts a space after `,` and `:`), and passes the special tokens as variables.
//! Python's string and dict methods (`.strip()`, `.split()`, `.items()` …) come from
//! `minijinja-contrib`'s pycompat layer; `None`, `True` and `False` print as Python prints them.
use std::collections::BTreeMap;
use std::fmt::Write as _;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, ErrorKind, State, Value};
use mlxd_protocol::openai::ChatMessage;
use serde_json::{Map, Value as Json};

const DEFAULT: &str = "default";
const TOOL_USE: &str = "tool_use";

/// The template text(s) of a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TemplateSource {
    Single(String),
    /// Named templates; `default` is used, or `tool_use` when tools are given and it exists.
    Named(BTreeMap<String, String>),
}

#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error("the chat template {name:?} does not compile: {message}")]
    Syntax { name: String, message: String },
    #[error("the model's chat template has no template named \"default\" (it has: {0})")]
    NoDefault(String),
    /// The template called `raise_exception` (it refuses these messages).
    #[error("the chat template rejected the messages: {0}")]
    Raised(String),
    #[error("the chat template failed on these messages: {0}")]
    Render(String),
}

/// Compiled chat template(s) plus the special-token variables they see.
pub struct ChatTemplate {
    env: Environment<'static>,
    has_tool_use: bool,
    /// Every template's text, joined: what the model family's formats are detected from.
    source: String,
    special_tokens: BTreeMap<String, String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("has_tool_use", &self.has_tool_use)
            .field("special_tokens", &self.special_tokens)
            .finish()
    }
}

/// The error `raise_exception` returns, recognised after rendering.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

impl ChatTemplate {
    /// Compiles the template(s). `special_tokens` maps variable names (`bos_token`,
    /// `eos_token`, `unk_token`, `pad_token`) to token text.
    pub fn new(
        source: TemplateSource,
        special_tokens: BTreeMap<String, String>,
    ) -> Result<Self, ChatTemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);

        let templates = match source {
            TemplateSource::Single(text) => BTreeMap::from([(DEFAULT.to_owned(), text)]),
            TemplateSource::Named(named) => named,
        };
        if !templates.contains_key(DEFAULT) {
            let names: Vec<_> = templates.keys().cloned().collect();
            return Err(ChatTemplateError::NoDefault(names.join(", ")));
        }
        let has_tool_use = templates.contains_key(TOOL_USE);
        let source = templates.values().cloned().collect::<Vec<_>>().join("\n");
        for (name, text) in templates {
            let text = replace_generation_tags(&text);
            env.add_template_owned(name.clone(), text)
                .map_err(|e| ChatTemplateError::Syntax {
                    name,
                    message: describe(&e),
                })?;
        }
        Ok(Self {
            env,
            has_tool_use,
            source,
            special_tokens,
        })
    }

    /// The template text (all named templates, joined).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether the template renders `tools` at all (otherwise the server describes them in
    /// a system message).
    pub fn renders_tools(&self) -> bool {
        self.has_tool_use || self.source.contains("tools")
    }

    /// Renders OpenAI chat messages. Array contents are flattened to their text (parts joined
    /// with newlines), so every template sees string contents.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        let messages: Vec<Json> = messages.iter().map(message_json).collect();
        self.render_json(&messages, tools, add_generation_prompt, &Map::new())
    }

    /// Renders messages given as JSON objects, as `transformers` receives them. `extra` holds
    /// further template variables (`enable_thinking`, `date_string` …).
    pub fn render_json(
        &self,
        messages: &[Json],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
        extra: &Map<String, Json>,
    ) -> Result<String, ChatTemplateError> {
        let name = if tools.is_some() && self.has_tool_use {
            TOOL_USE
        } else {
            DEFAULT
        };
        let template = self
            .env
            .get_template(name)
            .map_err(|e| ChatTemplateError::Render(describe(&e)))?;

        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        for (key, token) in &self.special_tokens {
            ctx.insert(key.clone(), Value::from(token.as_str()));
        }
        for (key, value) in extra {
            ctx.insert(key.clone(), Value::from_serialize(value));
        }
        ctx.insert("messages".into(), Value::from_serialize(messages));
        ctx.insert(
            "tools".into(),
            tools.map_or(Value::from(()), Value::from_serialize),
        );
        ctx.insert("documents".into(), Value::from(()));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        template.render(ctx).map_err(|e| {
            match std::error::Error::source(&e).and_then(|s| s.downcast_ref::<Raised>()) {
                Some(raised) => ChatTemplateError::Raised(raised.0.clone()),
                None => ChatTemplateError::Render(describe(&e)),
            }
        })
    }
}

/// The JSON object `transformers` would see for an OpenAI message.
pub(crate) fn message_json(m: &ChatMessage) -> Json {
    let mut obj = Map::new();
    obj.insert("role".into(), Json::from(m.role.as_str()));
    obj.insert(
        "content".into(),
        m.content
            .as_ref()
            .map_or(Json::Null, |c| Json::from(c.to_text())),
    );
    if let Some(name) = &m.name {
        obj.insert("name".into(), Json::from(name.as_str()));
    }
    if let Some(calls) = &m.tool_calls {
        obj.insert("tool_calls".into(), Json::Array(calls.clone()));
    }
    if let Some(id) = &m.tool_call_id {
        obj.insert("tool_call_id".into(), Json::from(id.as_str()));
    }
    Json::Object(obj)
}

/// An error with its chain of causes and, where known, the template line.
fn describe(e: &minijinja::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        let _ = write!(text, ": {s}");
        source = s.source();
    }
    text
}

/// `transformers`' `{% generation %}` … `{% endgeneration %}` only marks assistant text for
/// training masks; for rendering it is a no-op. minijinja has no custom tags, so the pair
/// becomes `{% if true %}` … `{% endif %}`, keeping any whitespace-control markers.
fn replace_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let open_ctl = inner.starts_with(['-', '+']).then(|| &inner[..1]);
        let close_ctl = inner
            .ends_with(['-', '+'])
            .then(|| &inner[inner.len() - 1..]);
        let word = inner.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        let replacement = match word {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                let _ = write!(
                    out,
                    "{{%{} {r} {}%}}",
                    open_ctl.unwrap_or(""),
                    close_ctl.unwrap_or("")
                );
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// Prints values as Jinja2 on Python does: `None`, `True`, `False`.
fn python_formatter(
    out: &mut minijinja::Output,
    state: &State,
    value: &Value,
) -> Result<(), minijinja::Error> {
    match value.kind() {
        ValueKind::None => out.write_str("None").map_err(minijinja::Error::from),
        ValueKind::Bool => out
            .write_str(if value.is_true() { "True" } else { "False" })
            .map_err(minijinja::Error::from),
        _ => minijinja::escape_formatter(out, state, value),
    }
}

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(
        minijinja::Error::new(ErrorKind::InvalidOperation, message.clone())
            .with_source(Raised(message)),
    )
}

/// `strftime_now(format)`: the local time now, formatted as C's (and Python's) `strftime`.
fn strftime_now(format: String) -> Result<String, minijinja::Error> {
    let bad = |why: &str| minijinja::Error::new(ErrorKind::InvalidOperation, why.to_owned());
    let c_format =
        std::ffi::CString::new(format).map_err(|_| bad("strftime_now: format contains NUL"))?;
    // SAFETY: `time` and `localtime_r` fill the plain-data `tm` we own; `strftime` writes at
    // most `buf.len()` bytes into `buf` and returns how many it wrote (0 on overflow).
    unsafe {
        let now = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&now, &mut tm).is_null() {
            return Err(bad("strftime_now: cannot read the local time"));
        }
        let mut buf = vec![0u8; 256];
        let n = libc::strftime(buf.as_mut_ptr().cast(), buf.len(), c_format.as_ptr(), &tm);
        if n == 0 && !c_format.as_bytes().is_empty() {
            return Err(bad("strftime_now: the formatted time is empty or too long"));
        }
        buf.truncate(n);
        String::from_utf8(buf).map_err(|_| bad("strftime_now: the result is not UTF-8"))
    }
}

/// `tojson` as `transformers` defines it: Python's `json.dumps(value, ensure_ascii=False,
/// indent=indent, separators=separators, sort_keys=sort_keys)`.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;

    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.kind() {
            ValueKind::Number => {
                let n = i64::try_from(v.clone()).unwrap_or(0).max(0) as usize;
                Some(" ".repeat(n))
            }
            ValueKind::String => Some(v.as_str().unwrap_or_default().to_owned()),
            _ => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ))
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|p| p.as_str().map(str::to_owned))
                .collect::<Option<_>>()
                .ok_or_else(|| {
                    minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    )
                })?;
            match <[String; 2]>::try_from(parts) {
                Ok([a, b]) => (a, b),
                Err(_) => {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ))
                }
            }
        }
        // json.dumps: ", " without indent, "," with it.
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    style.write(&mut out, value, 0)?;
    Ok(Value::from(out))
}

struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl JsonStyle {
    fn newline(&self, out: &mut String, depth: usize) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(indent);
            }
        }
    }

    fn write(&self, out: &mut String, value: &Value, depth: usize) -> Result<(), minijinja::Error> {
        match value.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => out.push_str(&python_number(value)),
            ValueKind::String => self.string(out, value.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.container(out, '[', ']', items.len(), depth, |out, i| {
                    self.write(out, &items[i], depth + 1)
                })?;
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = value.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort();
                }
                self.container(out, '{', '}', keys.len(), depth, |out, i| {
                    let key = &keys[i];
                    match key.as_str() {
                        Some(s) => self.string(out, s),
                        None => self.string(out, &key.to_string()),
                    }
                    out.push_str(&self.key_sep);
                    self.write(out, &value.get_item(key)?, depth + 1)
                })?;
            }
            _ => self.string(out, &value.to_string()),
        }
        Ok(())
    }

    fn container(
        &self,
        out: &mut String,
        open: char,
        close: char,
        len: usize,
        depth: usize,
        mut item: impl FnMut(&mut String, usize) -> Result<(), minijinja::Error>,
    ) -> Result<(), minijinja::Error> {
        out.push(open);
        if len == 0 {
            out.push(close);
            return Ok(());
        }
        for i in 0..len {
            if i > 0 {
                out.push_str(&self.item_sep);
            }
            self.newline(out, depth + 1);
            item(out, i)?;
        }
        self.newline(out, depth);
        out.push(close);
        Ok(())
    }

    fn string(&self, out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => {
                    let _ = write!(out, "\\u{:04x}", c as u32);
                }
                c if self.ensure_ascii && !c.is_ascii() => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(out, "\\u{unit:04x}");
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// A number as Python's `json.dumps` writes it: integers plainly, floats with `repr` (always
/// with a `.` or an exponent).
fn python_number(value: &Value) -> String {
    if let Ok(i) = i64::try_from(value.clone()) {
        if !value.is_integer() {
            // A float with an integral value, e.g. 7.0.
            return format!("{i}.0");
        }
        return i.to_string();
    }
    if let Ok(f) = f64::try_from(value.clone()) {
        if f.is_nan() {
            return "NaN".into();
        }
        if f.is_infinite() {
            return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
        }
        let text = format!("{f:?}");
        return text;
    }
    value.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tests::{expected, load_fixture, FIXTURES};
    use serde_json::json;

    fn template(src: &str) -> ChatTemplate {
        let special = BTreeMap::from([
            ("bos_token".to_owned(), "<s>".to_owned()),
            ("eos_token".to_owned(), "</s>".to_owned()),
        ]);
        ChatTemplate::new(TemplateSource::Single(src.into()), special).unwrap()
    }

    fn render(src: &str, messages: Json) -> Result<String, ChatTemplateError> {
        template(src).render_json(messages.as_array().unwrap(), None, true, &Map::new())
    }

    #[test]
    fn fixtures_render_byte_for_byte_like_transformers() {
        let mut checked = 0;
        for name in FIXTURES {
            let tok = load_fixture(name);
            let tpl = tok.chat_template().unwrap();
            let want = expected(name);
            for case in want["conversations"].as_array().unwrap() {
                let tools: Option<Vec<Json>> =
                    serde_json::from_value(case["tools"].clone()).unwrap();
                let got = tpl.render_json(
                    case["messages"].as_array().unwrap(),
                    tools.as_deref(),
                    case["add_generation_prompt"].as_bool().unwrap(),
                    case["extra"].as_object().unwrap(),
                );
                let label = format!("{name}/{}", case["name"]);
                match (&got, case.get("rendered"), case.get("error")) {
                    (Ok(text), Some(want), _) => {
                        assert_eq!(text, want.as_str().unwrap(), "{label}");
                        if let Some(ids) = case.get("token_ids") {
                            let got_ids = tok.encode(text, false).unwrap();
                            let want_ids: Vec<u32> = serde_json::from_value(ids.clone()).unwrap();
                            assert_eq!(got_ids, want_ids, "{label} token ids");
                        }
                    }
                    (Err(ChatTemplateError::Raised(msg)), None, Some(want)) => {
                        assert_eq!(msg, want.as_str().unwrap(), "{label}");
                    }
                    _ => panic!("{label}: got {got:?}, want {case}"),
                }
                checked += 1;
            }
        }
        assert!(checked >= 27, "only {checked} cases");
    }

    #[test]
    fn python_methods_and_filters() {
        let out = render(
            "{{ messages[0].content.strip().upper() }}|{{ messages[0].content.split(',')|length }}|\
             {{ messages[0].content.startswith(' a') }}|{{ messages[0].content | trim }}",
            json!([{"role": "user", "content": " a,b,c "}]),
        )
        .unwrap();
        assert_eq!(out, "A,B,C|3|True|a,b,c");
        let out = render(
            "{% for k, v in messages[0].items() %}{{ k }}={{ v }};{% endfor %}{{ messages[0].get('x') }}",
            json!([{"role": "user", "content": "hi"}]),
        )
        .unwrap();
        assert_eq!(out, "role=user;content=hi;None");
    }

    #[test]
    fn loop_controls_and_trim_blocks() {
        let out = render(
            "{% for m in messages %}\n  {% if loop.index0 == 1 %}{% break %}{% endif %}\n{{ m.content }}\n{% endfor %}",
            json!([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]),
        )
        .unwrap();
        assert_eq!(out, "a\n");
    }

    #[test]
    fn raise_exception_is_a_clear_error() {
        let err = render(
            "{{ raise_exception('Only user and assistant roles are supported!') }}",
            json!([]),
        )
        .unwrap_err();
        assert!(
            matches!(&err, ChatTemplateError::Raised(m) if m == "Only user and assistant roles are supported!")
        );
        assert_eq!(
            err.to_string(),
            "the chat template rejected the messages: Only user and assistant roles are supported!"
        );
        let err = render("{{ messages[0].content.foo() }}", json!([{"content": "x"}])).unwrap_err();
        assert!(matches!(err, ChatTemplateError::Render(_)), "{err:?}");
    }

    #[test]
    fn syntax_errors_and_missing_default_are_reported() {
        let err = ChatTemplate::new(TemplateSource::Single("{% if %}".into()), BTreeMap::new())
            .unwrap_err();
        assert!(matches!(err, ChatTemplateError::Syntax { .. }), "{err:?}");
        let named = BTreeMap::from([("rag".to_owned(), "x".to_owned())]);
        let err = ChatTemplate::new(TemplateSource::Named(named), BTreeMap::new()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the model's chat template has no template named \"default\" (it has: rag)"
        );
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let tools = [json!({
            "name": "f", "n": 1, "x": 2.5, "y": 7.0, "ok": true, "none": null,
            "s": "é \"q\" <b>&</b>\n\u{1}", "list": [], "obj": {}
        })];
        let tpl = template(
            "{{ tools[0] | tojson }}|{{ tools[0].list | tojson(indent=2) }}|{{ {'b': [1, 2], 'a': 'x'} | tojson(indent=2, sort_keys=true) }}|{{ 'é' | tojson(ensure_ascii=true) }}",
        );
        let out = tpl
            .render_json(&[], Some(&tools), false, &Map::new())
            .unwrap();
        assert_eq!(
            out,
            "{\"name\": \"f\", \"n\": 1, \"x\": 2.5, \"y\": 7.0, \"ok\": true, \"none\": null, \
             \"s\": \"é \\\"q\\\" <b>&</b>\\n\\u0001\", \"list\": [], \"obj\": {}}|[]|\
             {\n  \"a\": \"x\",\n  \"b\": [\n    1,\n    2\n  ]\n}|\"\\u00e9\""
        );
    }

    #[test]
    fn generation_tags_are_transparent() {
        let src = "{% for m in messages %}{%- generation -%} {{ m.content }} {%- endgeneration %}{% endfor %}";
        assert_eq!(
            replace_generation_tags(src),
            "{% for m in messages %}{%- if true -%} {{ m.content }} {%- endif %}{% endfor %}"
        );
        assert_eq!(render(src, json!([{"content": "x"}])).unwrap(), "x");
    }

    #[test]
    fn strftime_now_and_special_tokens() {
        let out = render(
            "{{ bos_token }}{{ strftime_now('%Y') }}{{ eos_token }}",
            json!([]),
        )
        .unwrap();
        let year: i32 = out[3..7].parse().unwrap();
        assert!(year >= 2024, "{out}");
        assert!(out.starts_with("<s>") && out.ends_with("</s>"));
    }

    #[test]
    fn openai_messages_are_flattened_to_text() {
        use mlxd_protocol::openai::{ContentPart, MessageContent, Role};
        let tpl = template("{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}");
        let mut msg = ChatMessage::new(Role::User, "");
        msg.content = Some(MessageContent::Parts(vec![
            ContentPart::Text { text: "a".into() },
            ContentPart::Text { text: "b".into() },
        ]));
        let out = tpl
            .render(&[ChatMessage::new(Role::System, "s"), msg], None, true)
            .unwrap();
        assert_eq!(out, "[system:s][user:a\nb]");
    }
}
