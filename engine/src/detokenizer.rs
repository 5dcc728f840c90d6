//! Incremental detokenization for streaming.
//!
//! Decoding one token at a time is wrong for both common tokenizer families: a byte-level BPE
//! token may hold half of a UTF-8 character, and a SentencePiece decoder treats the first token
//! of a sequence differently (its leading `▁` space may be stripped). So each step decodes a
//! short window — a few tokens already emitted (the prefix) plus the new ones — and emits the
//! part of the text past the prefix's text. While the window's text ends in U+FFFD (an
//! incomplete byte sequence) nothing is emitted; the bytes complete with a later token.
use std::sync::Arc;

use crate::tokenizer::{Tokenizer, TokenizerError};

/// How many already-emitted tokens a fresh detokenizer primed with earlier ids keeps as context.
const PRIOR_CONTEXT: usize = 5;

/// Text that became final with the last token(s), and the ids that produced it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Delta {
    pub text: String,
    /// Every id fed since the previous non-empty delta, in order.
    pub ids: Vec<u32>,
}

/// Turns a stream of token ids into a stream of UTF-8 text deltas.
pub struct Detokenizer {
    tokenizer: Arc<Tokenizer>,
    skip_special_tokens: bool,
    ids: Vec<u32>,
    /// Start of the decode window.
    prefix_offset: usize,
    /// End of the tokens whose text has been emitted.
    read_offset: usize,
}

impl Detokenizer {
    /// A detokenizer for a fresh generation.
    pub fn new(tokenizer: Arc<Tokenizer>, skip_special_tokens: bool) -> Self {
        Self::with_prior(tokenizer, skip_special_tokens, &[])
    }

    /// A detokenizer that continues after `prior` ids whose text was already emitted (a resumed
    /// stream, or a prompt the output continues); their text is never emitted again.
    pub fn with_prior(tokenizer: Arc<Tokenizer>, skip_special_tokens: bool, prior: &[u32]) -> Self {
        let keep = prior.len().min(PRIOR_CONTEXT);
        let ids = prior[prior.len() - keep..].to_vec();
        Self {
            tokenizer,
            skip_special_tokens,
            read_offset: ids.len(),
            prefix_offset: 0,
            ids,
        }
    }

