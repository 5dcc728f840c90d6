//! Picks the next token of every row of a batch on the device, each row with its own
//! parameters. Nothing is copied to the host but the chosen token ids.
//!
//! Order of operations, each skipped for the whole batch when no row uses it:
//! 1. log-probabilities, `logits - logsumexp(logits)` in the model's dtype (as mlx-lm does, so
//!    greedy rows pick exactly mlx-lm's token), then float32;
//! 2. logit bias (added);
//! 3. repetition penalty over every token seen (prompt and generated), Hugging Face semantics:
//!    a positive logit is divided by the penalty, a negative one multiplied;
//! 4. presence and frequency penalties over the generated tokens, OpenAI semantics:
//!    `logit -= presence * [count > 0] + frequency * count`;
//! 5. temperature 0: argmax (the lowest id among equal maxima);
//! 6. otherwise temperature scaling, then top-k, top-p (over the top-k distribution: the
//!    smallest prefix of the sorted distribution whose mass reaches `top_p`, at least one
//!    token) and min-p (tokens below `min_p` times the top probability) as one threshold per
//!    row (tokens tied with the threshold are kept), and a Gumbel-max draw with
//!    [`noise`](super::noise) keyed by (seed, index of the generated token).
//!
//! The per-row state that spans steps (bias rows, seen tokens, generated counts) lives here
//! as `[B, vocab]` arrays, kept in the same row order as the batch's KV cache, and the per-row
//! parameters as one `[B, 8]` matrix; all of them change only when rows join or leave. A step
//! is one compiled graph ([`fused`]) per set of transforms in use, so it uploads nothing and
//! runs as a few fused kernels.
use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::take_along_axis;
#[cfg(test)]
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{argpartition_axis, concatenate, maximum, zeros_dtype};
use mlx_rs::{Array, Dtype};

use super::sampling_params::SamplingParams;

mod fused;

use fused::{column, Transforms};

/// What the sampler needs to know about one row when it joins.
pub struct RowSampling<'a> {
    pub params: &'a SamplingParams,
    pub seed: u64,
    /// Prompt tokens (for the repetition penalty).
    pub prompt: &'a [u32],
    /// Tokens the row generated before it joins (its first, sampled from its prompt's last
    /// prefill pass): seen by the repetition penalty and counted by the presence and
    /// frequency penalties, exactly as if this sampler had sampled them.
    pub generated: &'a [u32],
    /// Index of this row's next generated token in its random stream.
    pub next_step: u64,
    /// Alternatives to report with each token's log-probability (`None`: no log-probabilities).
    pub logprobs: Option<usize>,
}

struct Row {
    params: SamplingParams,
    logprobs: Option<usize>,
}

/// The log-probabilities of the tokens the last pick chose, on the device, for every position
/// (rows that did not ask included; the batch reads the rows that did).
pub struct PickedLogprobs {
    /// `[N]` float32: each chosen token's log-probability.
    pub chosen: Array,
    /// `[N, k]` uint32 ids and float32 log-probabilities of the `k` most likely tokens, in no
    /// particular order; `None` when no row asked for alternatives.
    pub top: Option<(Array, Array)>,
}

impl PickedLogprobs {
    pub fn arrays(&self) -> Vec<&Array> {
        let mut all = vec![&self.chosen];
        if let Some((ids, values)) = &self.top {
            all.push(ids);
            all.push(values);
        }
        all
    }

    /// Position `i`'s log-probabilities with its `want` best alternatives, most likely first,
    /// once evaluated.
    pub fn at(
        &self,
        i: usize,
        want: usize,
    ) -> Result<crate::runtime::request::TokenLogprobs, Exception> {
        let read = |e| Exception::custom(format!("reading log-probabilities: {e:?}"));
        let chosen: &[f32] = self.chosen.try_as_slice().map_err(read)?;
        let mut top = Vec::new();
        if let Some((ids, values)) = &self.top {
            let k = ids.shape()[1] as usize;
            let ids: &[u32] = ids.try_as_slice().map_err(read)?;
            let values: &[f32] = values.try_as_slice().map_err(read)?;
            top = ids[i * k..(i + 1) * k]
                .iter()
                .copied()
                .zip(values[i * k..(i + 1) * k].iter().copied())
                .collect();
            top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            top.truncate(want);
        }
        Ok(crate::runtime::request::TokenLogprobs {
            logprob: chosen[i],
            top,
        })
    }
}

