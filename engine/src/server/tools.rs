//! Tool calling: the tools a request offers, the choice it makes, the grammar that forces a
//! call, and the parsers that turn a model's output into structured calls — for each model
//! family's format, whole or streamed.
//!
//! Formats, detected from the chat template's text:
//! - [`ToolFormat::Hermes`] (Qwen2.5, Qwen3): `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`;
//! - [`ToolFormat::QwenXml`] (Qwen3-Coder) and [`ToolFormat::Glm`] (GLM-4.5): markup inside
//!   `<tool_call>` … `</tool_call>`, read by [`super::markup_calls`];
//! - [`ToolFormat::Harmony`] (gpt-oss): messages `to=functions.NAME`, read with the reasoning
//!   by [`super::harmony`];
//! - [`ToolFormat::Mistral`]: `[TOOL_CALLS][{"name": …, "arguments": {…}}]`, or
//!   `[TOOL_CALLS]name[ARGS]{…}` (newer templates);
//! - [`ToolFormat::Llama3Json`] (Llama 3.x, and every template that names none of the
//!   others): the whole output is `{"name": …, "parameters": {…}}`.
use serde_json::{json, Map, Value};

use super::error::ApiError;
use super::harmony;
use super::markup_calls::{
    self, Markup, ARG_KEY_CLOSE, ARG_KEY_OPEN, ARG_VALUE_CLOSE, ARG_VALUE_OPEN,
};
use crate::constraint::grammar::{compact_json_options, Grammar};

/// One offered function.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub description: Option<String>,
    /// JSON schema of the arguments object.
    pub parameters: Value,
}

impl ToolSpec {
    /// The OpenAI form chat templates expect (`{"type": "function", "function": {…}}`).
    pub fn template_json(&self) -> Value {
        let mut function = Map::new();
        function.insert("name".into(), Value::from(self.name.clone()));
        if let Some(d) = &self.description {
            function.insert("description".into(), Value::from(d.clone()));
        }
        function.insert("parameters".into(), self.parameters.clone());
        json!({"type": "function", "function": function})
    }
}

/// What the request lets or makes the model do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Call tools or answer, as the model decides.
    Auto,
    /// Answer without calling (the tools are not shown to the model).
    None,
    /// Call at least one tool.
    Required,
    /// Call this tool.
    Named(String),
}

/// The model family's tool-call format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Llama3Json,
    Hermes,
    QwenXml,
    Glm,
    Mistral,
    Harmony,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const MISTRAL_CALLS: &str = "[TOOL_CALLS]";
const MISTRAL_ARGS: &str = "[ARGS]";
const PYTHON_TAG: &str = "<|python_tag|>";
/// Qwen3-Coder's templates write calls as `<function=NAME>`.
const QWEN_XML_FUNCTION: &str = "<function=";
/// Harmony's channel marker (gpt-oss).
const HARMONY_CHANNEL: &str = "<|channel|>";

impl ToolFormat {
    /// The format a chat template's text asks for.
    pub fn detect(template_source: &str) -> Self {
        let has = |marker: &str| template_source.contains(marker);
        if has(HARMONY_CHANNEL) {
            ToolFormat::Harmony
        } else if has(HERMES_OPEN) && has(ARG_KEY_OPEN) {
            ToolFormat::Glm
        } else if has(HERMES_OPEN) && has(QWEN_XML_FUNCTION) {
            ToolFormat::QwenXml
        } else if has(HERMES_OPEN) {
            ToolFormat::Hermes
        } else if template_source.contains(MISTRAL_CALLS) {
            ToolFormat::Mistral
        } else {
            ToolFormat::Llama3Json
        }
    }

