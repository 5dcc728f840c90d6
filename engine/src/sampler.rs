//! Picks the next token from a row of logits, on the CPU.
//!
//! Order of operations, each skipped when neutral:
//! 1. logit bias (added);
//! 2. repetition penalty over every token in `history` (prompt and generated), Hugging Face
//!    semantics: a positive logit is divided by the penalty, a negative one multiplied;
//! 3. presence and frequency penalties over the generated tokens only
//!    (`history[generated_start..]`), OpenAI semantics:
//!    `logit -= presence * [count > 0] + frequency * count`;
//! 4. temperature 0 → argmax (the lowest id among equal maxima);
//! 5. otherwise: temperature scaling, top-k (a partial selection, not a full sort),
//!    top-p (the smallest prefix of the sorted distribution whose mass reaches `top_p`, at
//!    least one token), min-p (tokens below `min_p` times the top probability dropped),
//!    renormalisation and a categorical draw from a seeded ChaCha8 generator.
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::sampling::{SamplingError, SamplingParams};

/// How many candidates top-p sorts first (grown fourfold until the nucleus fits).
const TOP_P_FIRST_CHUNK: usize = 256;

/// Why one sampling step failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SampleError {
    #[error("logits row is empty")]
    EmptyLogits,
    #[error("logit_bias names token {token}, outside the vocabulary of {vocab} logits")]
    BiasOutOfRange { token: u32, vocab: usize },
    #[error("history holds token {token}, outside the vocabulary of {vocab} logits")]
    HistoryOutOfRange { token: u32, vocab: usize },
    #[error("generated_start {start} is past the end of the history ({len} tokens)")]
    GeneratedStart { start: usize, len: usize },
    #[error("logit of token {token} is NaN")]
    NanLogit { token: u32 },
    #[error("every token has a logit of -inf after biases and penalties")]
    NoCandidates,
}

/// A sampler for one sequence: its parameters, its random generator and reusable scratch
/// buffers (so a step allocates nothing once warmed up).
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    candidates: Vec<(f32, u32)>,
    /// Per-token counters for penalties, all zero between calls.
    counts: Vec<u32>,
    touched: Vec<u32>,
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler")
            .field("params", &self.params)
            .finish_non_exhaustive()
    }
}