/// Rows' sampling state, in batch order.
pub struct BatchSampler {
    vocab: i32,
    rows: Vec<Row>,
    /// `[B, vocab]` added to the logits; only while some row has a bias.
    bias: Option<Array>,
    /// `[B, vocab]`, 1.0 where a token was seen (prompt or generated); only while some row
    /// has a repetition penalty.
    seen: Option<Array>,
    /// `[B, vocab]` generated-token counts; only while some row has a presence or frequency
    /// penalty.
    counts: Option<Array>,
    /// `[B, 1]` u32 halves of each row's seed and the index of its next generated token, on
    /// the device: the noise keys derive from them there, so a step uploads nothing.
    seed_lo: Option<Array>,
    seed_hi: Option<Array>,
    steps: Option<Array>,
    /// `[B, vocab]` additive mask (0 allowed, −∞ not) for the next `sample` only, set by the
    /// batch while some row is constrained.
    mask: Option<Array>,
    /// `[B, column::COUNT]` float32 parameters, built once per batch membership.
    params: Option<Array>,
    /// `[1, vocab]` u32 vocabulary ids, for the noise, top-k ranks and one-hot updates.
    ids: Array,
    /// Steps run through the compiled graphs (tests also run them op by op).
    compiled: bool,
    /// The last pick's log-probabilities, while some row wants them.
    picked: Option<PickedLogprobs>,
}

impl BatchSampler {
    pub fn new(vocab: usize) -> Self {
        Self {
            vocab: vocab as i32,
            rows: Vec::new(),
            bias: None,
            seen: None,
            counts: None,
            seed_lo: None,
            seed_hi: None,
            steps: None,
            mask: None,
            params: None,
            ids: Array::arange::<_, u32>(None, vocab as u32, None)
                .and_then(|a| a.reshape(&[1, vocab as i32]))
                .expect("a 1-D arange reshaped to one row"),
            compiled: true,
            picked: None,
        }
    }

    pub fn vocab(&self) -> usize {
        self.vocab as usize
    }