    /// The key the format puts the arguments under (JSON formats).
    fn arguments_key(self) -> &'static str {
        match self {
            ToolFormat::Llama3Json => "parameters",
            _ => "arguments",
        }
    }

    /// The markers a call in this format is written with (which the text must keep).
    pub fn markers(self) -> &'static [&'static str] {
        match self {
            ToolFormat::Llama3Json => &[PYTHON_TAG],
            ToolFormat::Hermes | ToolFormat::QwenXml => &[HERMES_OPEN, HERMES_CLOSE],
            ToolFormat::Glm => &[
                HERMES_OPEN,
                HERMES_CLOSE,
                ARG_KEY_OPEN,
                ARG_KEY_CLOSE,
                ARG_VALUE_OPEN,
                ARG_VALUE_CLOSE,
            ],
            ToolFormat::Mistral => &[MISTRAL_CALLS, MISTRAL_ARGS],
            ToolFormat::Harmony => &harmony::MARKERS,
        }
    }

    /// Whether calls are `<tool_call>` … `</tool_call>` blocks.
    fn has_blocks(self) -> bool {
        matches!(
            self,
            ToolFormat::Hermes | ToolFormat::QwenXml | ToolFormat::Glm
        )
    }
}

/// Reads OpenAI `tools`; every error names the field.
pub fn openai_tools(tools: &[Value]) -> Result<Vec<ToolSpec>, ApiError> {
    let mut out: Vec<ToolSpec> = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        let at = |field: &str| format!("tools[{i}]{field}");
        let kind = tool.get("type").and_then(Value::as_str);
        if kind != Some("function") {
            return Err(ApiError::invalid(
                at(".type"),
                format!(
                    "only tools of type \"function\" are supported, got {}",
                    tool.get("type").unwrap_or(&Value::Null)
                ),
            ));
        }
        let Some(function) = tool.get("function").and_then(Value::as_object) else {
            return Err(ApiError::invalid(
                at(".function"),
                "`function` must be an object",
            ));
        };
        let spec = tool_spec(
            function.get("name"),
            function.get("description"),
            function.get("parameters"),
            &at(".function"),
            "parameters",
        )?;
        if out.iter().any(|t| t.name == spec.name) {
            return Err(ApiError::invalid(
                at(".function.name"),
                format!("tool name {:?} is given twice", spec.name),
            ));
        }
        out.push(spec);
    }
    Ok(out)
}

/// One tool from its parts (shared by the OpenAI and Anthropic forms). `at` is the field
/// path of the tool, `schema_key` the name of its schema field.
pub fn tool_spec(
    name: Option<&Value>,
    description: Option<&Value>,
    schema: Option<&Value>,
    at: &str,
    schema_key: &str,
) -> Result<ToolSpec, ApiError> {
    let name = match name.and_then(Value::as_str) {
        Some(n) if valid_name(n) => n.to_owned(),
        Some(n) => {
            return Err(ApiError::invalid(
                format!("{at}.name"),
                format!("tool names must be 1 to 64 letters, digits, '_' or '-', got {n:?}"),
            ))
        }
        None => {
            return Err(ApiError::invalid(
                format!("{at}.name"),
                "a tool needs a string `name`",
            ))
        }
    };
    let description = match description {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => {
            return Err(ApiError::invalid(
                format!("{at}.description"),
                "`description` must be a string",
            ))
        }
    };
    let parameters = match schema {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(v @ Value::Object(_)) => v.clone(),
        Some(other) => {
            return Err(ApiError::invalid(
                format!("{at}.{schema_key}"),
                format!("`{schema_key}` must be a JSON schema object, got {other}"),
            ))
        }
    };
    Ok(ToolSpec {
        name,
        description,
        parameters,
    })
}

pub(super) fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// Reads OpenAI `tool_choice` against the offered tools.
pub fn openai_tool_choice(
    choice: Option<&Value>,
    tools: &[ToolSpec],
) -> Result<ToolChoice, ApiError> {
    let choice = match choice {
        None | Some(Value::Null) => return Ok(default_choice(tools)),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("tool_choice must be \"auto\", \"none\", \"required\" or a named function, got {other:?}"),
                ))
            }
        },
        Some(Value::Object(obj)) => {
            let name = obj
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str);
            match (obj.get("type").and_then(Value::as_str), name) {
                (Some("function"), Some(name)) => ToolChoice::Named(name.to_owned()),
                _ => {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": …}}",
                    ))
                }
            }
        }
        Some(other) => {
            return Err(ApiError::invalid(
                "tool_choice",
                format!("tool_choice must be a string or an object, got {other}"),
            ))
        }
    };
    check_choice(choice, tools, "tool_choice")
}

