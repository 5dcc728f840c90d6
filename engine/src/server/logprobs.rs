//! Log-probability reports in OpenAI's two shapes: chat's list of entries (token, bytes,
//! alternatives) and the legacy completions' parallel lists. The values come from the MLX
//! thread ([`TokenLogprobs`]); this module only names the tokens.
use std::collections::BTreeMap;

use mlxd_protocol::openai::{ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob};

use crate::runtime::request::TokenLogprobs;
use crate::tokenizer::Tokenizer;

/// A token's text (lossy where its bytes are part of a character) and its bytes.
fn named(tokenizer: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = tokenizer.token_bytes(id);
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// Chat's `logprobs` for `tokens`, in order.
pub fn chat(tokenizer: &Tokenizer, tokens: &[(u32, TokenLogprobs)]) -> ChatLogprobs {
    let content = tokens
        .iter()
        .map(|(id, lp)| {
            let (token, bytes) = named(tokenizer, *id);
            ChatTokenLogprob {
                token,
                logprob: lp.logprob,
                bytes: Some(bytes),
                top_logprobs: lp
                    .top
                    .iter()
                    .map(|&(alt, logprob)| {
                        let (token, bytes) = named(tokenizer, alt);
                        TopLogprob {
                            token,
                            logprob,
                            bytes: Some(bytes),
                        }
                    })
                    .collect(),
            }
        })
        .collect();
    ChatLogprobs { content }
}

/// Builds one completions choice's `logprobs`, chunk by chunk: `text_offset` counts on from
/// the tokens of earlier chunks (the offset in the concatenation of the tokens' texts).
#[derive(Debug, Default)]
pub struct CompletionLogprobsBuilder {
    offset: usize,
}

impl CompletionLogprobsBuilder {
    pub fn chunk(
        &mut self,
        tokenizer: &Tokenizer,
        tokens: &[(u32, TokenLogprobs)],
    ) -> CompletionLogprobs {
        let mut out = CompletionLogprobs::default();
        for (id, lp) in tokens {
            let (token, _) = named(tokenizer, *id);
            out.text_offset.push(self.offset);
            self.offset += token.len();
            out.tokens.push(token);
            out.token_logprobs.push(lp.logprob);
            let mut top = BTreeMap::new();
            // Most likely first: an alternative whose text repeats keeps the likelier value.
            for &(alt, logprob) in &lp.top {
                top.entry(named(tokenizer, alt).0).or_insert(logprob);
            }
            out.top_logprobs.push(top);
        }
        out
    }
}

/// Appends `more` to `all` (a whole response's logprobs collected from its steps).
pub fn extend_completion(all: &mut CompletionLogprobs, more: CompletionLogprobs) {
    all.tokens.extend(more.tokens);
    all.token_logprobs.extend(more.token_logprobs);
    all.top_logprobs.extend(more.top_logprobs);
    all.text_offset.extend(more.text_offset);
}