    /// Appends rows after the current ones.
    pub fn extend(&mut self, joining: &[RowSampling<'_>]) -> Result<(), Exception> {
        if joining.is_empty() {
            return Ok(());
        }
        let old = self.rows.len() as i32;
        let v = self.vocab as usize;
        let wants_bias = joining.iter().any(|r| !r.params.logit_bias.is_empty());
        if self.bias.is_some() || wants_bias {
            let rows: Vec<f32> = joining
                .iter()
                .flat_map(|r| {
                    let mut row = vec![0.0f32; v];
                    for (&token, &bias) in &r.params.logit_bias {
                        if let Some(slot) = row.get_mut(token as usize) {
                            *slot = bias;
                        }
                    }
                    row
                })
                .collect();
            self.bias = Some(append_rows(self.bias.take(), old, self.vocab, &rows)?);
        }
        let wants_seen = joining.iter().any(|r| r.params.repetition_penalty != 1.0);
        if self.seen.is_some() || wants_seen {
            let rows: Vec<f32> = joining
                .iter()
                .flat_map(|r| {
                    let mut row = vec![0.0f32; v];
                    for &t in r.prompt.iter().chain(r.generated) {
                        if let Some(slot) = row.get_mut(t as usize) {
                            *slot = 1.0;
                        }
                    }
                    row
                })
                .collect();
            self.seen = Some(append_rows(self.seen.take(), old, self.vocab, &rows)?);
        }
        let wants_counts = joining
            .iter()
            .any(|r| r.params.presence_penalty != 0.0 || r.params.frequency_penalty != 0.0);
        if self.counts.is_some() || wants_counts {
            let rows: Vec<f32> = joining
                .iter()
                .flat_map(|r| {
                    let mut row = vec![0.0f32; v];
                    for &t in r.generated {
                        if let Some(slot) = row.get_mut(t as usize) {
                            *slot += 1.0;
                        }
                    }
                    row
                })
                .collect();
            self.counts = Some(append_rows(self.counts.take(), old, self.vocab, &rows)?);
        }
        let column = |f: &dyn Fn(&RowSampling<'_>) -> u32| {
            let values: Vec<u32> = joining.iter().map(f).collect();
            Array::from_slice(&values, &[values.len() as i32, 1])
        };
        let append = |old: Option<Array>, new: Array| -> Result<Array, Exception> {
            match old {
                Some(o) => concatenate(&[o, new], 0),
                None => Ok(new),
            }
        };
        self.seed_lo = Some(append(self.seed_lo.take(), column(&|r| r.seed as u32))?);
        self.seed_hi = Some(append(
            self.seed_hi.take(),
            column(&|r| (r.seed >> 32) as u32),
        )?);
        self.steps = Some(append(self.steps.take(), column(&|r| r.next_step as u32))?);
        self.picked = None;
        self.rows.extend(joining.iter().map(|r| Row {
            params: r.params.clone(),
            logprobs: r.logprobs,
        }));
        self.params = self.build_params();
        Ok(())
    }

    /// Keeps rows `keep`, in that order.
    pub fn filter(&mut self, keep: &[usize]) -> Result<(), Exception> {
        if keep.len() == self.rows.len() && keep.iter().enumerate().all(|(i, &r)| i == r) {
            return Ok(());
        }
        let idx = Array::from_slice(
            &keep.iter().map(|&r| r as i32).collect::<Vec<_>>(),
            &[keep.len() as i32],
        );
        for state in [
            &mut self.bias,
            &mut self.seen,
            &mut self.counts,
            &mut self.seed_lo,
            &mut self.seed_hi,
            &mut self.steps,
        ] {
            *state = state.take().map(|s| s.take_axis(&idx, 0)).transpose()?;
        }
        self.picked = None;
        let mut rows: Vec<Option<Row>> = std::mem::take(&mut self.rows)
            .into_iter()
            .map(Some)
            .collect();
        self.rows = keep
            .iter()
            .map(|&r| rows[r].take().expect("each row is kept at most once"))
            .collect();
        if self.rows.iter().all(|r| r.params.logit_bias.is_empty()) {
            self.bias = None;
        }
        if self.rows.iter().all(|r| r.params.repetition_penalty == 1.0) {
            self.seen = None;
        }
        if self
            .rows
            .iter()
            .all(|r| r.params.presence_penalty == 0.0 && r.params.frequency_penalty == 0.0)
        {
            self.counts = None;
        }
        self.params = self.build_params();
        Ok(())
    }

    /// The `[B, column::COUNT]` parameter matrix of the current rows (`None` without rows).
    fn build_params(&self) -> Option<Array> {
        if self.rows.is_empty() {
            return None;
        }
        let v = self.vocab;
        let mut values = Vec::with_capacity(self.rows.len() * column::COUNT as usize);
        for r in &self.rows {
            let p = &r.params;
            let mut row = [0.0f32; column::COUNT as usize];
            row[column::REPETITION as usize] = p.repetition_penalty;
            row[column::PRESENCE as usize] = p.presence_penalty;
            row[column::FREQUENCY as usize] = p.frequency_penalty;
            row[column::TEMPERATURE as usize] = if p.temperature == 0.0 {
                1.0
            } else {
                p.temperature
            };
            row[column::TOP_K_LAST as usize] = match p.top_k {
                0 => v - 1,
                k => (k.min(v as usize) as i32) - 1,
            } as f32;
            row[column::TOP_P as usize] = p.top_p;
            row[column::LOG_MIN_P as usize] = if p.min_p > 0.0 {
                p.min_p.ln()
            } else {
                f32::NEG_INFINITY
            };
            row[column::GREEDY as usize] = if p.temperature == 0.0 { 1.0 } else { 0.0 };
            values.extend_from_slice(&row);
        }
        Some(Array::from_slice(
            &values,
            &[self.rows.len() as i32, column::COUNT],
        ))
    }

    /// Restricts the next [`sample`](Self::sample) to the tokens `mask` (`[B, vocab]`, 0
    /// allowed, −∞ not; rows without a constraint all 0) allows.
    pub fn set_mask(&mut self, mask: Array) {
        self.mask = Some(mask);
    }

    /// Chooses one token per row from `logits` `[B, vocab]` (lazily: nothing is evaluated) and
    /// records it in the rows' penalty state.
    pub fn sample(&mut self, logits: &Array) -> Result<Array, Exception> {
        let mask = self.mask.take();
        self.pick(logits, true, mask.as_ref())
    }

    /// The token each row would take at each of `L` positions, from `logits` `[B, L, vocab]`:
    /// `[B, L]`, position `i` of a row drawn as its generated token `next + i` (speculative
    /// verification: position `i` counts only if the `i` drafts before it are accepted).
    /// Nothing is recorded; [`Self::advance`] does once the accepted tokens are known. The
    /// penalty state is the same at every position, so rows with penalties must be given no
    /// drafts (only their position 0 counts).
    pub fn sample_positions(&mut self, logits: &Array) -> Result<Array, Exception> {
        let s = logits.shape();
        let (b, l, v) = (s[0], s[1], s[2]);
        let mask = self.mask.take();
        let tokens = self.pick(&logits.reshape(&[b * l, v])?, false, mask.as_ref())?;
        tokens.reshape(&[b, l])
    }

    /// After verification: row `r` generated `advanced[r]` tokens, the last of them `last[r]`
    /// (`[B]` u32), which enters the penalty state (the only token of a row with penalties).
    pub fn advance(&mut self, advanced: &[u32], last: &Array) -> Result<(), Exception> {
        if let Some(steps) = &self.steps {
            let by = Array::from_slice(advanced, &[advanced.len() as i32, 1]);
            self.steps = Some(steps.add(&by)?);
        }
        self.record(last)
    }

    /// Whether row `r` may be given drafts: its sampling state is position-independent, and it
    /// reports no log-probabilities (read at position 0 only).
    pub fn row_takes_drafts(&self, r: usize) -> bool {
        let row = &self.rows[r];
        let p = &row.params;
        p.repetition_penalty == 1.0
            && p.presence_penalty == 0.0
            && p.frequency_penalty == 0.0
            && row.logprobs.is_none()
    }

    /// How many rows sample (temperature above 0).
    pub fn sampled_rows(&self) -> usize {
        self.rows
            .iter()
            .filter(|r| r.params.temperature != 0.0)
            .count()
    }

    /// Whether some row reports log-probabilities (its batch then steps synchronously).
    pub fn wants_logprobs(&self) -> bool {
        self.rows.iter().any(|r| r.logprobs.is_some())
    }

    /// The log-probabilities of the last [`sample`](Self::sample) or
    /// [`sample_positions`](Self::sample_positions), lazily, when some row wants them.
    pub fn take_logprobs(&mut self) -> Option<PickedLogprobs> {
        self.picked.take()
    }

    /// Adds `tokens` (`[B]`, one per row) to the rows' seen tokens and counts.
    fn record(&mut self, tokens: &Array) -> Result<(), Exception> {
        if self.seen.is_none() && self.counts.is_none() {
            return Ok(());
        }
        let b = self.rows.len() as i32;
        let one_hot = Array::arange::<_, u32>(None, self.vocab as u32, None)?
            .reshape(&[1, self.vocab])?
            .eq(tokens.reshape(&[b, 1])?)?
            .as_dtype(Dtype::Float32)?;
        if let Some(seen) = &self.seen {
            self.seen = Some(maximum(seen, &one_hot)?);
        }
        if let Some(counts) = &self.counts {
            self.counts = Some(counts.add(&one_hot)?);
        }
        Ok(())
    }

    /// One token per row of `logits` `[B × l, vocab]`, where each batch row has `l`
    /// consecutive rows (positions) and position `i` draws as generated token `next + i`.
    /// `mask` (`[B, vocab]`, additive) applies to every position of its row. With `advance`
    /// (`l` = 1), the rows' noise counters, seen tokens and counts move past the tokens.
    fn pick(
        &mut self,
        logits: &Array,
        advance: bool,
        mask: Option<&Array>,
    ) -> Result<Array, Exception> {
        let (Some(params), Some(seed_lo), Some(seed_hi), Some(steps)) =
            (&self.params, &self.seed_lo, &self.seed_hi, &self.steps)
        else {
            return Err(Exception::custom("the sampler has no rows to sample"));
        };
        let rows = || self.rows.iter().map(|r| &r.params);
        let t = Transforms {
            bias: self.bias.is_some(),
            repetition: self.seen.is_some(),
            counts: self.counts.is_some(),
            mask: mask.is_some(),
            any_greedy: rows().any(|p| p.temperature == 0.0),
            any_sampled: rows().any(|p| p.temperature != 0.0),
            top_k: rows().any(|p| p.top_k > 0),
            top_p: rows().any(|p| p.top_p < 1.0),
            min_p: rows().any(|p| p.min_p > 0.0),
            advance,
            raw: self.wants_logprobs(),
        };
        let inputs = fused::Inputs {
            logits,
            ids: &self.ids,
            params,
            seed_lo,
            seed_hi,
            steps,
            bias: self.bias.as_ref(),
            seen: self.seen.as_ref(),
            counts: self.counts.as_ref(),
            mask,
        };
        let out = fused::run(t, &inputs, self.compiled)?;
        if let Some(steps) = out.steps {
            self.steps = Some(steps);
        }
        if let Some(seen) = out.seen {
            self.seen = Some(seen);
        }
        if let Some(counts) = out.counts {
            self.counts = Some(counts);
        }
        self.picked = match &out.raw {
            Some(raw) => self.logprobs_of(raw, &out.tokens)?,
            None => None,
        };
        Ok(out.tokens)
    }

    /// The chosen tokens' log-probabilities under `raw` (`[N, vocab]` float32) and the most
    /// likely alternatives, when some row wants them.
    fn logprobs_of(
        &self,
        raw: &Array,
        tokens: &Array,
    ) -> Result<Option<PickedLogprobs>, Exception> {
        let Some(k) = self.rows.iter().filter_map(|r| r.logprobs).max() else {
            return Ok(None);
        };
        let n = tokens.shape()[0];
        let chosen = take_along_axis(raw, tokens.as_dtype(Dtype::Int32)?.reshape(&[n, 1])?, -1)?
            .reshape(&[n])?
            .contiguous()?;
        let k = (k as i32).min(self.vocab);
        let top = if k == 0 {
            None
        } else {
            let order = argpartition_axis(raw.negative()?, k - 1, -1)?;
            let ids = order
                .take_axis(Array::arange::<_, i32>(None, k, None)?, -1)?
                .contiguous()?;
            let values = take_along_axis(raw, &ids, -1)?.contiguous()?;
            Some((ids.as_dtype(Dtype::Uint32)?, values))
        };
        Ok(Some(PickedLogprobs { chosen, top }))
    }

    /// The arrays the next step reads besides the tokens (to evaluate with them).
    pub fn state(&self) -> Vec<&Array> {
        self.bias
            .iter()
            .chain(self.seen.iter())
            .chain(self.counts.iter())
            .chain(self.steps.iter())
            .collect()
    }
}

/// `old` (`[n, vocab]`, or zeros when absent) followed by `rows` (row-major host values).
fn append_rows(old: Option<Array>, n: i32, vocab: i32, rows: &[f32]) -> Result<Array, Exception> {
    let added = Array::from_slice(rows, &[rows.len() as i32 / vocab, vocab]);
    let old = match old {
        Some(o) => o,
        None if n == 0 => return Ok(added),
        None => zeros_dtype(&[n, vocab], Dtype::Float32)?,
    };
    concatenate(&[old, added], 0)
}

/// The first `n` columns of a `[B, vocab]` array (test helper).
#[cfg(test)]
fn row_values(a: &Array, row: i32) -> Vec<f32> {
    a.index(row).as_slice::<f32>().to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams::default();
        f(&mut p);
        p
    }

