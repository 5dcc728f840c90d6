//! [`TokenConstraint`] with llguidance: grammars compiled from JSON schemas or Lark, masks
//! from its Earley parser over a token trie of the model's vocabulary.
//!
//! One [`GrammarCompiler`] per engine holds the token trie (built once from the tokenizer, a
//! fraction of a second); each constrained request compiles its grammar into a fresh
//! [`GrammarConstraint`] on the tokio side, so a bad schema is a 400 before anything reaches
//! the MLX thread.
use std::panic::AssertUnwindSafe;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use super::{ConstraintError, TokenConstraint};

/// What a request constrains its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// JSON text valid under this schema.
    JsonSchema(Value),
    /// A Lark grammar in llguidance's dialect (`%json { … }` embeds a schema).
    Lark(String),
}

/// How JSON is laid out under a constraint: one space after `,` and `:`, no other whitespace,
/// so a small model cannot wander into endless whitespace and the output reads as Python's
/// `json.dumps` writes it.
pub fn compact_json_options() -> Value {
    serde_json::json!({
        "whitespace_flexible": false,
        "item_separator": ", ",
        "key_separator": ": ",
    })
}

/// A JSON schema with [`compact_json_options`] attached (llguidance reads `x-guidance`).
pub fn with_layout(schema: &Value) -> Value {
    let mut schema = match schema {
        Value::Object(map) => Value::Object(map.clone()),
        // `true` (anything) and other non-object schemas are wrapped so options can attach.
        other => serde_json::json!({ "allOf": [other] }),
    };
    if let Value::Object(map) = &mut schema {
        map.insert("x-guidance".into(), compact_json_options());
    }
    schema
}

/// Compiles grammars against one model's vocabulary.
pub struct GrammarCompiler {
    factory: ParserFactory,
    vocab: usize,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("vocab", &self.vocab)
            .finish()
    }
}

impl GrammarCompiler {
    /// `model_vocab`: rows of the model's output layer (the mask length), which may exceed
    /// the tokenizer's vocabulary; `eos`: the ids that end a generation.
    pub fn new(
        tokenizer: &tokenizers::Tokenizer,
        eos: &[u32],
        model_vocab: usize,
    ) -> Result<Self, ConstraintError> {
        let mut bytes = toktrie_hf_tokenizers::ByteTokenizer::from_tokenizer(tokenizer.clone())
            .map_err(|e| ConstraintError(format!("cannot read the vocabulary: {e}")))?;
        if !eos.is_empty() {
            bytes.set_eos_tokens(eos);
        }
        let tokens = bytes.token_bytes().len();
        let env = bytes
            .into_tok_env(Some(model_vocab.max(tokens)))
            .map_err(|e| ConstraintError(format!("cannot build the token trie: {e}")))?;
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| ConstraintError(format!("cannot start the grammar engine: {e}")))?;
        factory.quiet();
        Ok(Self {
            factory,
            vocab: model_vocab,
        })
    }

    /// Compiles `grammar` into a constraint at the start of a generation. The error is the
    /// grammar engine's description of what is wrong with the grammar or schema.
    pub fn compile(&self, grammar: &Grammar) -> Result<GrammarConstraint, ConstraintError> {
        let top = match grammar {
            Grammar::JsonSchema(schema) => {
                if let Some(cycle) = ref_cycle(schema) {
                    return Err(ConstraintError(format!(
                        "the schema's $ref chain {cycle} never reaches a schema"
                    )));
                }
                TopLevelGrammar::from_json_schema(with_layout(schema))
            }
            Grammar::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        };
        // llguidance reports bad grammars as errors; a panic inside it is caught and
        // reported the same way rather than taking the request's thread down.
        let parser = std::panic::catch_unwind(AssertUnwindSafe(|| self.factory.create_parser(top)))
            .map_err(|_| ConstraintError("the grammar engine failed on this grammar".into()))?
            .map_err(|e| ConstraintError(e.to_string()))?;
        let mut matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(ConstraintError(short_reason(&e)));
        }
        // Some grammars compile but admit no text at all (a schema whose `$ref`s only refer
        // to each other); the parser finds out at its first mask, where the error would be a
        // 500 mid-generation. Computing it here makes it the request's fault, with a reason.
        let first = matcher.compute_mask().map_err(|e| {
            ConstraintError(format!(
                "the grammar admits no output ({})",
                short_reason(&e.to_string())
            ))
        })?;
        if first.is_zero() {
            return Err(ConstraintError("the grammar admits no output".into()));
        }
        Ok(GrammarConstraint {
            matcher,
            vocab: self.vocab,
        })
    }
}

