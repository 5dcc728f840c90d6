//! The serial reference path: one sequence, dense caches, greedy, in exactly the order of
//! mlx-lm's `generate_step` (prefill all but the last prompt token in chunks, evaluating only
//! the cache; then one token at a time, one step ahead with `async_eval`, argmax of
//! `logits - logsumexp`). Parity tests compare it with mlx-lm, and the batched runtime with it.
use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_rs::Array;

use super::PREFILL_CHUNK;
use crate::cache::LayerCache;
use crate::models::CausalLm;

/// Greedy generation of up to `max_tokens` tokens, stopping after any of `stop_ids`.
pub fn greedy(
    model: &dyn CausalLm,
    prompt: &[u32],
    max_tokens: usize,
    stop_ids: &[u32],
) -> Result<Vec<u32>, Exception> {
    assert!(!prompt.is_empty(), "a prompt needs at least one token");
    let mut caches = model.new_dense_caches();
    let mut done = 0;
    while done + 1 < prompt.len() {
        let n = (prompt.len() - 1 - done).min(PREFILL_CHUNK);
        let input = Array::from_slice(&prompt[done..done + n], &[1, n as i32]);
        let _ = model.forward(&input, &mut caches)?;
        mlx_rs::transforms::eval(caches.iter().flat_map(LayerCache::state))?;
        done += n;
    }
    let step = |caches: &mut Vec<LayerCache>, input: &Array| -> Result<Array, Exception> {
        let logits = model.forward(&input.reshape(&[1, 1])?, caches)?;
        let logits = logits.index((.., -1, ..));
        let logprobs = logits.subtract(logits.logsumexp_axis(-1, true)?)?;
        let token = argmax_axis(&logprobs, -1, None)?;
        mlx_rs::transforms::async_eval([&token])?;
        Ok(token)
    };
    let mut out = Vec::new();
    let mut current = step(
        &mut caches,
        &Array::from_slice(&prompt[prompt.len() - 1..], &[1]),
    )?;
    while out.len() < max_tokens {
        let next = if out.len() + 1 < max_tokens {
            Some(step(&mut caches, &current)?)
        } else {
            None
        };
        current.eval()?;
        let token = current.item_exact::<u32>();
        out.push(token);
        if stop_ids.contains(&token) {
            break;
        }
        match next {
            Some(n) => current = n,
            None => break,
        }
    }
    Ok(out)
}