/// `auto` with tools, `none` without, as OpenAI defaults.
pub fn default_choice(tools: &[ToolSpec]) -> ToolChoice {
    if tools.is_empty() {
        ToolChoice::None
    } else {
        ToolChoice::Auto
    }
}

/// Refuses a choice that names an unknown tool, or asks for a call with no tools.
pub fn check_choice(
    choice: ToolChoice,
    tools: &[ToolSpec],
    param: &str,
) -> Result<ToolChoice, ApiError> {
    match &choice {
        ToolChoice::Named(name) if !tools.iter().any(|t| &t.name == name) => {
            let known: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
            Err(ApiError::invalid(
                param,
                format!(
                    "{param} names the tool {name:?}, which is not among the tools ({known:?})"
                ),
            ))
        }
        ToolChoice::Required if tools.is_empty() => Err(ApiError::invalid(
            param,
            format!("{param} requires a tool call but the request offers no tools"),
        )),
        _ => Ok(choice),
    }
}

/// The grammar that makes the model call a tool in `format`: one of `tools` for
/// `Required`, the named one for `Named`; several calls where the format has a way to
/// write them and `parallel` allows it. `None` for `Auto` and `None`.
pub fn forced_grammar(
    format: ToolFormat,
    tools: &[ToolSpec],
    choice: &ToolChoice,
    parallel: bool,
    special_id: &dyn Fn(&str) -> Option<u32>,
) -> Option<Grammar> {
    let chosen: Vec<&ToolSpec> = match choice {
        ToolChoice::Auto | ToolChoice::None => return None,
        ToolChoice::Required => tools.iter().collect(),
        ToolChoice::Named(name) => tools.iter().filter(|t| &t.name == name).collect(),
    };
    let key = format.arguments_key();
    let call_schemas: Vec<Value> = chosen
        .iter()
        .map(|t| {
            json!({
                "type": "object",
                "properties": {"name": {"const": t.name}, key: t.parameters},
                "required": ["name", key],
                "additionalProperties": false,
            })
        })
        .collect();
    let one_call = |mut schema: Value| {
        if let Value::Object(map) = &mut schema {
            map.insert("x-guidance".into(), compact_json_options());
        }
        schema
    };
    let call = one_call(if call_schemas.len() == 1 {
        call_schemas[0].clone()
    } else {
        json!({"anyOf": call_schemas})
    });
    let grammar = match format {
        ToolFormat::Llama3Json => format!("start: call\ncall: %json {call}\n"),
        ToolFormat::QwenXml | ToolFormat::Glm => {
            let markup = if format == ToolFormat::Glm {
                Markup::Glm
            } else {
                Markup::QwenXml
            };
            let (rules, calls) = markup_calls::call_rules(markup, &chosen, special_id);
            let open = literal(HERMES_OPEN, special_id);
            let close = literal(HERMES_CLOSE, special_id);
            let repeat = if parallel { "(\"\\n\" one)*" } else { "" };
            format!(
                "start: one {repeat}\none: {open} ({}) {close}\n{rules}",
                calls.join(" | ")
            )
        }
        ToolFormat::Harmony => harmony::forced_grammar(&chosen, special_id),
        ToolFormat::Hermes => {
            let open = literal(HERMES_OPEN, special_id);
            let close = literal(HERMES_CLOSE, special_id);
            let repeat = if parallel { "(\"\\n\" one)*" } else { "" };
            format!("start: one {repeat}\none: {open} \"\\n\" call \"\\n\" {close}\ncall: %json {call}\n")
        }
        ToolFormat::Mistral => {
            let marker = literal(MISTRAL_CALLS, special_id);
            let mut array = json!({"type": "array", "items": call, "minItems": 1});
            if !parallel {
                array["maxItems"] = json!(1);
            }
            let array = one_call(array);
            format!("start: {marker} calls\ncalls: %json {array}\n")
        }
    };
    Some(Grammar::Lark(grammar))
}