    fn sampler(rows: &[(SamplingParams, u64)], prompt: &[u32], vocab: usize) -> BatchSampler {
        let mut s = BatchSampler::new(vocab);
        let joining: Vec<RowSampling> = rows
            .iter()
            .map(|(p, seed)| RowSampling {
                params: p,
                seed: *seed,
                prompt,
                generated: &[],
                next_step: 0,
                logprobs: None,
            })
            .collect();
        s.extend(&joining).unwrap();
        s
    }

    fn tokens(a: &Array) -> Vec<u32> {
        a.as_slice::<u32>().to_vec()
    }

    fn logits(rows: &[&[f32]]) -> Array {
        let v = rows[0].len() as i32;
        let flat: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        Array::from_slice(&flat, &[rows.len() as i32, v])
    }

    #[test]
    fn greedy_rows_take_the_argmax_lowest_id_on_ties() {
        let mut s = sampler(&[(params(|_| {}), 0), (params(|_| {}), 0)], &[], 4);
        let t = s
            .sample(&logits(&[&[0.0, 3.0, 1.0, 3.0], &[5.0, 0.0, 0.0, 0.0]]))
            .unwrap();
        assert_eq!(tokens(&t), vec![1, 0]);
    }

    #[test]
    fn truncation_to_one_token_is_greedy() {
        let rows = [
            (params(|p| (p.temperature, p.top_k) = (1.0, 1)), 1),
            (params(|p| (p.temperature, p.top_p) = (1.0, 0.01)), 2),
            (params(|p| (p.temperature, p.min_p) = (1.0, 1.0)), 3),
        ];
        let row: &[f32] = &[0.0, 0.5, 2.0, 1.0];
        for step in 0..20 {
            let mut s = sampler(&rows, &[], 4);
            let b = s.rows.len() as i32;
            s.steps = Some(Array::from_slice(&vec![step as u32; b as usize], &[b, 1]));
            assert_eq!(
                tokens(&s.sample(&logits(&[row, row, row])).unwrap()),
                [2, 2, 2]
            );
        }
    }