impl Sampler {
    /// Validates `params` and seeds the generator from `params.seed`, or from the operating
    /// system when there is none.
    pub fn new(params: &SamplingParams) -> Result<Self, SamplingError> {
        params.validate()?;
        let rng = match params.seed {
            Some(seed) => ChaCha8Rng::seed_from_u64(seed),
            None => ChaCha8Rng::from_entropy(),
        };
        Ok(Self {
            params: params.clone(),
            rng,
            candidates: Vec::new(),
            counts: Vec::new(),
            touched: Vec::new(),
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token. `logits` is modified in place (biases, penalties). `history` is
    /// the prompt followed by the tokens generated so far, and `generated_start` the index in
    /// `history` where the generated tokens begin (tokens forced as a continuation count as
    /// generated).
    pub fn sample(
        &mut self,
        logits: &mut [f32],
        history: &[u32],
        generated_start: usize,
    ) -> Result<u32, SampleError> {
        let vocab = logits.len();
        if vocab == 0 {
            return Err(SampleError::EmptyLogits);
        }
        if generated_start > history.len() {
            return Err(SampleError::GeneratedStart {
                start: generated_start,
                len: history.len(),
            });
        }
        for (&token, &bias) in &self.params.logit_bias {
            let slot = logits
                .get_mut(token as usize)
                .ok_or(SampleError::BiasOutOfRange { token, vocab })?;
            *slot += bias;
        }
        self.apply_penalties(logits, history, generated_start)?;
        let best = argmax(logits)?;
        if logits[best] == f32::NEG_INFINITY {
            return Err(SampleError::NoCandidates);
        }
        if self.params.temperature == 0.0 {
            return Ok(best as u32);
        }
        Ok(self.draw(logits))
    }

    fn apply_penalties(
        &mut self,
        logits: &mut [f32],
        history: &[u32],
        generated_start: usize,
    ) -> Result<(), SampleError> {
        let p = &self.params;
        let vocab = logits.len();
        let repetition = p.repetition_penalty != 1.0;
        let additive = p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        if !repetition && !additive {
            return Ok(());
        }
        if self.counts.len() < vocab {
            self.counts.resize(vocab, 0);
        }
        let result = (|| {
            if repetition {
                // Mark each distinct token once.
                for &token in history {
                    let slot = self
                        .counts
                        .get_mut(token as usize)
                        .filter(|_| (token as usize) < vocab)
                        .ok_or(SampleError::HistoryOutOfRange { token, vocab })?;
                    if *slot == 0 {
                        *slot = 1;
                        self.touched.push(token);
                        let l = &mut logits[token as usize];
                        *l = if *l > 0.0 {
                            *l / p.repetition_penalty
                        } else {
                            *l * p.repetition_penalty
                        };
                    }
                }
                for &t in &self.touched {
                    self.counts[t as usize] = 0;
                }
                self.touched.clear();
            }
            if additive {
                for &token in &history[generated_start..] {
                    let slot = self
                        .counts
                        .get_mut(token as usize)
                        .filter(|_| (token as usize) < vocab)
                        .ok_or(SampleError::HistoryOutOfRange { token, vocab })?;
                    if *slot == 0 {
                        self.touched.push(token);
                    }
                    *slot += 1;
                }
                for &t in &self.touched {
                    let count = self.counts[t as usize];
                    logits[t as usize] -= p.presence_penalty + p.frequency_penalty * count as f32;
                }
            }
            Ok(())
        })();
        // Leave the counters zeroed for the next call, whatever happened.
        for &t in &self.touched {
            self.counts[t as usize] = 0;
        }
        self.touched.clear();
        result
    }

    /// Temperature, top-k, top-p, min-p and a categorical draw. The logits hold at least one
    /// value above -inf and no NaN.
    fn draw(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        let inv_t = 1.0 / p.temperature;
        let cands = &mut self.candidates;
        cands.clear();
        cands.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, &l)| l > f32::NEG_INFINITY)
                .map(|(i, &l)| (l * inv_t, i as u32)),
        );
        // Descending by value, ties by ascending id, so results do not depend on input order.
        let desc = |a: &(f32, u32), b: &(f32, u32)| {
            b.0.partial_cmp(&a.0)
                .unwrap_or(std::cmp::Ordering::Equal)
                .then(a.1.cmp(&b.1))
        };
        let k = p.top_k;
        if k > 0 && k < cands.len() {
            cands.select_nth_unstable_by(k - 1, desc);
            cands.truncate(k);
        }
        let max = cands.iter().map(|c| c.0).fold(f32::NEG_INFINITY, f32::max);
        // Unnormalised probabilities, in place of the logits (the top one is exp(0) = 1).
        let mut total = 0.0f64;
        for c in cands.iter_mut() {
            c.0 = (c.0 - max).exp();
            total += c.0 as f64;
        }
        if p.top_p < 1.0 {
            // The nucleus is usually small: sort only the largest `m` candidates, growing `m`
            // until their mass reaches the target, instead of sorting the whole vocabulary.
            let target = p.top_p as f64 * total;
            let mut m = TOP_P_FIRST_CHUNK.min(cands.len());
            loop {
                if m < cands.len() {
                    cands.select_nth_unstable_by(m - 1, desc);
                }
                cands[..m].sort_unstable_by(desc);
                let mut cum = 0.0f64;
                let reached = cands[..m].iter().position(|c| {
                    cum += c.0 as f64;
                    cum >= target
                });
                match reached {
                    Some(i) => {
                        cands.truncate(i + 1);
                        break;
                    }
                    // Rounding kept the sum just under the target: keep everything.
                    None if m == cands.len() => break,
                    None => m = (m * 4).min(cands.len()),
                }
            }
        }
        if p.min_p > 0.0 {
            // The top candidate's weight is exp(0) = 1.
            let floor = p.min_p;
            cands.retain(|c| c.0 >= floor);
        }
        let total: f64 = cands.iter().map(|c| c.0 as f64).sum();
        let mut r = self.rng.gen::<f64>() * total;
        for c in cands.iter() {
            r -= c.0 as f64;
            if r < 0.0 {
                return c.1;
            }
        }
        // Rounding left a sliver of mass: the last candidate with non-zero weight takes it.
        cands
            .iter()
            .rev()
            .find(|c| c.0 > 0.0)
            .map(|c| c.1)
            .expect("the top candidate has weight 1")
    }
}

