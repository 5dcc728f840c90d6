//! Constrained decoding: a per-sequence object that says which token ids may come next.
//!
//! The MLX thread holds one [`TokenConstraint`] per constrained sequence. Before each decode
//! step it asks every constrained row for its allowed set ([`TokenConstraint::mask`]) and adds
//! the rows as a `[B, vocab]` mask (0 allowed, −∞ not) to the logits before the draw; after
//! the step it hands each row its chosen token ([`TokenConstraint::commit`]). Building the mask
//! for step t+1 needs token t on the host, so a batch with a constrained row runs its steps
//! synchronously; batches without one keep the pipelined path (see `runtime/batch.rs`).
//!
//! [`grammar`] implements the trait with llguidance, compiled from a JSON schema or a Lark
//! grammar (structured output, forced tool calls).
pub mod grammar;

/// A constraint failed to advance or to compute its mask: the grammar engine's own error, a
/// bug on our side (the token was drawn from its mask).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("constrained decoding failed: {0}")]
pub struct ConstraintError(pub String);

/// Which tokens one sequence may generate next.
pub trait TokenConstraint: Send + Sync + std::fmt::Debug {
    /// Writes the additive mask of the next token into `row` (one entry per vocabulary id of
    /// the model): `0.0` where the token is allowed, `f32::NEG_INFINITY` where it is not.
    /// `row` arrives filled with zeros.
    fn mask(&mut self, row: &mut [f32]) -> Result<(), ConstraintError>;

    /// Advances past `token`, the one drawn from the last mask. Returns `true` when the
    /// constraint is complete and nothing may follow (the sequence ends there).
    fn commit(&mut self, token: u32) -> Result<bool, ConstraintError>;
}

/// Tokens from a fixed list, in order, then the end: the smallest constraint, for runtime
/// tests that need no tokenizer or grammar.
#[derive(Debug, Clone)]
pub struct ForcedTokens {
    tokens: Vec<u32>,
    next: usize,
}

impl ForcedTokens {
    pub fn new(tokens: Vec<u32>) -> Self {
        Self { tokens, next: 0 }
    }
}

impl TokenConstraint for ForcedTokens {
    fn mask(&mut self, row: &mut [f32]) -> Result<(), ConstraintError> {
        let Some(&want) = self.tokens.get(self.next) else {
            return Err(ConstraintError("no token may follow".into()));
        };
        row.fill(f32::NEG_INFINITY);
        match row.get_mut(want as usize) {
            Some(slot) => *slot = 0.0,
            None => return Err(ConstraintError(format!("token {want} is outside the mask"))),
        }
        Ok(())
    }

    fn commit(&mut self, token: u32) -> Result<bool, ConstraintError> {
        if self.tokens.get(self.next) != Some(&token) {
            return Err(ConstraintError(format!(
                "token {token} was not allowed (expected {:?})",
                self.tokens.get(self.next)
            )));
        }
        self.next += 1;
        Ok(self.next == self.tokens.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forced_tokens_allow_one_id_then_end() {
        let mut c = ForcedTokens::new(vec![2, 0]);
        let mut row = vec![0.0; 3];
        c.mask(&mut row).unwrap();
        assert_eq!(row, vec![f32::NEG_INFINITY, f32::NEG_INFINITY, 0.0]);
        assert!(!c.commit(2).unwrap());
        assert!(c.commit(1).is_err());
        assert!(c.commit(0).unwrap());
        assert!(c.mask(&mut row).is_err());
    }
}
