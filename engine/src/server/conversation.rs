//! What the chat routes of both APIs share: a conversation with tools, a tool choice, an
//! output format and template variables, turned into a prompt and an optional token
//! constraint; and the generation's text turned into thinking, answer and tool calls.
//!
//! The OpenAI and Anthropic routes translate their requests into a [`Conversation`] (messages
//! as Hugging Face chat templates take them) and their responses from [`Piece`]s.
use std::sync::Arc;
use std::time::Instant;

use serde_json::{Map, Value};

use super::error::ApiError;
use super::formats::{self, CallIdStyle, ChatFormat, ReasoningFormat};
use super::generation::{Generation, Step};
use super::harmony::HarmonyStream;
use super::reasoning::{Part, ReasoningSplit};
use super::tools::{self, ParsedCall, ToolChoice, ToolFormat, ToolPiece, ToolSpec, ToolStream};
use super::ServerState;
use crate::chat_template::ChatTemplateError;
use crate::constraint::grammar::{Grammar, GrammarCompiler};
use crate::constraint::TokenConstraint;
use crate::runtime::request::FinishReason;

/// A chat request in the terms of the chat template.
#[derive(Debug, Clone)]
pub struct Conversation {
    /// `{"role", "content", "tool_calls"?, "tool_call_id"?, "name"?}` objects; assistant
    /// `tool_calls` carry `function.arguments` as objects, as templates expect.
    pub messages: Vec<Value>,
    pub tools: Vec<ToolSpec>,
    pub choice: Option<ToolChoice>,
    pub parallel_tool_calls: bool,
    /// Structured output: the grammar and the request field it came from (for errors).
    pub output: Option<(Grammar, String)>,
    /// Extra template variables (`chat_template_kwargs`, `enable_thinking`).
    pub template_vars: Map<String, Value>,
    /// Where a tool's schema is in the request, after `tools[i].` (for errors).
    pub tool_schema_field: &'static str,
}

/// A conversation rendered and tokenized, with what its output needs.
pub struct Prepared {
    pub prompt: Vec<u32>,
    pub constraint: Option<Box<dyn TokenConstraint>>,
    pub parser: OutputParser,
    /// Whether special tokens are kept in the text (a format marker may be one).
    pub keep_special: bool,
}