    /// Feeds one id; returns the text that became final, possibly empty (held back).
    pub fn push(&mut self, id: u32) -> Result<Delta, TokenizerError> {
        self.ids.push(id);
        let prefix = self.decode(self.prefix_offset, self.read_offset)?;
        let full = self.decode(self.prefix_offset, self.ids.len())?;
        if full.ends_with('\u{FFFD}') || full.len() <= prefix.len() {
            return Ok(Delta::default());
        }
        let Some(text) = full.strip_prefix(prefix.as_str()) else {
            // The window's text changed before the new tokens (a decoder that rewrites
            // earlier text); wait until it settles rather than emit text twice.
            return Ok(Delta::default());
        };
        let delta = Delta {
            text: text.to_owned(),
            ids: self.ids[self.read_offset..].to_vec(),
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        self.compact();
        Ok(delta)
    }

    /// Emits whatever is held back (at the end of a generation), replacement characters and
    /// all, with the ids behind it.
    pub fn flush(&mut self) -> Result<Delta, TokenizerError> {
        if self.read_offset == self.ids.len() {
            return Ok(Delta::default());
        }
        let prefix = self.decode(self.prefix_offset, self.read_offset)?;
        let full = self.decode(self.prefix_offset, self.ids.len())?;
        let text = match full.strip_prefix(prefix.as_str()) {
            Some(text) => text.to_owned(),
            None => {
                let common = common_prefix_len(&prefix, &full);
                full[common..].to_owned()
            }
        };
        let delta = Delta {
            text,
            ids: self.ids[self.read_offset..].to_vec(),
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(delta)
    }

    /// Ids fed but not yet covered by an emitted delta.
    pub fn pending_ids(&self) -> &[u32] {
        &self.ids[self.read_offset..]
    }

    fn decode(&self, start: usize, end: usize) -> Result<String, TokenizerError> {
        self.tokenizer
            .decode(&self.ids[start..end], self.skip_special_tokens)
    }

    /// Drops ids before the window so memory stays bounded on long generations.
    fn compact(&mut self) {
        if self.prefix_offset > 64 {
            self.ids.drain(..self.prefix_offset);
            self.read_offset -= self.prefix_offset;
            self.prefix_offset = 0;
        }
    }
}

/// Byte length of the longest common prefix of `a` and `b`, on a character boundary.
fn common_prefix_len(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, ca), cb)| ca != cb)
        .map_or(a.len().min(b.len()), |((i, _), _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tests::{load_fixture, FIXTURES};

    /// Feeds `ids` one at a time; checks that every delta is whole UTF-8 without replacement
    /// characters and that the deltas add up to the full decode.
    fn stream(tok: &Arc<Tokenizer>, ids: &[u32]) -> Vec<Delta> {
        let mut detok = Detokenizer::new(tok.clone(), true);
        let mut deltas = Vec::new();
        for &id in ids {
            let d = detok.push(id).unwrap();
            assert!(!d.text.contains('\u{FFFD}'), "{d:?}");
            if !d.text.is_empty() {
                deltas.push(d);
            } else {
                assert!(d.ids.is_empty());
            }
        }
        let last = detok.flush().unwrap();
        if !last.text.is_empty() || !last.ids.is_empty() {
            deltas.push(last);
        }
        let joined: String = deltas.iter().map(|d| d.text.as_str()).collect();
        assert_eq!(joined, tok.decode(ids, true).unwrap());
        let all_ids: Vec<u32> = deltas.iter().flat_map(|d| d.ids.clone()).collect();
        assert_eq!(all_ids, ids);
        deltas
    }

    const TEXTS: [&str; 4] = [
        "Hello, world! How are you today?",
        "Emoji 🎉🐍👨‍👩‍👧 and CJK 日本語の文章です。中文字符",
        "  spaces   and\nnewlines\n\n\tand tabs ",
        "Ünïcödé café — “quotes” ∑∫ 𝔘𝔫𝔦",
    ];

    #[test]
    fn streaming_matches_full_decode_for_every_fixture() {
        for name in FIXTURES {
            let tok = load_fixture(name);
            for text in TEXTS {
                let ids = tok.encode(text, false).unwrap();
                let deltas = stream(&tok, &ids);
                assert!(!deltas.is_empty(), "{name}: {text}");
            }
        }
    }

    #[test]
    fn characters_split_across_tokens_are_held_back() {
        // Byte-level BPE (qwen3, llama3) and SentencePiece byte fallback (gemma3).
        for (name, text) in [("qwen3", "🫠"), ("llama3", "🐍"), ("gemma3", "𝔘")] {
            let tok = load_fixture(name);
            let ids = tok.encode(text, false).unwrap();
            assert!(
                ids.len() > 1,
                "{name}: {text} should take several tokens, got {ids:?}"
            );
            let mut detok = Detokenizer::new(tok.clone(), true);
            for &id in &ids[..ids.len() - 1] {
                assert_eq!(detok.push(id).unwrap(), Delta::default(), "{name}");
            }
            assert_eq!(detok.pending_ids(), &ids[..ids.len() - 1]);
            let d = detok.push(*ids.last().unwrap()).unwrap();
            assert_eq!(d.text, text, "{name}");
            assert_eq!(d.ids, ids);
        }
    }

    #[test]
    fn sentencepiece_spaces_survive_token_by_token() {
        let tok = load_fixture("gemma3");
        let ids = tok.encode("one two  three 日本", false).unwrap();
        let texts: Vec<String> = stream(&tok, &ids).into_iter().map(|d| d.text).collect();
        assert_eq!(texts.concat(), "one two  three 日本");
        assert!(texts.iter().any(|t| t.starts_with(' ')), "{texts:?}");
    }

    #[test]
    fn special_tokens_are_skipped_or_kept() {
        let tok = load_fixture("qwen3");
        let mut ids = tok.encode("Hi", false).unwrap();
        ids.push(tok.token_to_id("<|im_end|>").unwrap());
        let mut skip = Detokenizer::new(tok.clone(), true);
        let mut keep = Detokenizer::new(tok.clone(), false);
        let (mut a, mut b) = (String::new(), String::new());
        for &id in &ids {
            a += &skip.push(id).unwrap().text;
            b += &keep.push(id).unwrap().text;
        }
        a += &skip.flush().unwrap().text;
        b += &keep.flush().unwrap().text;
        assert_eq!(a, "Hi");
        assert_eq!(b, "Hi<|im_end|>");
    }

    #[test]
    fn prior_ids_are_not_emitted_again() {
        for name in FIXTURES {
            let tok = load_fixture(name);
            let ids = tok
                .encode("The quick brown fox jumps over 🦊 the dog", false)
                .unwrap();
            let split = ids.len() / 2;
            let mut detok = Detokenizer::with_prior(tok.clone(), true, &ids[..split]);
            let mut text = String::new();
            for &id in &ids[split..] {
                text += &detok.push(id).unwrap().text;
            }
            text += &detok.flush().unwrap().text;
            let head = tok.decode(&ids[..split], true).unwrap();
            let whole = tok.decode(&ids, true).unwrap();
            assert_eq!(format!("{head}{text}"), whole, "{name}");
        }
    }

    #[test]
    fn incomplete_bytes_at_the_end_are_flushed() {
        let tok = load_fixture("llama3");
        let ids = tok.encode("쀍", false).unwrap();
        assert!(ids.len() > 1, "{ids:?}");
        let mut detok = Detokenizer::new(tok.clone(), true);
        assert_eq!(detok.push(ids[0]).unwrap().text, "");
        let rest = detok.flush().unwrap();
        assert_eq!(rest.ids, vec![ids[0]]);
        assert!(rest.text.contains('\u{FFFD}'), "{rest:?}");
        assert_eq!(common_prefix_len("abc", "abd"), 2);
        assert_eq!(common_prefix_len("ab", "abc"), 2);
    }

    #[test]
    fn long_generations_compact_the_window() {
        let tok = load_fixture("qwen3");
        let text = "word ".repeat(300);
        let ids = tok.encode(&text, false).unwrap();
        let mut detok = Detokenizer::new(tok.clone(), true);
        let mut out = String::new();
        for &id in &ids {
            out += &detok.push(id).unwrap().text;
        }
        out += &detok.flush().unwrap().text;
        assert_eq!(out, text);
        assert!(detok.ids.len() < 80);
    }
}
