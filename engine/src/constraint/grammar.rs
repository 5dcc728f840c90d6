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
            Grammar::JsonSchema(schema) => TopLevelGrammar::from_json_schema(with_layout(schema)),
            Grammar::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        };
        // llguidance reports bad grammars as errors; a panic inside it is caught and
        // reported the same way rather than taking the request's thread down.
        let parser = std::panic::catch_unwind(AssertUnwindSafe(|| self.factory.create_parser(top)))
            .map_err(|_| ConstraintError("the grammar engine failed on this grammar".into()))?
            .map_err(|e| ConstraintError(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(ConstraintError(e));
        }
        Ok(GrammarConstraint {
            matcher,
            vocab: self.vocab,
        })
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