    #[test]
    fn sampling_follows_the_distribution() {
        // p = softmax([0, ln 3]) = [0.25, 0.75]
        let p = params(|p| p.temperature = 1.0);
        let mut s = sampler(&[(p, 99)], &[], 2);
        let row: &[f32] = &[0.0, 3f32.ln()];
        let mut ones = 0;
        let n = 2000;
        for _ in 0..n {
            ones += tokens(&s.sample(&logits(&[row])).unwrap())[0];
        }
        let share = ones as f32 / n as f32;
        assert!((share - 0.75).abs() < 0.04, "share of token 1: {share}");
    }

    #[test]
    fn top_k_keeps_only_the_k_best() {
        let p = params(|p| (p.temperature, p.top_k) = (5.0, 2));
        let mut s = sampler(&[(p, 5)], &[], 4);
        let row: &[f32] = &[1.0, 1.1, 0.9, 1.2];
        for _ in 0..200 {
            let t = tokens(&s.sample(&logits(&[row])).unwrap())[0];
            assert!(t == 1 || t == 3, "token {t} is outside the top 2");
        }
    }

    #[test]
    fn seeded_rows_draw_the_same_alone_and_in_any_batch() {
        let p = params(|p| p.temperature = 1.0);
        let row: &[f32] = &[0.1, 0.2, 0.3, 0.4, 0.5, 0.6];
        let mut alone = sampler(&[(p.clone(), 7)], &[], 6);
        let mut batch = sampler(&[(p.clone(), 1), (p.clone(), 7), (p, 3)], &[], 6);
        for _ in 0..30 {
            let a = tokens(&alone.sample(&logits(&[row])).unwrap())[0];
            let b = tokens(&batch.sample(&logits(&[row, row, row])).unwrap())[1];
            assert_eq!(a, b);
        }
    }