/// A marker as a Lark terminal: the special token by id where the vocabulary has it as one
/// (llguidance matches special tokens only by id), else the string.
pub(super) fn literal(marker: &str, special_id: &dyn Fn(&str) -> Option<u32>) -> String {
    match special_id(marker) {
        Some(id) => format!("<[{id}]>"),
        None => serde_json::to_string(marker).unwrap_or_default(),
    }
}

/// A call as the model wrote it.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCall {
    pub name: String,
    /// The arguments object (`{}` when the model gave none).
    pub arguments: Value,
}

/// A call object (`{"name": …, "arguments"|"parameters": {…}}`), if `value` is one.
fn call_of(value: &Value) -> Option<ParsedCall> {
    let obj = value.as_object()?;
    let name = obj.get("name")?.as_str()?.to_owned();
    let arguments = match obj.get("arguments").or_else(|| obj.get("parameters")) {
        None | Some(Value::Null) => json!({}),
        // Some models write the arguments as a JSON string.
        Some(Value::String(s)) => serde_json::from_str(s).ok()?,
        Some(v @ Value::Object(_)) => v.clone(),
        Some(_) => return None,
    };
    Some(ParsedCall { name, arguments })
}

/// Calls in a JSON text: one call object or an array of them.
fn calls_in_json(text: &str) -> Option<Vec<ParsedCall>> {
    let value: Value = serde_json::from_str(text.trim()).ok()?;
    match &value {
        Value::Array(items) if !items.is_empty() => items.iter().map(call_of).collect(),
        Value::Object(_) => call_of(&value).map(|c| vec![c]),
        _ => None,
    }
}

/// Splits a complete output into its text and its calls. Text that looks like a call but
/// does not parse as one stays text.
pub fn parse_output(format: ToolFormat, text: &str) -> (String, Vec<ParsedCall>) {
    let mut parser = ToolStream::new(format);
    let mut content = String::new();
    let mut calls = Vec::new();
    for piece in parser.push(text).into_iter().chain(parser.finish()) {
        match piece {
            ToolPiece::Text(t) => content.push_str(&t),
            ToolPiece::Call(c) => calls.push(c),
        }
    }
    (content, calls)
}

/// What the streaming parser lets out.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolPiece {
    Text(String),
    Call(ParsedCall),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StreamState {
    /// Nothing but whitespace seen yet (Llama's calls are the whole output).
    Start,
    /// Plain text, watching for the format's call marker.
    Text,
    /// Inside a call, buffering until it closes (or the output ends).
    Call,
    /// Plain text for good (Llama: the output did not start as a call).
    PlainOnly,
}

/// Streams text through, holding back what may be (the start of) a tool call, and lets
/// each call out whole once it is complete.
#[derive(Debug)]
pub struct ToolStream {
    format: ToolFormat,
    state: StreamState,
    buf: String,
    /// The offered tools, whose schemas type the arguments of markup calls.
    tools: Vec<ToolSpec>,
}

impl ToolStream {
    pub fn new(format: ToolFormat) -> Self {
        Self::with_tools(format, Vec::new())
    }

    /// A parser that reads markup arguments as the offered `tools`' schemas type them.
    pub fn with_tools(format: ToolFormat, tools: Vec<ToolSpec>) -> Self {
        // Harmony's calls are read with its channels (super::harmony), never here.
        let state = if format == ToolFormat::Harmony {
            StreamState::PlainOnly
        } else {
            StreamState::Start
        };
        Self {
            format,
            state,
            buf: String::new(),
            tools,
        }
    }