/// Renders `conv` and compiles its constraint. Runs the tokenizer and the grammar compiler,
/// so call it off the async threads.
pub fn prepare(state: &ServerState, conv: Conversation) -> Result<Prepared, ApiError> {
    let tokenizer = &state.tokenizer;
    let template = tokenizer.chat_template().ok_or_else(|| {
        ApiError::invalid(
            "messages",
            crate::tokenizer::TokenizerError::NoChatTemplate.to_string(),
        )
    })?;
    let choice = conv
        .choice
        .clone()
        .unwrap_or_else(|| tools::default_choice(&conv.tools));
    let offered = !conv.tools.is_empty() && choice != ToolChoice::None;
    let renders_tools = template.renders_tools();
    let chat_format = ChatFormat::detect(template.source());
    // Templates that do not render tools get them described in a system message and calls
    // in the Llama 3.x JSON form, which the forced grammar and the parser then use.
    let format = if renders_tools {
        chat_format.tools
    } else {
        ToolFormat::Llama3Json
    };
    let mut messages = if renders_tools {
        conv.messages.clone()
    } else {
        describe_tools_inline(&conv.messages, offered.then_some(conv.tools.as_slice()))
    };
    formats::normalize_call_ids(&mut messages, chat_format.call_ids);
    formats::null_contents_as_empty(&mut messages);
    let mut tool_json: Vec<Value> = conv.tools.iter().map(ToolSpec::template_json).collect();
    let mut template_vars = conv.template_vars.clone();
    // Special tokens' text in client strings stays text (`tokenizer::ClientText`).
    let shielding = Instant::now();
    let mut client = crate::tokenizer::ClientText::default();
    for v in messages
        .iter_mut()
        .chain(tool_json.iter_mut())
        .chain(template_vars.values_mut())
    {
        tokenizer.shield(v, &mut client)?;
    }
    let rendering = Instant::now();
    let tools_arg = (offered && renders_tools).then_some(tool_json.as_slice());
    let render =
        |messages: &[Value]| template.render_json(messages, tools_arg, true, &template_vars);
    let text = match render(&messages) {
        // A template without a system role (Gemma 1 and 2) refuses system messages: they go
        // into the first user turn instead.
        Err(ChatTemplateError::Raised(why)) if formats::refuses_a_role(&why) => {
            match formats::fold_system_into_first_user(&messages) {
                Some(folded) => render(&folded),
                None => Err(ChatTemplateError::Raised(why)),
            }
        }
        rendered => rendered,
    }
    .map_err(|e| ApiError::from(crate::tokenizer::TokenizerError::Template(e)))?;
    let tokenizing = Instant::now();
    let (text, prompt) = tokenizer.encode_rendered(&text, &client)?;
    // What a long conversation costs before the runtime sees it (the prefix cache saves the
    // prefill, not this): each part grows with the whole history, every turn.
    tracing::debug!(
        target: "mlxd_engine::prefix",
        chars = text.len(),
        tokens = prompt.len(),
        shield_us = rendering.duration_since(shielding).as_micros() as u64,
        render_us = tokenizing.duration_since(rendering).as_micros() as u64,
        tokenize_us = tokenizing.elapsed().as_micros() as u64,
        "chat prompt"
    );
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "the chat template rendered these messages as an empty prompt",
        ));
    }

    // The grammar engine's trie holds added tokens (special or not) by id only.
    let added = tokenizer.hf().get_added_tokens_decoder();
    let special_id = |marker: &str| {
        tokenizer
            .token_to_id(marker)
            .filter(|id| added.contains_key(id))
    };
    let forced = if offered {
        tools::forced_grammar(
            format,
            &conv.tools,
            &choice,
            conv.parallel_tool_calls,
            &special_id,
        )
    } else {
        None
    };
    let constraint: Option<Box<dyn TokenConstraint>> = match (&forced, &conv.output) {
        (Some(grammar), _) => Some(Box::new(compile_tool_grammar(
            state, grammar, &conv, &choice, format,
        )?)),
        (None, Some((grammar, param))) => {
            let compiler = compiler(state)?;
            Some(Box::new(compiler.compile(grammar).map_err(|e| {
                ApiError::invalid(param.clone(), format!("invalid JSON schema: {}", e.0))
            })?))
        }
        (None, None) => None,
    };
    let harmony = chat_format.reasoning == ReasoningFormat::Harmony;
    let thinking = chat_format.reasoning == ReasoningFormat::ThinkTags;
    let parser = OutputParser {
        reasoning: thinking.then(|| ReasoningSplit::new(&text)),
        tools: (offered && !harmony).then(|| ToolStream::with_tools(format, conv.tools.clone())),
        harmony: harmony.then(|| HarmonyStream::new(offered)),
        call_ids: chat_format.call_ids,
    };
    let is_special = |marker: &str| {
        tokenizer
            .token_to_id(marker)
            .is_some_and(|id| tokenizer.is_special(id))
    };
    let keep_special = chat_format.keeps_special_tokens(offered, &is_special);
    Ok(Prepared {
        prompt,
        constraint,
        parser,
        keep_special,
    })
}

/// The engine's grammar compiler, built on first use.
fn compiler(state: &ServerState) -> Result<Arc<GrammarCompiler>, ApiError> {
    state
        .grammar
        .get_or_init(|| {
            GrammarCompiler::new(
                state.tokenizer.hf(),
                state.tokenizer.stop_token_ids(),
                state.model_vocab,
            )
            .map(Arc::new)
            .map_err(|e| e.0)
        })
        .clone()
        .map_err(|e| ApiError::Internal(format!("the grammar engine is unavailable: {e}")))
}