/// A chain of local `$ref`s that comes back to where it started through schemas that are
/// nothing but a `$ref` (`{"$defs":{"a":{"$ref":"#/$defs/a"}},"$ref":"#/$defs/a"}`): no value
/// is valid under it. Returned as `#/$defs/a → #/$defs/a`. Other recursion (a tree whose
/// children refer to the node) is left to the grammar engine.
fn ref_cycle(schema: &Value) -> Option<String> {
    /// Keys that do not constrain a value: a schema with only these and `$ref` is its target.
    const ANNOTATIONS: &[&str] = &["$ref", "description", "title", "$comment", "examples"];
    let only_ref = |v: &Value| {
        v.as_object()
            .is_some_and(|o| o.keys().all(|k| ANNOTATIONS.contains(&k.as_str())))
    };
    let mut starts = Vec::new();
    let mut stack = vec![schema];
    while let Some(v) = stack.pop() {
        match v {
            Value::Object(o) => {
                if let Some(Value::String(r)) = o.get("$ref") {
                    starts.push(r.as_str());
                }
                stack.extend(o.values());
            }
            Value::Array(items) => stack.extend(items),
            _ => {}
        }
    }
    for start in starts {
        let mut chain: Vec<&str> = Vec::new();
        let mut r = start;
        loop {
            if chain.contains(&r) {
                chain.push(r);
                return Some(chain.join(" → "));
            }
            chain.push(r);
            // Local references only; JSON pointers after the `#`.
            let Some(pointer) = r.strip_prefix('#') else {
                break;
            };
            match schema.pointer(pointer) {
                Some(target) if only_ref(target) => match target.get("$ref") {
                    Some(Value::String(next)) => r = next,
                    _ => break,
                },
                _ => break,
            }
        }
    }
    None
}

/// The first line of a grammar engine error, at most 300 characters: its messages can carry
/// the parser's whole internal state, which is neither short nor the client's business.
fn short_reason(message: &str) -> String {
    const MAX: usize = 300;
    let line = message.lines().next().unwrap_or("").trim();
    let line = line.strip_prefix("Parser Error: ").unwrap_or(line);
    match line.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{}…", &line[..cut]),
        None if line.is_empty() => "the grammar engine rejected this grammar".into(),
        None => line.to_string(),
    }
}

/// One generation's grammar state.
pub struct GrammarConstraint {
    matcher: Matcher,
    vocab: usize,
}

impl std::fmt::Debug for GrammarConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarConstraint")
            .field("vocab", &self.vocab)
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl GrammarConstraint {
    /// The allowed ids of the next token (for tests and tools that drive a constraint
    /// without a model).
    pub fn allowed(&mut self) -> Result<Vec<u32>, ConstraintError> {
        let mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| ConstraintError(e.to_string()))?;
        Ok(mask
            .to_list()
            .into_iter()
            .filter(|&t| (t as usize) < self.vocab)
            .collect())
    }
}

impl TokenConstraint for GrammarConstraint {
    fn mask(&mut self, row: &mut [f32]) -> Result<(), ConstraintError> {
        let mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| ConstraintError(e.to_string()))?;
        row.fill(f32::NEG_INFINITY);
        let mut any = false;
        mask.iter_set_entries(|i| {
            if let Some(slot) = row.get_mut(i) {
                *slot = 0.0;
                any = true;
            }
        });
        if !any {
            return Err(ConstraintError(
                "the grammar allows no token of the model's vocabulary".into(),
            ));
        }
        Ok(())
    }

    fn commit(&mut self, token: u32) -> Result<bool, ConstraintError> {
        self.matcher
            .consume_token(token)
            .map_err(|e| ConstraintError(e.to_string()))?;
        Ok(self.matcher.is_stopped())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tests::load_fixture;

    fn compiler() -> GrammarCompiler {
        let tok = load_fixture("qwen3");
        GrammarCompiler::new(
            tok.hf(),
            tok.stop_token_ids(),
            tok.hf().get_vocab_size(true),
        )
        .unwrap()
    }

    /// Issue 23, finding 6: a schema that only refers to itself compiled, then failed at the
    /// first mask with the parser's internal state in a 500. It is refused at compile time
    /// (a 400 at the route) with a short reason.
    #[test]
    fn a_schema_that_only_refers_to_itself_is_refused_with_a_short_reason() {
        let c = compiler();
        for schema in [
            serde_json::json!({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
            serde_json::json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}),
        ] {
            let e = c.compile(&Grammar::JsonSchema(schema.clone())).unwrap_err();
            assert!(e.0.len() <= 310 && !e.0.contains('\n'), "{schema}: {e}");
            assert!(e.0.contains("#/$defs/a → "), "{schema}: {e}");
        }
        assert_eq!(
            ref_cycle(
                &serde_json::json!({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})
            ),
            Some("#/$defs/a → #/$defs/a".into())
        );
        // A recursive schema with a base case still compiles.
        let tree = serde_json::json!({"$defs": {"node": {"type": "object", "properties": {
            "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}}},
            "$ref": "#/$defs/node"});
        let mut g = c.compile(&Grammar::JsonSchema(tree)).unwrap();
        assert!(!g.allowed().unwrap().is_empty());
    }

    #[test]
    fn reasons_are_one_short_line() {
        assert_eq!(short_reason("Parser Error: bad\nstate: [...]"), "bad");
        let long = "x".repeat(1000);
        assert_eq!(short_reason(&long).chars().count(), 301);
        assert!(!short_reason("").is_empty());
    }
}