    /// The calls in the text between `<tool_call>` and `</tool_call>`.
    fn block_calls(&self, inner: &str) -> Option<Vec<ParsedCall>> {
        match self.format {
            ToolFormat::QwenXml => markup_calls::qwen_xml_call(inner, &self.tools).map(|c| vec![c]),
            ToolFormat::Glm => markup_calls::glm_call(inner, &self.tools).map(|c| vec![c]),
            _ => calls_in_json(inner),
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<ToolPiece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.state {
                StreamState::PlainOnly => {
                    if !self.buf.is_empty() {
                        out.push(ToolPiece::Text(std::mem::take(&mut self.buf)));
                    }
                    return out;
                }
                StreamState::Start => {
                    let trimmed = self.buf.trim_start();
                    if trimmed.is_empty() {
                        return out;
                    }
                    match self.format {
                        ToolFormat::Llama3Json => {
                            if trimmed.starts_with('{')
                                || trimmed.starts_with('[')
                                || trimmed.starts_with(PYTHON_TAG)
                            {
                                self.state = StreamState::Call;
                            } else if PYTHON_TAG.starts_with(trimmed) {
                                return out;
                            } else {
                                self.state = StreamState::PlainOnly;
                            }
                        }
                        _ => self.state = StreamState::Text,
                    }
                }
                StreamState::Text => {
                    let marker = self.open_marker();
                    match self.buf.find(marker) {
                        Some(pos) => {
                            let text: String = self.buf.drain(..pos).collect();
                            if !text.is_empty() {
                                out.push(ToolPiece::Text(text));
                            }
                            self.state = StreamState::Call;
                        }
                        None => {
                            let keep = partial_suffix(&self.buf, marker);
                            let cut = self.buf.len() - keep;
                            if cut > 0 {
                                out.push(ToolPiece::Text(self.buf.drain(..cut).collect()));
                            }
                            return out;
                        }
                    }
                }
                StreamState::Call => {
                    // Other formats: the rest of the output is the call(s); wait for the end.
                    if !self.format.has_blocks() {
                        return out;
                    }
                    let Some(end) = self.buf.find(HERMES_CLOSE) else {
                        return out;
                    };
                    let block: String = self.buf.drain(..end + HERMES_CLOSE.len()).collect();
                    let inner = &block[HERMES_OPEN.len()..end];
                    match self.block_calls(inner) {
                        Some(calls) => out.extend(calls.into_iter().map(ToolPiece::Call)),
                        None => out.push(ToolPiece::Text(block)),
                    }
                    self.state = StreamState::Text;
                }
            }
        }
    }

    /// The end of the output: whatever is held back, as calls where it parses as them.
    pub fn finish(&mut self) -> Vec<ToolPiece> {
        let rest = std::mem::take(&mut self.buf);
        let state = std::mem::replace(&mut self.state, StreamState::PlainOnly);
        if rest.is_empty() {
            return Vec::new();
        }
        let calls = match (state, self.format) {
            (StreamState::Call, ToolFormat::Llama3Json) => {
                let body = rest.trim_start();
                calls_in_json(body.strip_prefix(PYTHON_TAG).unwrap_or(body))
            }
            (StreamState::Call, ToolFormat::Mistral) => mistral_calls(&rest[MISTRAL_CALLS.len()..]),
            // An unclosed `<tool_call>` (cut by max_tokens or a stop) is kept as text.
            _ => None,
        };
        match calls {
            Some(calls) => calls.into_iter().map(ToolPiece::Call).collect(),
            None => vec![ToolPiece::Text(rest)],
        }
    }

    fn open_marker(&self) -> &'static str {
        match self.format {
            ToolFormat::Hermes | ToolFormat::QwenXml | ToolFormat::Glm => HERMES_OPEN,
            ToolFormat::Mistral => MISTRAL_CALLS,
            // Never reached for harmony (its stream is plain text here).
            ToolFormat::Llama3Json | ToolFormat::Harmony => PYTHON_TAG,
        }
    }
}

/// Mistral's calls after `[TOOL_CALLS]`: a JSON array, or `name[ARGS]{…}` repeated (each
/// newer call again after `[TOOL_CALLS]`).
fn mistral_calls(text: &str) -> Option<Vec<ParsedCall>> {
    if let Some(calls) = calls_in_json(text) {
        return Some(calls);
    }
    let mut calls = Vec::new();
    for part in text.split(MISTRAL_CALLS) {
        let (name, args) = part.split_once(MISTRAL_ARGS)?;
        let arguments: Value = serde_json::from_str(args.trim()).ok()?;
        if !arguments.is_object() || !valid_name(name.trim()) {
            return None;
        }
        calls.push(ParsedCall {
            name: name.trim().to_owned(),
            arguments,
        });
    }
    (!calls.is_empty()).then_some(calls)
}

/// Length of the longest suffix of `text` that is a proper prefix of `marker` (what must be
/// held back because the marker may be arriving).
pub fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

