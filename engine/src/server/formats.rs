//! A model family's chat format as its chat template reveals it: how the model writes its
//! reasoning and its tool calls, which special tokens the text must keep for them, the tool-call
//! ids its template accepts, and the conversation changes its template needs.
//!
//! Everything is decided from the template's text (the markers it writes), so a model is
//! served in its own format whatever it is called.
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::harmony;
use super::reasoning::{THINK_CLOSE, THINK_OPEN};
use super::tools::ToolFormat;

/// How a model separates its reasoning from its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningFormat {
    /// No reasoning markup: all output is answer.
    None,
    /// `<think>` … `</think>` before the answer (Qwen3, GLM-4.5, DeepSeek-R1).
    ThinkTags,
    /// OpenAI's harmony channels (gpt-oss): `analysis` is reasoning, `final` the answer, and
    /// tool calls are messages addressed `to=functions.NAME`.
    Harmony,
}

/// The shape of the tool-call ids a template accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallIdStyle {
    /// Any string: `call_…` (OpenAI) or `toolu_…` (Anthropic).
    Prefixed,
    /// Exactly nine ASCII letters and digits: Mistral's templates refuse anything else.
    NineAlphanumeric,
}

/// A model family's chat format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatFormat {
    pub tools: ToolFormat,
    pub reasoning: ReasoningFormat,
    pub call_ids: CallIdStyle,
}

impl ChatFormat {
    /// The format a chat template writes. The one place that decides: the more specific
    /// markers are checked first, since Qwen3-Coder's and GLM-4.5's templates also write
    /// `<tool_call>`.
    pub fn detect(template_source: &str) -> Self {
        let tools = ToolFormat::detect(template_source);
        let reasoning = if tools == ToolFormat::Harmony {
            ReasoningFormat::Harmony
        } else if template_source.contains(THINK_OPEN) {
            ReasoningFormat::ThinkTags
        } else {
            ReasoningFormat::None
        };
        let call_ids = if tools == ToolFormat::Mistral {
            CallIdStyle::NineAlphanumeric
        } else {
            CallIdStyle::Prefixed
        };
        Self {
            tools,
            reasoning,
            call_ids,
        }
    }

    /// The markers the output parser looks for: the tool format's when calls are parsed,
    /// the reasoning format's always.
    fn markers(&self, tools_parsed: bool) -> Vec<&'static str> {
        let mut markers: Vec<&'static str> = match self.reasoning {
            ReasoningFormat::None => Vec::new(),
            ReasoningFormat::ThinkTags => vec![THINK_OPEN, THINK_CLOSE],
            ReasoningFormat::Harmony => harmony::MARKERS.to_vec(),
        };
        if tools_parsed {
            markers.extend_from_slice(self.tools.markers());
        }
        markers
    }

    /// Whether the output's text must keep special tokens: when any marker the parser reads
    /// is one (`is_special` says which texts are special tokens of the vocabulary), since
    /// detokenizing without them would erase the markup.
    pub fn keeps_special_tokens(
        &self,
        tools_parsed: bool,
        is_special: &dyn Fn(&str) -> bool,
    ) -> bool {
        self.markers(tools_parsed).into_iter().any(is_special)
    }
}

/// A fresh tool-call id in `style`; `prefix` (`call`, `toolu`) for prefixed ids.
pub fn new_call_id(style: CallIdStyle, prefix: &str) -> String {
    let id = uuid::Uuid::new_v4().simple().to_string();
    match style {
        CallIdStyle::Prefixed => format!("{prefix}_{}", &id[..24]),
        CallIdStyle::NineAlphanumeric => id[..9].to_owned(),
    }
}