/// Index of the largest value (the first among equals); a NaN is an error.
fn argmax(values: &[f32]) -> Result<usize, SampleError> {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in values.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        } else if v.is_nan() {
            return Err(SampleError::NanLogit { token: i as u32 });
        }
    }
    Ok(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams {
            seed: Some(7),
            ..SamplingParams::default()
        };
        f(&mut p);
        p
    }

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.5, -1.0, 0.0, 2.9, -5.0, 1.5]
    }

    fn run(p: &SamplingParams, n: usize) -> Vec<u32> {
        let mut s = Sampler::new(p).unwrap();
        (0..n)
            .map(|_| s.sample(&mut logits(), &[], 0).unwrap())
            .collect()
    }

    #[test]
    fn same_seed_same_sequence() {
        let p = params(|p| p.temperature = 1.0);
        let a = run(&p, 50);
        assert_eq!(a, run(&p, 50));
        assert_ne!(
            a,
            run(
                &params(|p| {
                    p.temperature = 1.0;
                    p.seed = Some(8);
                }),
                50
            )
        );
        // Not all the same token at temperature 1.
        assert!(a.iter().any(|&t| t != a[0]));
    }

    #[test]
    fn greedy_and_degenerate_filters_are_argmax() {
        assert!(run(&params(|_| {}), 5).iter().all(|&t| t == 1));
        let top_k1 = params(|p| {
            p.temperature = 1.5;
            p.top_k = 1;
        });
        assert!(run(&top_k1, 100).iter().all(|&t| t == 1));
        let tiny_p = params(|p| {
            p.temperature = 1.5;
            p.top_p = 1e-6;
        });
        assert!(run(&tiny_p, 100).iter().all(|&t| t == 1));
        let min_p1 = params(|p| {
            p.temperature = 1.5;
            p.min_p = 1.0;
        });
        assert!(run(&min_p1, 100).iter().all(|&t| t == 1));
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        // Top 3 are ids 1 (3.0), 5 (2.9), 2 (2.5).
        let k3 = params(|p| {
            p.temperature = 5.0;
            p.top_k = 3;
        });
        let draws = run(&k3, 500);
        assert!(draws.iter().all(|t| [1, 5, 2].contains(t)), "{draws:?}");
        for t in [1, 5, 2] {
            assert!(draws.contains(&t));
        }
        // At temperature 1, ids 1 and 5 hold ~0.35 + ~0.31 of the mass: top_p 0.5 keeps those two.
        let p05 = params(|p| {
            p.temperature = 1.0;
            p.top_p = 0.5;
        });
        let draws = run(&p05, 500);
        assert!(draws.iter().all(|t| [1, 5].contains(t)), "{draws:?}");
        assert!(draws.contains(&5));
    }

    #[test]
    fn distribution_matches_softmax() {
        let l = [0.0f32, (2.0f32).ln(), (3.0f32).ln(), (4.0f32).ln()];
        let mut s = Sampler::new(&params(|p| p.temperature = 1.0)).unwrap();
        let n = 40_000;
        let mut counts = [0usize; 4];
        for _ in 0..n {
            counts[s.sample(&mut l.clone(), &[], 0).unwrap() as usize] += 1;
        }
        for (i, &c) in counts.iter().enumerate() {
            let want = (i + 1) as f64 / 10.0;
            let got = c as f64 / n as f64;
            assert!((got - want).abs() < 0.01, "token {i}: {got} vs {want}");
        }
        // Temperature 0.5 squares the odds: 1:4:9:16.
        let mut s = Sampler::new(&params(|p| p.temperature = 0.5)).unwrap();
        let mut counts = [0usize; 4];
        for _ in 0..n {
            counts[s.sample(&mut l.clone(), &[], 0).unwrap() as usize] += 1;
        }
        let got = counts[3] as f64 / n as f64;
        assert!((got - 16.0 / 30.0).abs() < 0.01, "{got}");
    }

    #[test]
    fn penalties_change_the_choice() {
        // Repetition penalty 2 on token 1 (3.0 → 1.5): token 5 (2.9) wins.
        let mut s = Sampler::new(&params(|p| p.repetition_penalty = 2.0)).unwrap();
        let mut l = logits();
        assert_eq!(s.sample(&mut l, &[1, 1, 4], 3).unwrap(), 5);
        assert_eq!(l[1], 1.5);
        assert_eq!(l[4], 0.0);
        // Negative logits are multiplied.
        let mut l = logits();
        s.sample(&mut l, &[3], 1).unwrap();
        assert_eq!(l[3], -2.0);

        // Presence/frequency count only generated tokens: token 1 in the prompt is untouched.
        let mut s = Sampler::new(&params(|p| {
            p.presence_penalty = 0.5;
            p.frequency_penalty = 0.25;
        }))
        .unwrap();
        let mut l = logits();
        assert_eq!(s.sample(&mut l, &[1, 5, 5], 1).unwrap(), 1);
        assert_eq!(l[5], 2.9 - 0.5 - 0.5);
        assert_eq!(l[1], 3.0);
        let mut l = logits();
        assert_eq!(s.sample(&mut l, &[1, 5, 5], 0).unwrap(), 2);
        assert_eq!(l[1], 3.0 - 0.75);
        // Counters are reset between calls.
        let mut l = logits();
        s.sample(&mut l, &[5], 0).unwrap();
        assert_eq!(l[5], 2.9 - 0.75);
    }

    #[test]
    fn logit_bias_forces_and_bans() {
        let force = params(|p| {
            p.temperature = 1.0;
            p.logit_bias.insert(6, 100.0);
        });
        assert!(run(&force, 50).iter().all(|&t| t == 6));
        let ban = params(|p| {
            p.logit_bias.insert(1, -100.0);
        });
        assert!(run(&ban, 3).iter().all(|&t| t == 5));
    }

    #[test]
    fn errors_name_the_problem() {
        let mut s = Sampler::new(&params(|p| {
            p.logit_bias.insert(99, 1.0);
        }))
        .unwrap();
        assert_eq!(
            s.sample(&mut logits(), &[], 0),
            Err(SampleError::BiasOutOfRange {
                token: 99,
                vocab: 8
            })
        );
        let mut s = Sampler::new(&params(|p| p.repetition_penalty = 1.1)).unwrap();
        assert_eq!(
            s.sample(&mut logits(), &[3, 8], 0),
            Err(SampleError::HistoryOutOfRange { token: 8, vocab: 8 })
        );
        let mut l = logits();
        l[2] = f32::NAN;
        assert_eq!(
            s.sample(&mut l, &[], 0),
            Err(SampleError::NanLogit { token: 2 })
        );
        let mut l = vec![f32::NEG_INFINITY; 4];
        assert_eq!(s.sample(&mut l, &[], 0), Err(SampleError::NoCandidates));
        assert!(s.sample(&mut logits(), &[1], 2).is_err());
        let e = Sampler::new(&params(|p| p.top_p = 0.0)).unwrap_err();
        assert!(e.to_string().contains("top_p is 0"), "{e}");
        let e = Sampler::new(&params(|p| p.temperature = -1.0)).unwrap_err();
        assert!(e.to_string().contains("temperature is -1"), "{e}");
    }

    #[test]
    fn large_vocab_top_k_is_exact() {
        let n = 128_000;
        let l: Vec<f32> = (0..n).map(|i| ((i * 7919) % n) as f32 / n as f32).collect();
        let mut top: Vec<u32> = (0..n as u32).collect();
        top.sort_by(|&a, &b| l[b as usize].partial_cmp(&l[a as usize]).unwrap());
        let top5 = &top[..5];
        let mut s = Sampler::new(&params(|p| {
            p.temperature = 100.0;
            p.top_k = 5;
        }))
        .unwrap();
        for _ in 0..200 {
            let t = s.sample(&mut l.clone(), &[], 0).unwrap();
            assert!(top5.contains(&t));
        }
    }
    #[test]
    fn top_p_beyond_the_first_chunk_matches_a_full_sort() {
        // 3000 nearly flat logits: the 0.5 nucleus holds over a thousand tokens, so the
        // chunked selection has to grow several times.
        let n = 3000;
        let l: Vec<f32> = (0..n).map(|i| ((i * 1777) % n) as f32 / n as f32).collect();
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| l[b].partial_cmp(&l[a]).unwrap());
        let w: Vec<f64> = order.iter().map(|&i| (l[i] as f64 - 1.0).exp()).collect();
        let total: f64 = w.iter().sum();
        let mut cum = 0.0;
        let keep = w.iter().position(|x| {
            cum += x;
            cum >= 0.5 * total
        });
        let nucleus: std::collections::HashSet<u32> = order[..keep.unwrap() + 1]
            .iter()
            .map(|&i| i as u32)
            .collect();
        assert!(nucleus.len() > 1000);
        let mut s = Sampler::new(&params(|p| {
            p.temperature = 1.0;
            p.top_p = 0.5;
        }))
        .unwrap();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..2000 {
            let t = s.sample(&mut l.clone(), &[], 0).unwrap();
            assert!(nucleus.contains(&t), "{t} outside the nucleus");
            seen.insert(t);
        }
        // Draws spread over most of the nucleus (about 1 - e^-1.7 of it for 2000 draws).
        assert!(seen.len() > nucleus.len() * 7 / 10, "{}", seen.len());
    }
}