/// Compiles a forced tool call's grammar; when it fails, finds the tool whose schema is at
/// fault so that the error names it.
fn compile_tool_grammar(
    state: &ServerState,
    grammar: &Grammar,
    conv: &Conversation,
    choice: &ToolChoice,
    format: ToolFormat,
) -> Result<crate::constraint::grammar::GrammarConstraint, ApiError> {
    let compiler = compiler(state)?;
    match compiler.compile(grammar) {
        Ok(c) => Ok(c),
        Err(whole) => {
            for (i, tool) in conv.tools.iter().enumerate() {
                if let ToolChoice::Named(name) = choice {
                    if &tool.name != name {
                        continue;
                    }
                }
                let alone = ToolChoice::Named(tool.name.clone());
                let Some(g) = tools::forced_grammar(
                    format,
                    std::slice::from_ref(tool),
                    &alone,
                    false,
                    &|_| None,
                ) else {
                    continue;
                };
                if let Err(e) = compiler.compile(&g) {
                    return Err(ApiError::invalid(
                        format!("tools[{i}].{}", conv.tool_schema_field),
                        format!("invalid JSON schema for tool {:?}: {}", tool.name, e.0),
                    ));
                }
            }
            Err(ApiError::invalid(
                "tools",
                format!("the tools' schemas do not compile: {}", whole.0),
            ))
        }
    }
}

/// For templates that do not render tools: the tools described in the system message,
/// earlier calls written into the assistant turns as JSON, null contents as empty strings.
fn describe_tools_inline(messages: &[Value], tools: Option<&[ToolSpec]>) -> Vec<Value> {
    let mut out: Vec<Value> = messages
        .iter()
        .map(|m| {
            let mut m = m.clone();
            if let Some(obj) = m.as_object_mut() {
                if let Some(Value::Array(calls)) = obj.remove("tool_calls") {
                    let text: Vec<String> = calls
                        .iter()
                        .map(|c| {
                            let f = c.get("function").unwrap_or(c);
                            tools::call_as_text(
                                f.get("name").and_then(Value::as_str).unwrap_or_default(),
                                f.get("arguments").unwrap_or(&Value::Null),
                            )
                        })
                        .collect();
                    let before = obj
                        .get("content")
                        .and_then(Value::as_str)
                        .unwrap_or_default();
                    let joined = [before.to_owned(), text.join("\n")]
                        .into_iter()
                        .filter(|s| !s.is_empty())
                        .collect::<Vec<_>>()
                        .join("\n");
                    obj.insert("content".into(), Value::from(joined));
                }
                if obj.get("content").is_none_or(Value::is_null) {
                    obj.insert("content".into(), Value::from(""));
                }
            }
            m
        })
        .collect();
    if let Some(tools) = tools {
        let described = tools::tools_system_text(tools);
        match out.first_mut() {
            Some(first) if first.get("role").and_then(Value::as_str) == Some("system") => {
                let before = first
                    .get("content")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                first["content"] = Value::from(format!("{before}\n\n{described}"));
            }
            _ => out.insert(
                0,
                serde_json::json!({"role": "system", "content": described}),
            ),
        }
    }
    out
}

/// Thinking, answer text, or a tool call.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
    Call(ParsedCall),
}

/// Reasoning split, then tool-call parsing, over the streamed text (or harmony's channels,
/// which carry both).
#[derive(Debug)]
pub struct OutputParser {
    reasoning: Option<ReasoningSplit>,
    tools: Option<ToolStream>,
    harmony: Option<HarmonyStream>,
    /// The shape of the ids given to the calls.
    call_ids: CallIdStyle,
}

impl OutputParser {
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        if let Some(harmony) = &mut self.harmony {
            return harmony.push(text);
        }
        let parts = match &mut self.reasoning {
            Some(r) => r.push(text),
            None => vec![Part::Answer(text.to_owned())],
        };
        self.route(parts, false)
    }

    pub fn finish(&mut self) -> Vec<Piece> {
        if let Some(harmony) = &mut self.harmony {
            return harmony.finish();
        }
        let parts = match &mut self.reasoning {
            Some(r) => r.finish(),
            None => Vec::new(),
        };
        self.route(parts, true)
    }

    fn route(&mut self, parts: Vec<Part>, end: bool) -> Vec<Piece> {
        let mut out = Vec::new();
        for part in parts {
            match part {
                Part::Thinking(t) => out.push(Piece::Reasoning(t)),
                Part::Answer(a) => match &mut self.tools {
                    Some(tools) => out.extend(tools.push(&a).into_iter().map(tool_piece)),
                    None => out.push(Piece::Content(a)),
                },
            }
        }
        if end {
            if let Some(tools) = &mut self.tools {
                out.extend(tools.finish().into_iter().map(tool_piece));
            }
        }
        out.retain(|p| !matches!(p, Piece::Content(t) | Piece::Reasoning(t) if t.is_empty()));
        out
    }
}