fn is_nine_alphanumeric(id: &str) -> bool {
    id.len() == 9 && id.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// `id` as nine letters and digits: unchanged when it already is, else derived from its hash,
/// so that a call and the result that answers it still match.
fn nine_alphanumeric(id: &str) -> String {
    if is_nine_alphanumeric(id) {
        return id.to_owned();
    }
    let digest = Sha256::digest(id.as_bytes());
    digest
        .iter()
        .take(5)
        .flat_map(|b| [b >> 4, b & 0xf])
        .take(9)
        .map(|nibble| char::from_digit(u32::from(nibble), 16).unwrap_or('0'))
        .collect()
}

/// The conversation with every tool-call id in `style`: ids of earlier calls (from clients, or
/// from another model) become ids the template accepts, the same way for a call and for the
/// tool message that answers it.
pub fn normalize_call_ids(messages: &mut [Value], style: CallIdStyle) {
    if style == CallIdStyle::Prefixed {
        return;
    }
    for message in messages.iter_mut() {
        let Some(obj) = message.as_object_mut() else {
            continue;
        };
        if let Some(Value::Array(calls)) = obj.get_mut("tool_calls") {
            for call in calls {
                if let Some(Value::String(id)) = call.get_mut("id") {
                    *id = nine_alphanumeric(id);
                }
            }
        }
        if let Some(Value::String(id)) = obj.get_mut("tool_call_id") {
            *id = nine_alphanumeric(id);
        }
    }
}

/// Null contents (an assistant turn that only calls tools) as empty text, as mlx-lm's server
/// passes them: templates test `'</think>' in message.content` and concatenate contents,
/// which fails on `None` (in Python's Jinja as in ours).
pub fn null_contents_as_empty(messages: &mut [Value]) {
    for message in messages.iter_mut() {
        if let Some(obj) = message.as_object_mut() {
            if obj.get("content").is_none_or(Value::is_null) {
                obj.insert("content".into(), Value::from(""));
            }
        }
    }
}

/// Whether a template's refusal is about roles (`System role not supported`, `Only user and
/// assistant roles are supported!`): then a system message may be what it refuses.
pub fn refuses_a_role(message: &str) -> bool {
    let message = message.to_ascii_lowercase();
    message.contains("system") || message.contains("role")
}

/// For templates without a system role (Gemma 1 and 2 refuse one): the system messages
/// folded into the first user turn, as Gemma 3's template does itself (system text, a blank
/// line, then the user's text). `None` when there is no system message to fold.
pub fn fold_system_into_first_user(messages: &[Value]) -> Option<Vec<Value>> {
    let is_system = |m: &Value| m.get("role").and_then(Value::as_str) == Some("system");
    if !messages.iter().any(is_system) {
        return None;
    }
    let system: Vec<&str> = messages
        .iter()
        .filter(|m| is_system(m))
        .filter_map(|m| m.get("content").and_then(Value::as_str))
        .collect();
    let system = system.join("\n\n");
    let mut out: Vec<Value> = messages.iter().filter(|m| !is_system(m)).cloned().collect();
    let first_user = out
        .iter_mut()
        .find(|m| m.get("role").and_then(Value::as_str) == Some("user"));
    match first_user {
        Some(user) => {
            let text = user.get("content").and_then(Value::as_str).unwrap_or("");
            user["content"] = Value::from(format!("{system}\n\n{text}"));
        }
        None => out.insert(0, serde_json::json!({"role": "user", "content": system})),
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_format_is_picked_from_the_template_markers() {
        let cases = [
            (
                "<|start|>assistant<|channel|>final<|message|>",
                ToolFormat::Harmony,
                ReasoningFormat::Harmony,
            ),
            (
                "<tool_call>\n<function=x>\n<parameter=y>",
                ToolFormat::QwenXml,
                ReasoningFormat::None,
            ),
            (
                "<think></think><tool_call>{{ tc.name }}<arg_key>k</arg_key>",
                ToolFormat::Glm,
                ReasoningFormat::ThinkTags,
            ),
            (
                "<think>\n<tool_call>\n{\"name\": …}",
                ToolFormat::Hermes,
                ReasoningFormat::ThinkTags,
            ),
            ("[TOOL_CALLS] [", ToolFormat::Mistral, ReasoningFormat::None),
            (
                "<start_of_turn>user\n",
                ToolFormat::Llama3Json,
                ReasoningFormat::None,
            ),
        ];
        for (template, tools, reasoning) in cases {
            let f = ChatFormat::detect(template);
            assert_eq!((f.tools, f.reasoning), (tools, reasoning), "{template}");
            let nine = tools == ToolFormat::Mistral;
            assert_eq!(f.call_ids == CallIdStyle::NineAlphanumeric, nine);
        }
    }

    #[test]
    fn special_markers_keep_special_tokens() {
        let harmony = ChatFormat::detect("<|channel|>");
        let special = |t: &str| t == "<|channel|>";
        assert!(harmony.keeps_special_tokens(false, &special));
        let mistral = ChatFormat::detect("[TOOL_CALLS]");
        let special = |t: &str| t == "[TOOL_CALLS]";
        assert!(mistral.keeps_special_tokens(true, &special));
        assert!(!mistral.keeps_special_tokens(false, &special));
        let qwen = ChatFormat::detect("<think><tool_call>");
        assert!(!qwen.keeps_special_tokens(true, &|_| false));
    }

    #[test]
    fn call_ids_have_the_template_shape() {
        let id = new_call_id(CallIdStyle::NineAlphanumeric, "call");
        assert!(is_nine_alphanumeric(&id), "{id}");
        assert!(new_call_id(CallIdStyle::Prefixed, "toolu").starts_with("toolu_"));
        let mut messages = vec![
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_0123456789abcdef", "function": {"name": "w", "arguments": {}}},
                {"id": "abcDEF123", "function": {"name": "w", "arguments": {}}}]}),
            json!({"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "1"}),
            json!({"role": "tool", "tool_call_id": "abcDEF123", "content": "2"}),
        ];
        normalize_call_ids(&mut messages, CallIdStyle::NineAlphanumeric);
        let first = messages[0]["tool_calls"][0]["id"].as_str().unwrap();
        assert!(is_nine_alphanumeric(first), "{first}");
        assert_eq!(messages[1]["tool_call_id"], first);
        assert_eq!(messages[0]["tool_calls"][1]["id"], "abcDEF123");
        assert_eq!(messages[2]["tool_call_id"], "abcDEF123");
    }

    #[test]
    fn system_text_goes_before_the_first_user_turn() {
        let folded = fold_system_into_first_user(&[
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": "Hi"}),
            json!({"role": "assistant", "content": "Hello"}),
            json!({"role": "user", "content": "Bye"}),
        ])
        .unwrap();
        assert_eq!(folded.len(), 3);
        assert_eq!(
            folded[0],
            json!({"role": "user", "content": "Be brief.\n\nHi"})
        );
        assert_eq!(folded[2]["content"], "Bye");
        assert!(fold_system_into_first_user(&[json!({"role": "user", "content": "x"})]).is_none());
        assert!(refuses_a_role("System role not supported"));
        assert!(refuses_a_role(
            "Only user and assistant roles are supported!"
        ));
        assert!(!refuses_a_role(
            "Tool call IDs should be alphanumeric strings with length 9!"
        ));
    }
}