    #[test]
    fn bias_and_penalties_move_the_choice() {
        let bias = params(|p| {
            p.logit_bias.insert(0, 10.0);
        });
        let repetition = params(|p| p.repetition_penalty = 4.0);
        let presence = params(|p| p.presence_penalty = 5.0);
        let mut s = sampler(&[(bias, 0), (repetition, 0), (presence, 0)], &[2], 3);
        let row: &[f32] = &[0.0, 1.0, 2.0];
        // Row 0: biased to 0. Row 1: token 2 was in the prompt, 2/4 < 1 so 1 wins. Row 2: no
        // generated tokens yet, 2 wins.
        let t = tokens(&s.sample(&logits(&[row, row, row])).unwrap());
        assert_eq!(t, vec![0, 1, 2]);
        // Row 2 generated token 2: its presence penalty now makes 1 win.
        let t = tokens(&s.sample(&logits(&[row, row, row])).unwrap());
        assert_eq!(t[2], 1);
        // Filtering keeps each row's state with its row.
        s.filter(&[2]).unwrap();
        assert!(s.bias.is_none() && s.seen.is_none());
        let counts = row_values(s.counts.as_ref().unwrap(), 0);
        assert_eq!(counts, vec![0.0, 1.0, 1.0]);
    }

    #[test]
    fn logprobs_are_the_models_before_bias_with_the_best_alternatives() {
        // p = softmax([0, ln 3, ln 6]) = [0.1, 0.3, 0.6]; the bias moves the choice to 0, but
        // the reported values stay the model's.
        let biased = params(|p| {
            p.logit_bias.insert(0, 50.0);
        });
        let mut s = BatchSampler::new(3);
        let rows = [
            (params(|_| {}), Some(2)),
            (biased, Some(0)),
            (params(|_| {}), None),
        ];
        let joining: Vec<RowSampling> = rows
            .iter()
            .map(|(p, lp)| RowSampling {
                params: p,
                seed: 0,
                prompt: &[],
                generated: &[],
                next_step: 0,
                logprobs: *lp,
            })
            .collect();
        s.extend(&joining).unwrap();
        assert!(s.wants_logprobs() && !s.row_takes_drafts(0) && s.row_takes_drafts(2));
        let row: &[f32] = &[0.0, 3f32.ln(), 6f32.ln()];
        let t = tokens(&s.sample(&logits(&[row, row, row])).unwrap());
        assert_eq!(t, vec![2, 0, 2]);
        let lp = s.take_logprobs().expect("rows asked");
        mlx_rs::transforms::eval(lp.arrays()).unwrap();
        let greedy = lp.at(0, 2).unwrap();
        assert!((greedy.logprob - 0.6f32.ln()).abs() < 1e-5, "{greedy:?}");
        assert_eq!(
            greedy.top.iter().map(|t| t.0).collect::<Vec<_>>(),
            vec![2, 1]
        );
        assert!((greedy.top[1].1 - 0.3f32.ln()).abs() < 1e-5);
        let forced = lp.at(1, 0).unwrap();
        assert!((forced.logprob - 0.1f32.ln()).abs() < 1e-5, "{forced:?}");
        assert!(forced.top.is_empty());
        // Nothing is kept for the next step unless it asks again.
        s.filter(&[2]).unwrap();
        s.sample(&logits(&[row])).unwrap();
        assert!(s.take_logprobs().is_none());
    }
}

/// The tokens of a fixed set of seeded configurations, recorded from the op-by-op sampler
/// that the fused one replaced: seeded output must not change across that change.
#[cfg(test)]
mod snapshot {
    use super::*;

    /// Deterministic pseudo-random logits in [-1.5, 1.5) for `rows × vocab`, step `step`.
    fn logits(rows: i32, vocab: i32, step: u32, dtype: Dtype) -> Array {
        let mut x = 0x1234_5678u32 ^ step.wrapping_mul(0x9E37_79B1);
        let values: Vec<f32> = (0..rows * vocab)
            .map(|_| {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                ((x >> 8) as f32 / 16_777_216.0) * 3.0 - 1.5
            })
            .collect();
        Array::from_slice(&values, &[rows, vocab])
            .as_dtype(dtype)
            .unwrap()
    }

    fn with(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams::default();
        f(&mut p);
        p
    }

    /// Row configurations covering every transform, alone and mixed.
    pub(super) fn configurations() -> Vec<Vec<SamplingParams>> {
        let mut biased = with(|p| p.temperature = 0.8);
        biased.logit_bias.insert(3, 2.5);
        biased.logit_bias.insert(40, -1.0);
        vec![
            vec![with(|p| p.temperature = 0.7)],
            vec![with(|p| p.temperature = 1.3); 3],
            vec![with(|p| (p.temperature, p.top_k) = (1.1, 5)), with(|_| {})],
            vec![with(|p| (p.temperature, p.top_p) = (0.9, 0.8))],
            vec![with(|p| (p.temperature, p.min_p) = (1.0, 0.1))],
            vec![
                with(|p| (p.temperature, p.top_k, p.top_p, p.min_p) = (1.2, 10, 0.9, 0.05)),
                with(|p| (p.temperature, p.top_p) = (0.6, 0.5)),
                with(|p| p.temperature = 2.0),
            ],
            vec![
                biased,
                with(|p| (p.temperature, p.repetition_penalty) = (0.9, 1.3)),
                with(|p| {
                    (p.temperature, p.presence_penalty, p.frequency_penalty) = (1.0, 0.7, 0.3)
                }),
                with(|p| (p.repetition_penalty, p.frequency_penalty) = (1.2, 0.45)),
            ],
        ]
    }

