//! Tool calls written as markup rather than JSON, inside `<tool_call>` … `</tool_call>`:
//!
//! - Qwen3-Coder: `<function=NAME>` then `<parameter=ARG>\nvalue\n</parameter>` per argument,
//!   then `</function>`;
//! - GLM-4.5: `NAME` then `<arg_key>ARG</arg_key><arg_value>value</arg_value>` per argument.
//!
//! Argument values are text, as the templates write them (strings raw, everything else as
//! JSON). The tool's JSON schema says which to read back as numbers, booleans, objects …
//! And the grammars that force such calls, one rule set per offered tool.
use serde_json::{Map, Value};

use super::tools::{literal, valid_name, ParsedCall, ToolSpec};
use crate::constraint::grammar::with_layout;

const FUNCTION_OPEN: &str = "<function=";
const FUNCTION_CLOSE: &str = "</function>";
const PARAMETER_OPEN: &str = "<parameter=";
const PARAMETER_CLOSE: &str = "</parameter>";
pub const ARG_KEY_OPEN: &str = "<arg_key>";
pub const ARG_KEY_CLOSE: &str = "</arg_key>";
pub const ARG_VALUE_OPEN: &str = "<arg_value>";
pub const ARG_VALUE_CLOSE: &str = "</arg_value>";

/// The schema the request declared for `tool`'s argument `arg`.
fn arg_schema<'a>(tools: &'a [ToolSpec], tool: &str, arg: &str) -> Option<&'a Value> {
    tools
        .iter()
        .find(|t| t.name == tool)?
        .parameters
        .get("properties")?
        .get(arg)
}

/// The JSON types a schema names (`type` as a string or a list); empty when it names none.
fn schema_types(schema: &Value) -> Vec<&str> {
    match schema.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    }
}

/// Whether an argument of this schema is written as raw text (a string).
fn is_text(schema: Option<&Value>) -> bool {
    match schema {
        // Undeclared arguments are kept as the model wrote them.
        None => true,
        Some(s) => {
            let types = schema_types(s);
            !types.is_empty() && types.iter().all(|t| *t == "string" || *t == "null")
        }
    }
}

/// `raw` read as one of `types`, if it is one.
fn as_type(raw: &str, ty: &str) -> Option<Value> {
    let text = raw.trim();
    match ty {
        "boolean" => match text.to_ascii_lowercase().as_str() {
            "true" => Some(Value::Bool(true)),
            "false" => Some(Value::Bool(false)),
            _ => None,
        },
        // Python's spelling too: templates that print values with `|string` write `None`.
        "null" => matches!(text, "null" | "None").then_some(Value::Null),
        "integer" | "number" | "object" | "array" => {
            let value: Value = serde_json::from_str(text).ok()?;
            let fits = match ty {
                "integer" => value.is_i64() || value.is_u64(),
                "number" => value.is_number(),
                "object" => value.is_object(),
                _ => value.is_array(),
            };
            fits.then_some(value)
        }
        _ => None,
    }
}

/// A value written as text, typed by its schema: text for strings and undeclared arguments;
/// the schema's type where the text reads as one; any JSON for schemas that name no type;
/// and the text itself when nothing fits (the client sees what the model wrote).
pub fn typed_value(raw: &str, schema: Option<&Value>) -> Value {
    let text = || Value::from(raw);
    let Some(schema) = schema else {
        return text();
    };
    let types = schema_types(schema);
    if types.is_empty() {
        return serde_json::from_str(raw.trim()).unwrap_or_else(|_| text());
    }
    if is_text(Some(schema)) {
        let null_allowed = types.contains(&"null");
        return match as_type(raw, "null") {
            Some(null) if null_allowed => null,
            _ => text(),
        };
    }
    types
        .iter()
        .filter(|t| **t != "string")
        .find_map(|t| as_type(raw, t))
        .unwrap_or_else(text)
}

/// `text` after `prefix`, skipping whitespace before it.
fn after<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
    text.trim_start().strip_prefix(prefix)
}

/// Qwen3-Coder's call, from the text between `<tool_call>` and `</tool_call>`.
pub fn qwen_xml_call(inner: &str, tools: &[ToolSpec]) -> Option<ParsedCall> {
    let rest = after(inner, FUNCTION_OPEN)?;
    let (name, rest) = rest.split_once('>')?;
    let name = name.trim();
    if !valid_name(name) {
        return None;
    }
    let end = rest.rfind(FUNCTION_CLOSE)?;
    if !rest[end + FUNCTION_CLOSE.len()..].trim().is_empty() {
        return None;
    }
    let mut body = &rest[..end];
    let mut arguments = Map::new();
    while !body.trim().is_empty() {
        let rest = after(body, PARAMETER_OPEN)?;
        let (key, rest) = rest.split_once('>')?;
        // A value ends at its closing tag, or (leniently) where the next parameter or the
        // end of the function begins.
        let stop = [PARAMETER_CLOSE, PARAMETER_OPEN, FUNCTION_CLOSE]
            .iter()
            .filter_map(|m| rest.find(m))
            .min()
            .unwrap_or(rest.len());
        let raw = &rest[..stop];
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let key = key.trim();
        arguments.insert(
            key.to_owned(),
            typed_value(raw, arg_schema(tools, name, key)),
        );
        body = rest[stop..]
            .strip_prefix(PARAMETER_CLOSE)
            .unwrap_or(&rest[stop..]);
    }
    Some(ParsedCall {
        name: name.to_owned(),
        arguments: Value::Object(arguments),
    })
}