/// For templates that do not render `tools`: the system text that describes them, asking
/// for calls in the Llama 3.x JSON form (which the forced grammar and the parser use for
/// such templates).
pub fn tools_system_text(tools: &[ToolSpec]) -> String {
    let mut text = String::from(
        "You have access to the following functions. To call a function, respond with only a \
         JSON object of the form {\"name\": function name, \"parameters\": dictionary of \
         argument name and its value}.\n",
    );
    for tool in tools {
        text.push('\n');
        text.push_str(&tool.template_json().to_string());
    }
    text
}

/// An earlier call as text, for templates that do not render `tool_calls`.
pub fn call_as_text(name: &str, arguments: &Value) -> String {
    json!({"name": name, "parameters": arguments}).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, arguments: Value) -> ToolPiece {
        ToolPiece::Call(ParsedCall {
            name: name.into(),
            arguments,
        })
    }

    /// Feeds `text` in pieces of every size from 1 to its length and checks the pieces
    /// always add up to `want` (streaming gives the same result as a whole output).
    fn stream_equals(format: ToolFormat, text: &str, want: &[ToolPiece]) {
        stream_equals_with(format, &[], text, want)
    }

    /// [`stream_equals`] for a request that offers `tools`.
    fn stream_equals_with(format: ToolFormat, tools: &[ToolSpec], text: &str, want: &[ToolPiece]) {
        let chars: Vec<char> = text.chars().collect();
        for size in 1..=chars.len().max(1) {
            let mut p = ToolStream::with_tools(format, tools.to_vec());
            let mut got = Vec::new();
            for chunk in chars.chunks(size) {
                got.extend(p.push(&chunk.iter().collect::<String>()));
            }
            got.extend(p.finish());
            // Adjacent text pieces are one text.
            let mut merged: Vec<ToolPiece> = Vec::new();
            for piece in got {
                match (merged.last_mut(), piece) {
                    (Some(ToolPiece::Text(a)), ToolPiece::Text(b)) => a.push_str(&b),
                    (_, piece) => merged.push(piece),
                }
            }
            assert_eq!(merged, want, "{format:?}, chunks of {size}: {text:?}");
        }
    }

    #[test]
    fn llama_json_calls_whole_and_streamed() {
        let f = ToolFormat::Llama3Json;
        stream_equals(
            f,
            r#" {"name": "get_weather", "parameters": {"city": "Oslo"}}"#,
            &[call("get_weather", json!({"city": "Oslo"}))],
        );
        stream_equals(
            f,
            r#"<|python_tag|>{"name": "a", "arguments": "{\"x\": 1}"}"#,
            &[call("a", json!({"x": 1}))],
        );
        stream_equals(
            f,
            "It is sunny {not json}",
            &[ToolPiece::Text("It is sunny {not json}".into())],
        );
        stream_equals(f, "{oops", &[ToolPiece::Text("{oops".into())]);
        stream_equals(
            f,
            r#"[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {"y": [1]}}]"#,
            &[call("a", json!({})), call("b", json!({"y": [1]}))],
        );
    }

    #[test]
    fn hermes_calls_between_text() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"w\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"t\", \"arguments\": {}}\n</tool_call>";
        stream_equals(
            ToolFormat::Hermes,
            text,
            &[
                ToolPiece::Text("Let me check.\n".into()),
                call("w", json!({"city": "Oslo"})),
                ToolPiece::Text("\n".into()),
                call("t", json!({})),
            ],
        );
        // A cut-off call stays text; a `<` that starts no marker is let through.
        stream_equals(
            ToolFormat::Hermes,
            "a < b <tool_call>\n{\"name\"",
            &[ToolPiece::Text("a < b <tool_call>\n{\"name\"".into())],
        );
    }

    #[test]
    fn mistral_calls_both_forms() {
        stream_equals(
            ToolFormat::Mistral,
            "[TOOL_CALLS][{\"name\": \"w\", \"arguments\": {\"c\": 1}}]",
            &[call("w", json!({"c": 1}))],
        );
        stream_equals(
            ToolFormat::Mistral,
            "Sure[TOOL_CALLS]w[ARGS]{\"c\": 1}[TOOL_CALLS]t[ARGS]{}",
            &[
                ToolPiece::Text("Sure".into()),
                call("w", json!({"c": 1})),
                call("t", json!({})),
            ],
        );
    }

    #[test]
    fn markup_calls_between_text() {
        let tools = [ToolSpec {
            name: "w".into(),
            description: None,
            parameters: json!({"type": "object", "properties": {"days": {"type": "integer"}}}),
        }];
        stream_equals_with(
            ToolFormat::QwenXml,
            &tools,
            "Sure.\n<tool_call>\n<function=w>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
            &[ToolPiece::Text("Sure.\n".into()), call("w", json!({"days": 3}))],
        );
        stream_equals_with(
            ToolFormat::Glm,
            &tools,
            "<tool_call>w\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>w\n</tool_call>",
            &[
                call("w", json!({"days": 3})),
                ToolPiece::Text("\n".into()),
                call("w", json!({})),
            ],
        );
        // A block that is not the format's markup stays text, markup and all.
        let bad = "<tool_call>\n{\"name\": \"w\"}\n</tool_call>";
        stream_equals_with(
            ToolFormat::QwenXml,
            &tools,
            bad,
            &[ToolPiece::Text(bad.into())],
        );
        // Harmony's calls are never read here.
        stream_equals(
            ToolFormat::Harmony,
            "<|channel|>x<tool_call>",
            &[ToolPiece::Text("<|channel|>x<tool_call>".into())],
        );
    }

    #[test]
    fn formats_are_detected_from_the_template() {
        assert_eq!(
            ToolFormat::detect("{{ '<tool_call>' }}"),
            ToolFormat::Hermes
        );
        assert_eq!(
            ToolFormat::detect("[TOOL_CALLS] {{ x }}"),
            ToolFormat::Mistral
        );
        assert_eq!(
            ToolFormat::detect("<|start_header_id|>"),
            ToolFormat::Llama3Json
        );
        assert_eq!(
            ToolFormat::detect("<tool_call>\n<function={{ name }}>"),
            ToolFormat::QwenXml
        );
        assert_eq!(
            ToolFormat::detect("<tool_call>{{ name }}<arg_key>"),
            ToolFormat::Glm
        );
        assert_eq!(
            ToolFormat::detect("<|start|>assistant<|channel|>final"),
            ToolFormat::Harmony
        );
    }

    #[test]
    fn tools_and_choices_are_checked() {
        let tools = openai_tools(&[json!({"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}})]).unwrap();
        assert_eq!(tools[0].name, "w");
        let bad = [
            (json!({"type": "retrieval"}), "tools[0].type"),
            (
                json!({"type": "function", "function": {"name": "a b"}}),
                "tools[0].function.name",
            ),
            (
                json!({"type": "function", "function": {"name": "a", "parameters": 3}}),
                "tools[0].function.parameters",
            ),
        ];
        for (tool, param) in bad {
            let e = openai_tools(&[tool]).unwrap_err();
            assert_eq!(e.body().error.param.as_deref(), Some(param));
        }
        let e = openai_tool_choice(
            Some(&json!({"type": "function", "function": {"name": "nope"}})),
            &tools,
        )
        .unwrap_err();
        assert_eq!(e.body().error.param.as_deref(), Some("tool_choice"));
        assert!(
            e.body().error.message.contains("\"nope\""),
            "{}",
            e.body().error.message
        );
        assert!(openai_tool_choice(Some(&json!("required")), &[]).is_err());
        assert_eq!(openai_tool_choice(None, &tools).unwrap(), ToolChoice::Auto);
        assert_eq!(
            openai_tool_choice(Some(&json!("none")), &tools).unwrap(),
            ToolChoice::None
        );
    }

    #[test]
    fn partial_suffixes() {
        assert_eq!(partial_suffix("abc <tool", HERMES_OPEN), 5);
        assert_eq!(partial_suffix("abc", HERMES_OPEN), 0);
        assert_eq!(partial_suffix("x<", HERMES_OPEN), 1);
        assert_eq!(partial_suffix("é", HERMES_OPEN), 0);
    }
}