    /// Six steps of `sample` for every configuration (float32 and bfloat16 logits, the last
    /// two with a mask), then three positions of `sample_positions`.
    pub(super) fn run(configuration: &[SamplingParams], dtype: Dtype, compiled: bool) -> Vec<u32> {
        let vocab = 64;
        let prompt = [1u32, 3, 5, 40, 41];
        let mut s = BatchSampler::new(vocab);
        s.compiled = compiled;
        let joining: Vec<RowSampling> = configuration
            .iter()
            .enumerate()
            .map(|(i, p)| RowSampling {
                params: p,
                seed: (1000 + 7 * i as u64) | ((i as u64) << 33),
                prompt: &prompt,
                generated: &[],
                next_step: i as u64,
                logprobs: None,
            })
            .collect();
        s.extend(&joining).unwrap();
        let b = configuration.len() as i32;
        let mut out = Vec::new();
        for step in 0..6 {
            if step >= 4 {
                let mask: Vec<f32> = (0..b * vocab as i32)
                    .map(|i| if i % 3 == 0 { f32::NEG_INFINITY } else { 0.0 })
                    .collect();
                s.set_mask(Array::from_slice(&mask, &[b, vocab as i32]));
            }
            let t = s.sample(&logits(b, vocab as i32, step, dtype)).unwrap();
            out.extend(t.as_slice::<u32>());
        }
        let positions = logits(b * 3, vocab as i32, 99, dtype).reshape(&[b, 3, vocab as i32]);
        let t = s.sample_positions(&positions.unwrap()).unwrap();
        out.extend(t.as_slice::<u32>());
        out
    }

    /// Recorded from the op-by-op sampler (commit 7f30c14), per configuration: float32 then
    /// bfloat16 logits.
    const RECORDED: &[&[u32]] = &[
        &[40, 16, 52, 27, 62, 41, 31, 62, 30],
        &[40, 16, 52, 27, 62, 41, 31, 62, 30],
        &[
            40, 13, 46, 16, 57, 25, 52, 4, 46, 27, 57, 39, 62, 34, 18, 41, 63, 32, 31, 62, 30, 33,
            55, 10, 15, 45, 10,
        ],
        &[
            40, 13, 46, 16, 57, 9, 52, 4, 46, 27, 57, 39, 62, 34, 18, 41, 63, 32, 31, 62, 30, 33,
            55, 10, 15, 45, 10,
        ],
        &[
            14, 19, 31, 33, 5, 55, 61, 42, 62, 37, 20, 42, 19, 62, 45, 60, 41, 38,
        ],
        &[
            14, 19, 31, 33, 5, 55, 61, 39, 62, 37, 20, 42, 19, 62, 45, 60, 41, 38,
        ],
        &[40, 16, 52, 27, 62, 41, 19, 62, 17],
        &[40, 16, 52, 27, 62, 41, 19, 62, 17],
        &[40, 16, 52, 27, 62, 41, 31, 62, 30],
        &[40, 16, 52, 27, 62, 41, 31, 62, 30],
        &[
            40, 13, 46, 4, 18, 25, 5, 55, 46, 61, 58, 39, 62, 7, 18, 41, 30, 32, 19, 62, 45, 60,
            41, 10, 15, 24, 10,
        ],
        &[
            40, 13, 46, 4, 18, 25, 5, 55, 46, 61, 58, 39, 62, 7, 18, 41, 30, 32, 19, 62, 45, 60,
            41, 10, 15, 24, 10,
        ],
        &[
            40, 13, 46, 52, 3, 57, 28, 14, 3, 4, 25, 21, 27, 58, 39, 27, 62, 34, 18, 44, 41, 63,
            32, 19, 31, 62, 3, 33, 55, 10, 15, 45, 10, 22, 57, 29,
        ],
        &[
            40, 13, 46, 52, 3, 57, 28, 14, 3, 4, 25, 21, 27, 58, 39, 27, 62, 34, 18, 44, 41, 63,
            32, 19, 31, 62, 3, 33, 55, 10, 15, 45, 10, 22, 57, 29,
        ],
    ];

    #[test]
    fn seeded_tokens_are_the_op_by_op_samplers() {
        let mut recorded = RECORDED.iter();
        for c in configurations() {
            for dtype in [Dtype::Float32, Dtype::Bfloat16] {
                let expected = recorded.next().expect("a recorded run per configuration");
                assert_eq!(
                    run(&c, dtype, true),
                    *expected,
                    "{c:?} with {dtype:?} logits"
                );
            }
        }
        assert!(recorded.next().is_none());
    }

    /// The graph evaluated op by op is the same sequence of operations: its compiled form
    /// and its plain form draw alike, on whatever device the tests run (the recorded tokens
    /// above are the CPU's).
    #[test]
    fn the_compiled_graph_draws_what_its_ops_draw() {
        for c in configurations() {
            for dtype in [Dtype::Float32, Dtype::Bfloat16] {
                let compiled = run(&c, dtype, true);
                assert_eq!(
                    run(&c, dtype, false),
                    compiled,
                    "{c:?} with {dtype:?} logits"
                );
            }
        }
    }