/// GLM-4.5's call, from the text between `<tool_call>` and `</tool_call>`.
pub fn glm_call(inner: &str, tools: &[ToolSpec]) -> Option<ParsedCall> {
    let first = inner.find(ARG_KEY_OPEN).unwrap_or(inner.len());
    let name = inner[..first].trim();
    if !valid_name(name) {
        return None;
    }
    let mut body = &inner[first..];
    let mut arguments = Map::new();
    while !body.trim().is_empty() {
        let rest = after(body, ARG_KEY_OPEN)?;
        let (key, rest) = rest.split_once(ARG_KEY_CLOSE)?;
        let rest = after(rest, ARG_VALUE_OPEN)?;
        let (raw, rest) = rest.split_once(ARG_VALUE_CLOSE)?;
        let key = key.trim();
        arguments.insert(
            key.to_owned(),
            typed_value(raw, arg_schema(tools, name, key)),
        );
        body = rest;
    }
    Some(ParsedCall {
        name: name.to_owned(),
        arguments: Value::Object(arguments),
    })
}

/// Which markup a grammar writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Markup {
    QwenXml,
    Glm,
}

/// Lark rules for one call of each of `tools`, as the template writes calls, with the
/// arguments in schema order (required ones always, the others optionally) and each value
/// held to its schema. Returns the rules and the names of the per-tool call rules; each call
/// rule covers the text between `<tool_call>` and `</tool_call>`.
pub fn call_rules(
    markup: Markup,
    tools: &[&ToolSpec],
    special_id: &dyn Fn(&str) -> Option<u32>,
) -> (String, Vec<String>) {
    let mut rules = String::new();
    let mut names = Vec::new();
    // Raw text up to the value's closing tag: lazy, so it ends at the first closing tag. A
    // closing tag that is a special token cannot occur in text at all, so the text is free.
    let close = match markup {
        Markup::QwenXml => "\n</parameter>",
        Markup::Glm => ARG_VALUE_CLOSE,
    };
    let close_marker = close.trim_start();
    let text_rule = match special_id(close_marker) {
        Some(id) => format!("text_value: TEXT <[{id}]>\nTEXT: /(?s:.*)/\n"),
        None => {
            let pattern = regex_escape(close);
            format!("text_value[lazy]: /(?s:.*){pattern}/\n")
        }
    };
    rules.push_str(&text_rule);
    for (i, tool) in tools.iter().enumerate() {
        let name = format!("call_{i}");
        let (props, required) = properties(&tool.parameters);
        let mut parts = Vec::new();
        for (j, (key, schema)) in props.iter().enumerate() {
            let value = if is_text(Some(schema)) {
                "text_value".to_owned()
            } else {
                let rule = format!("json_{i}_{j}");
                rules.push_str(&format!("{rule}: %json {}\n", with_layout(schema)));
                let closing = literal(close_marker, special_id);
                match markup {
                    Markup::QwenXml => format!("{rule} \"\\n\" {closing}"),
                    Markup::Glm => format!("{rule} {closing}"),
                }
            };
            let arg = format!("arg_{i}_{j}");
            let needed = required.iter().any(|r| r == key);
            let key = lark_string(key);
            let line = match markup {
                Markup::QwenXml => {
                    format!("{arg}: \"<parameter=\" {key} \">\\n\" {value} \"\\n\"\n")
                }
                Markup::Glm => format!(
                    "{arg}: {} {key} {} \"\\n\" {} {value} \"\\n\"\n",
                    literal(ARG_KEY_OPEN, special_id),
                    literal(ARG_KEY_CLOSE, special_id),
                    literal(ARG_VALUE_OPEN, special_id),
                ),
            };
            rules.push_str(&line);
            parts.push(if needed { arg } else { format!("[{arg}]") });
        }
        let tool_name = lark_string(&tool.name);
        let body = parts.join(" ");
        let rule = match markup {
            Markup::QwenXml => format!(
                "{name}: \"\\n<function=\" {tool_name} \">\\n\" {body} \"</function>\\n\"\n"
            ),
            Markup::Glm => format!("{name}: {tool_name} \"\\n\" {body}\n"),
        };
        rules.push_str(&rule);
        names.push(name);
    }
    (rules, names)
}

