//! What rank 0 tells the other ranks before each iteration ([`TurnMessage`]), and how it
//! travels: serialized, then broadcast through the group itself (an `all_sum` to which only
//! rank 0 contributes non-zero values), so no transport between engines exists besides MLX's.
use std::collections::HashMap;

use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde::{Deserialize, Serialize};

use super::Group;
use crate::runtime::sampling_params::SamplingParams;

/// One iteration's decisions, as rank 0 took them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum TurnMessage {
    /// Run an iteration with these inputs.
    Turn {
        /// Requests admitted to the queue, in arrival order (numbered on from the last).
        arrived: Vec<Arrival>,
        /// Numbers of earlier requests whose clients left: their streams close now.
        cancelled: Vec<u64>,
        prefill_speed: Option<f64>,
    },
    /// Rank 0's request channel closed with no work left: the loop ends on every rank.
    Stop,
}

/// A request as the model thread sees it, minus its event channel (each rank has its own).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Arrival {
    pub prompt: Vec<u32>,
    pub sampling: Sampling,
    pub max_tokens: usize,
    pub stop_token_ids: Vec<u32>,
    pub sample_offset: usize,
    pub logprobs: Option<usize>,
}

/// [`SamplingParams`] on the wire; the seed is always set (rank 0 draws one for an unseeded
/// request, so that every rank samples the same tokens).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sampling {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: u64,
}

impl Sampling {
    /// The wire form of `p`, whose seed must be set.
    pub fn new(p: &SamplingParams, seed: u64) -> Self {
        let mut logit_bias: Vec<(u32, f32)> = p.logit_bias.iter().map(|(&k, &v)| (k, v)).collect();
        logit_bias.sort_by_key(|(k, _)| *k);
        Self {
            temperature: p.temperature,
            top_p: p.top_p,
            top_k: p.top_k,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            logit_bias,
            seed,
        }
    }

    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            logit_bias: self.logit_bias.iter().copied().collect::<HashMap<_, _>>(),
            seed: Some(self.seed),
        }
    }
}

impl TurnMessage {
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a turn message always serializes")
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        serde_json::from_slice(bytes)
            .map_err(|e| format!("a turn message from rank 0 is corrupt: {e}"))
    }
}

/// Rank 0's `bytes` on every rank (the others pass `None`): the length, then the bytes, each
/// summed over the group with the other ranks contributing zeros.
pub fn broadcast(group: &Group, bytes: Option<&[u8]>) -> Result<Vec<u8>, Exception> {
    broadcast_announced(group, bytes, || {})
}

/// [`broadcast`], calling `announced` once the length has arrived: until then a rank other
/// than 0 may wait as long as rank 0 has nothing to say; after it, rank 0 is sending.
pub fn broadcast_announced(
    group: &Group,
    bytes: Option<&[u8]>,
    announced: impl FnOnce(),
) -> Result<Vec<u8>, Exception> {
    let len = bytes.map_or(0, <[u8]>::len) as i32;
    let total = group.all_sum(&Array::from_slice(&[len], &[1]))?;
    mlx_rs::transforms::eval([&total])?;
    announced();
    let total = total.as_slice::<i32>()[0];
    if total < 0 {
        return Err(Exception::custom(format!("rank 0 announced {total} bytes")));
    }
    if total == 0 {
        return Ok(Vec::new());
    }
    let mine = match bytes {
        Some(b) => Array::from_slice(b, &[total]),
        None => mlx_rs::ops::zeros::<u8>(&[total])?,
    };
    let summed = group.all_sum(&mine)?;
    mlx_rs::transforms::eval([&summed])?;
    Ok(summed.as_slice::<u8>().to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_turn_reads_back_as_sent_with_the_seed_fixed() {
        let mut p = SamplingParams {
            temperature: 0.7,
            ..Default::default()
        };
        p.logit_bias.insert(5, -1.5);
        let message = TurnMessage::Turn {
            arrived: vec![Arrival {
                prompt: vec![1, 2, 3],
                sampling: Sampling::new(&p, 42),
                max_tokens: 8,
                stop_token_ids: vec![2],
                sample_offset: 1,
                logprobs: Some(3),
            }],
            cancelled: vec![7],
            prefill_speed: Some(123.5),
        };
        let back = TurnMessage::decode(&message.encode()).unwrap();
        assert_eq!(back, message);
        let TurnMessage::Turn { arrived, .. } = back else {
            panic!("a turn")
        };
        let params = arrived[0].sampling.params();
        assert_eq!(params.seed, Some(42));
        assert_eq!(params.logit_bias.get(&5), Some(&-1.5));
        assert_eq!(params.temperature, 0.7);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(TurnMessage::decode(&[0xff; 3]).is_err());
    }
}