    /// A row whose first token another sampler drew (a prompt's last prefill pass) and that
    /// joins with it as `generated`, its next step after it, draws what it would have drawn
    /// had one sampler drawn every token: its penalties see and count that token.
    #[test]
    fn a_row_joining_with_its_first_token_draws_as_if_never_moved() {
        fn row<'a>(
            params: &'a SamplingParams,
            generated: &'a [u32],
            next_step: u64,
        ) -> RowSampling<'a> {
            RowSampling {
                params,
                seed: 5,
                prompt: &[0, 3, 3],
                generated,
                next_step,
                logprobs: None,
            }
        }
        let vocab = 64;
        for params in configurations().into_iter().flatten() {
            let draw = |s: &mut BatchSampler, step| {
                let l = logits(1, vocab as i32, step, Dtype::Float32);
                s.sample(&l).unwrap().as_slice::<u32>()[0]
            };
            let mut one = BatchSampler::new(vocab);
            one.extend(&[row(&params, &[], 0)]).unwrap();
            let all: Vec<u32> = (0..5).map(|step| draw(&mut one, step)).collect();
            let mut first = BatchSampler::new(vocab);
            first.extend(&[row(&params, &[], 0)]).unwrap();
            assert_eq!(draw(&mut first, 0), all[0], "{params:?}");
            let mut joined = BatchSampler::new(vocab);
            joined.extend(&[row(&params, &all[..1], 1)]).unwrap();
            let rest: Vec<u32> = (1..5).map(|step| draw(&mut joined, step)).collect();
            assert_eq!(rest, all[1..], "{params:?}");
        }
        // Where the penalty decides: greedy over constant logits takes token 1 first, then
        // token 2 only if the joined row's penalty knows token 1 was generated (the prompt
        // holds neither).
        let flat = Array::from_slice(&[0.0f32, 3.0, 2.8, 0.0, 0.0, 0.0, 0.0, 0.0], &[1, 8]);
        let penalties = [
            with(|p| p.repetition_penalty = 1.5),
            with(|p| p.presence_penalty = 1.0),
            with(|p| p.frequency_penalty = 1.0),
        ];
        for params in &penalties {
            let mut joined = BatchSampler::new(8);
            joined.extend(&[row(params, &[1], 1)]).unwrap();
            let next = joined.sample(&flat).unwrap().as_slice::<u32>()[0];
            assert_eq!(next, 2, "{params:?}");
        }
    }

    /// Rows joining and leaving between steps (a new traced shape each time) change no row's
    /// draws: each row draws what it draws alone.
    #[test]
    fn rows_joining_and_leaving_keep_their_draws() {
        let vocab = 64;
        let configs = configurations();
        let params: Vec<SamplingParams> = configs.into_iter().flatten().collect();
        let row = |i: usize| RowSampling {
            params: &params[i],
            seed: 77 + i as u64,
            prompt: &[2, 4],
            generated: &[],
            next_step: 0,
            logprobs: None,
        };
        let alone: Vec<Vec<u32>> = (0..params.len())
            .map(|i| {
                let mut s = BatchSampler::new(vocab);
                s.extend(&[row(i)]).unwrap();
                (0..5)
                    .map(|step| {
                        let l = logits(1, vocab as i32, step, Dtype::Float32);
                        s.sample(&l).unwrap().as_slice::<u32>()[0]
                    })
                    .collect()
            })
            .collect();
        // Rows 0..4 start; after two steps rows 1 and 3 leave and 4..len join; every row
        // gets the same logits row as alone at each of its own steps.
        let mut s = BatchSampler::new(vocab);
        s.extend(&(0..4).map(row).collect::<Vec<_>>()).unwrap();
        let mut members: Vec<(usize, u32)> = (0..4).map(|i| (i, 0)).collect();
        let mut drawn: Vec<Vec<u32>> = vec![Vec::new(); params.len()];
        for round in 0..5 {
            if round == 2 {
                s.filter(&[0, 2]).unwrap();
                members = vec![members[0], members[2]];
                s.extend(&(4..params.len()).map(row).collect::<Vec<_>>())
                    .unwrap();
                members.extend((4..params.len()).map(|i| (i, 0)));
            }
            let rows: Vec<Array> = members
                .iter()
                .map(|&(_, step)| logits(1, vocab as i32, step, Dtype::Float32))
                .collect();
            let t = s.sample(&concatenate(&rows, 0).unwrap()).unwrap();
            for (m, &token) in members.iter_mut().zip(t.as_slice::<u32>()) {
                drawn[m.0].push(token);
                m.1 += 1;
            }
        }
        for (i, d) in drawn.iter().enumerate() {
            assert_eq!(d[..], alone[i][..d.len()], "row {i}: {:?}", params[i]);
        }
    }
}