/// The declared properties (in schema order) and the required names of an arguments schema.
fn properties(schema: &Value) -> (Vec<(String, Value)>, Vec<String>) {
    let props = schema
        .get("properties")
        .and_then(Value::as_object)
        .map(|p| p.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default();
    let required = schema
        .get("required")
        .and_then(Value::as_array)
        .map(|r| {
            r.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    (props, required)
}

/// A Lark string literal for `text`.
fn lark_string(text: &str) -> String {
    serde_json::to_string(text).unwrap_or_default()
}

/// `text` as a regex that matches it literally (`/` by its code, as Lark's regex literals end
/// at a bare `/`).
fn regex_escape(text: &str) -> String {
    let mut out = String::new();
    for c in text.chars() {
        match c {
            '/' => out.push_str("\\x2f"),
            '\n' => out.push_str("\\n"),
            c if "\\.+*?()|[]{}^$".contains(c) => {
                out.push('\\');
                out.push(c);
            }
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tools() -> Vec<ToolSpec> {
        vec![ToolSpec {
            name: "plan".into(),
            description: None,
            parameters: json!({"type": "object", "properties": {
                "city": {"type": "string"}, "days": {"type": "integer"},
                "scale": {"type": "number"}, "metric": {"type": "boolean"},
                "where": {"type": "object"}, "tags": {"type": "array"},
                "note": {"type": ["string", "null"]}, "pick": {"enum": [1, "two"]}}}),
        }]
    }

    #[test]
    fn values_are_typed_by_the_schema() {
        let t = tools();
        let call = qwen_xml_call(
            "\n<function=plan>\n<parameter=city>\nSão Paulo\n2 lines\n</parameter>\n\
             <parameter=days>\n3\n</parameter>\n<parameter=scale>\n2.5\n</parameter>\n\
             <parameter=metric>\nTrue\n</parameter>\n<parameter=where>\n{\"x\": [1]}\n</parameter>\n\
             <parameter=tags>\n[\"a\"]\n</parameter>\n<parameter=note>\nNone\n</parameter>\n\
             <parameter=pick>\ntwo\n</parameter>\n<parameter=extra>\n7\n</parameter>\n</function>\n",
            &t,
        )
        .unwrap();
        assert_eq!(call.name, "plan");
        assert_eq!(
            call.arguments,
            json!({"city": "São Paulo\n2 lines", "days": 3, "scale": 2.5, "metric": true,
                   "where": {"x": [1]}, "tags": ["a"], "note": null, "pick": "two", "extra": "7"})
        );
        // Text that is not of the schema's type stays text; numbers stay text for strings.
        assert_eq!(
            typed_value("many", Some(&json!({"type": "integer"}))),
            "many"
        );
        assert_eq!(typed_value("42", Some(&json!({"type": "string"}))), "42");
        assert_eq!(
            typed_value(" 1 ", Some(&json!({"type": ["integer", "string"]}))),
            1
        );
    }

    #[test]
    fn glm_calls_are_read() {
        let t = tools();
        let call = glm_call(
            "plan\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n\
             <arg_key>days</arg_key>\n<arg_value>2</arg_value>\n",
            &t,
        )
        .unwrap();
        assert_eq!(call.arguments, json!({"city": "Oslo", "days": 2}));
        let bare = glm_call("now\n", &t).unwrap();
        assert_eq!((bare.name.as_str(), bare.arguments), ("now", json!({})));
    }

    #[test]
    fn malformed_markup_is_no_call() {
        let t = tools();
        for inner in [
            "",
            "<function=plan>",
            "<function=a b>\n</function>",
            "<function=plan>\n<oops>\n</function>",
            "<function=plan>\n</function> trailing",
            "{\"name\": \"plan\"}",
        ] {
            assert_eq!(qwen_xml_call(inner, &t), None, "{inner:?}");
        }
        for inner in [
            "",
            "plan <arg_key>a</arg_key>",
            "plan <arg_key>a</arg_key><arg_value>1",
            "two words<arg_key>a</arg_key><arg_value>1</arg_value>",
            "plan\njunk",
        ] {
            assert_eq!(glm_call(inner, &t), None, "{inner:?}");
        }
    }

    #[test]
    fn a_lenient_qwen_value_ends_at_the_next_parameter() {
        let call = qwen_xml_call(
            "<function=plan>\n<parameter=city>\nOslo\n<parameter=days>\n4\n</parameter>\n</function>",
            &tools(),
        )
        .unwrap();
        assert_eq!(call.arguments, json!({"city": "Oslo", "days": 4}));
    }

    #[test]
    fn regexes_escape_markup() {
        assert_eq!(regex_escape("\n</parameter>"), "\\n<\\x2fparameter>");
        assert_eq!(regex_escape("a.b"), "a\\.b");
    }
}