fn tool_piece(p: ToolPiece) -> Piece {
    match p {
        ToolPiece::Text(t) => Piece::Content(t),
        ToolPiece::Call(c) => Piece::Call(c),
    }
}

/// What the agent generation yields.
#[derive(Debug)]
pub enum AgentStep {
    /// Pieces and the token ids behind them (ids of held-back text come with the piece that
    /// finally carries it).
    Pieces(Vec<Piece>, Vec<u32>),
    Finished {
        pieces: Vec<Piece>,
        ids: Vec<u32>,
        reason: FinishReason,
    },
    Failed(ApiError),
}

/// A [`Generation`] read through an [`OutputParser`].
pub struct AgentGeneration {
    pub generation: Generation,
    parser: OutputParser,
    held_ids: Vec<u32>,
}

impl AgentGeneration {
    pub fn new(generation: Generation, parser: OutputParser) -> Self {
        Self {
            generation,
            parser,
            held_ids: Vec::new(),
        }
    }

    /// A fresh id for a call of this output, in the shape the model's template accepts back
    /// (`prefix`: `call` for OpenAI, `toolu` for Anthropic, where the shape has one).
    pub fn call_id(&self, prefix: &str) -> String {
        formats::new_call_id(self.parser.call_ids, prefix)
    }

    pub async fn next(&mut self) -> Option<AgentStep> {
        loop {
            match self.generation.next().await? {
                Step::Text(delta) => {
                    self.held_ids.extend(delta.ids);
                    let pieces = self.parser.push(&delta.text);
                    if !pieces.is_empty() {
                        return Some(AgentStep::Pieces(
                            pieces,
                            std::mem::take(&mut self.held_ids),
                        ));
                    }
                }
                Step::Finished { last, reason } => {
                    self.held_ids.extend(last.ids);
                    let mut pieces = self.parser.push(&last.text);
                    pieces.extend(self.parser.finish());
                    return Some(AgentStep::Finished {
                        pieces,
                        ids: std::mem::take(&mut self.held_ids),
                        reason,
                    });
                }
                Step::Failed(e) => return Some(AgentStep::Failed(e)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tools_are_described_inline_for_templates_without_them() {
        let tools = vec![ToolSpec {
            name: "w".into(),
            description: None,
            parameters: json!({"type": "object"}),
        }];
        let messages = vec![
            json!({"role": "user", "content": "weather?"}),
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "w", "arguments": {"city": "Oslo"}}}]}),
            json!({"role": "tool", "content": "sunny", "tool_call_id": "c1"}),
        ];
        let out = describe_tools_inline(&messages, Some(&tools));
        assert_eq!(out[0]["role"], "system");
        assert!(
            out[0]["content"]
                .as_str()
                .unwrap()
                .contains("\"name\": \"w\"")
                || out[0]["content"]
                    .as_str()
                    .unwrap()
                    .contains("\"name\":\"w\"")
        );
        assert_eq!(
            out[2]["content"],
            r#"{"name":"w","parameters":{"city":"Oslo"}}"#
        );
        assert!(out[2].get("tool_calls").is_none());
        assert_eq!(out[3]["content"], "sunny");
    }

    #[test]
    fn the_parser_splits_thinking_answer_and_calls() {
        let mut p = OutputParser {
            reasoning: Some(ReasoningSplit::new("")),
            tools: Some(ToolStream::new(ToolFormat::Hermes)),
            harmony: None,
            call_ids: CallIdStyle::Prefixed,
        };
        let mut pieces = p.push("<think>hm</think>\n\nok <tool_call>\n{\"name\": \"w\", \"arguments\": {}}\n</tool_call>");
        pieces.extend(p.finish());
        assert_eq!(
            pieces,
            vec![
                Piece::Reasoning("hm".into()),
                Piece::Content("ok ".into()),
                Piece::Call(ParsedCall {
                    name: "w".into(),
                    arguments: json!({})
                })
            ]
        );
    }
}
