//! Sampling parameters, as the HTTP side validates them and the MLX thread applies them.
use std::collections::HashMap;

/// How to pick the next token. The defaults are greedy decoding.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Nucleus sampling; 1.0 disables it.
    pub top_p: f32,
    /// Keep the k most likely tokens; 0 disables it.
    pub top_k: usize,
    /// Drop tokens whose probability is below `min_p` times the top token's; 0 disables it.
    pub min_p: f32,
    /// Multiplicative penalty on tokens already seen (1.0 = off), as in Hugging Face.
    pub repetition_penalty: f32,
    /// Additive penalty on tokens already seen (OpenAI semantics), 0 = off.
    pub presence_penalty: f32,
    /// Additive penalty per occurrence of a token already seen (OpenAI semantics), 0 = off.
    pub frequency_penalty: f32,
    /// Added to the logit of each listed token before sampling.
    pub logit_bias: HashMap<u32, f32>,
    /// Same seed, same prompt, same parameters → same output.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: HashMap::new(),
            seed: None,
        }
    }
}

impl SamplingParams {
    /// True when the next token is simply the argmax of the logits, so the MLX thread can take
    /// it on the device without copying the logits out.
    pub fn is_plain_greedy(&self) -> bool {
        self.temperature == 0.0
            && self.repetition_penalty == 1.0
            && self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
            && self.logit_bias.is_empty()
    }
}

/// A sampling parameter outside its domain.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    #[error("{name} is {value}; it must be {allowed}")]
    OutOfRange {
        name: &'static str,
        value: f32,
        allowed: &'static str,
    },
    #[error("logit_bias for token {token} is {value}; it must be finite")]
    NonFiniteBias { token: u32, value: f32 },
}

impl SamplingParams {
    /// Checks every field against its domain (vocabulary bounds are checked per call by the
    /// sampler, which knows the logits' length).
    pub fn validate(&self) -> Result<(), SamplingError> {
        let check = |name, value: f32, ok: bool, allowed| {
            if ok {
                Ok(())
            } else {
                Err(SamplingError::OutOfRange {
                    name,
                    value,
                    allowed,
                })
            }
        };
        let t = self.temperature;
        check(
            "temperature",
            t,
            t.is_finite() && t >= 0.0,
            "finite and >= 0",
        )?;
        let p = self.top_p;
        check("top_p", p, p > 0.0 && p <= 1.0, "in (0, 1]")?;
        let m = self.min_p;
        check("min_p", m, (0.0..=1.0).contains(&m), "in [0, 1]")?;
        let r = self.repetition_penalty;
        check(
            "repetition_penalty",
            r,
            r.is_finite() && r > 0.0,
            "finite and > 0",
        )?;
        let pp = self.presence_penalty;
        check("presence_penalty", pp, pp.is_finite(), "finite")?;
        let fp = self.frequency_penalty;
        check("frequency_penalty", fp, fp.is_finite(), "finite")?;
        for (&token, &value) in &self.logit_bias {
            if !value.is_finite() {
                return Err(SamplingError::NonFiniteBias { token, value });
            }
        }
        Ok(())
    }
}
