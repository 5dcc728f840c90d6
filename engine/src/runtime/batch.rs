//! The decode batch: every sequence past its prompt advances one token per forward pass.
//!
//! A step runs one step ahead, as mlx-lm does: it builds and queues (`async_eval`) the forward
//! pass for the tokens sampled in the previous step, and only then reads those tokens back, so
//! the device never waits for the host. Rows join (prefilled sequences, their last prompt token
//! as input, or the first token their last prefill pass sampled: [`super::first_token`]) and
//! leave (limit reached, stop token, client gone) between steps; the one token a finished row
//! had in flight is discarded.
use std::time::Instant;

use mlx_rs::error::Exception;
use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use super::draft::adaptive::Acceptance;
use super::draft::governor::StepKind;
use super::draft::{ngram, verify, DraftCounts, Drafter, Speculator};
use super::request::FinishReason;
use super::sampler::{BatchSampler, PickedLogprobs, RowSampling};
use super::sequence::Sequence;
use super::step_trace::StepClock;
use crate::adapters;
use crate::cache::{KvLayout, KvSpace, LayerCache, LayerKind, SeqKv};
use crate::models::CausalLm;

/// Sequences whose prompt is in their cache, ready to join the batch.
pub struct Prefilled {
    pub seqs: Vec<Sequence>,
    /// One cache per layer, with one row per sequence, in order.
    pub layers: Vec<LayerCache>,
}

/// The tokens a row's cache stands for and a copy of it (per layer: keys and values or a
/// recurrent state, and the position they start at).
pub type RowKv = (Vec<u32>, SeqKv);

/// A step's drafts: on the host (n-gram lookup) or still on the device (a draft model).
enum Drafts {
    Host(Vec<Vec<u32>>),
    Device(Array),
}

/// A sequence that left the batch, with a copy of its KV for the prefix cache.
pub struct Departed {
    pub seq: Sequence,
    pub kv: Option<RowKv>,
}

/// Whether row `r` (sequence `s`) is given drafts: its recent drafts paid
/// ([`Acceptance`](super::draft::adaptive::Acceptance)), its sampling is position-independent,
/// and no constraint masks its tokens (a mask for position i + 1 depends on token i).
fn row_drafts(sampler: &BatchSampler, r: usize, s: &Sequence) -> bool {
    s.acceptance.is_drafting() && sampler.row_takes_drafts(r) && s.constraint.is_none()
}

/// The units joining in one step as one, in order: their caches are joined among themselves
/// first (small buffers, each copied once: [`LayerCache::join_sequences`]), so that the
/// batch's buffers, the large ones, are copied once per step rather than once per unit (a
/// step's prefill may finish several groups and chunks). The rows' alignment is the same
/// either way: each row ends up padded on the left to the longest.
fn merged(units: Vec<Prefilled>) -> Result<Option<Prefilled>, Exception> {
    if units.len() <= 1 {
        return Ok(units.into_iter().next());
    }
    let (seqs, layers): (Vec<Vec<Sequence>>, Vec<Vec<LayerCache>>) =
        units.into_iter().map(|u| (u.seqs, u.layers)).unzip();
    let seqs = seqs.into_iter().flatten().collect();
    let layers = LayerCache::join_sequences(layers)?;
    Ok(Some(Prefilled { seqs, layers }))
}

/// Whether a pipelined step waits for the previous step's tokens before queueing its own pass
/// (`MLXD_WAIT_BEFORE_QUEUE=1`; read once), a switch for measuring. MLX updates a buffer in
/// place only when nothing else holds it when the update is queued; a step queued while the
/// previous one is in flight finds each layer's KV buffer held by that step's attention, so
/// its write of one position copies the whole buffer (on the CPU backend: a 33 MB buffer
/// written 40 times pipelined peaks 72 MB over it, queued after the wait 2.7 MB). Waiting
/// first gives up the overlap of queueing with the previous step's device time.
fn wait_before_queue() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MLXD_WAIT_BEFORE_QUEUE").is_ok_and(|v| v == "1"))
}

pub struct DecodeBatch {
    rows: Vec<Sequence>,
    caches: Vec<LayerCache>,
    sampler: BatchSampler,
    /// Tokens sampled for `rows` in the last step, not yet read back.
    in_flight: Option<Array>,
    /// Each layer's kind (one entry per layer): attention within its window, or a state.
    kinds: Vec<LayerKind>,
    /// Copy each departing row's KV (the prefix cache is on).
    keep_kv: bool,
    /// Speculative decoding: every step drafts and verifies (synchronously).
    spec: Option<Speculator>,
    /// When the batch's caches switch to quantized storage (`--quantized-kv-start`).
    layout: KvLayout,
    /// Drafted and accepted tokens since the batch was made.
    pub draft_counts: DraftCounts,
    /// The last step's kind, start and emitted tokens, for the draft governor.
    last_step: Option<(StepKind, Instant, usize)>,
}

impl DecodeBatch {
    /// A batch for a model whose layers are `kinds`.
    pub fn new(
        kinds: Vec<LayerKind>,
        vocab: usize,
        keep_kv: bool,
        layout: KvLayout,
        spec: Option<Speculator>,
    ) -> Self {
        Self {
            rows: Vec::new(),
            caches: Vec::new(),
            sampler: BatchSampler::new(vocab),
            in_flight: None,
            kinds,
            keep_kv,
            spec,
            layout,
            draft_counts: DraftCounts::default(),
            last_step: None,
        }
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Tokens the rows hold (prompt and generated): their KV positions, which grow by one a
    /// row at each step, exactly (the KV arrays grow in blocks).
    pub fn held_tokens(&self) -> usize {
        self.rows.iter().map(|s| s.tokens.len()).sum()
    }

    /// Each row's adapter, in order.
    pub fn adapters(&self) -> impl Iterator<Item = Option<adapters::AdapterId>> + '_ {
        self.rows.iter().map(|s| s.adapter)
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty() && self.in_flight.is_none()
    }

    pub fn kv_bytes(&self) -> usize {
        self.caches.iter().map(LayerCache::nbytes).sum::<usize>()
            + self.spec.as_ref().map_or(0, Speculator::kv_bytes)
    }

    /// Removes every row (after a failure), in batch order.
    pub fn drain(&mut self) -> Vec<Sequence> {
        self.caches.clear();
        if let Some(Drafter::Model(m)) = self.spec.as_mut().map(|s| &mut s.drafter) {
            let _ = m.filter(&[]);
        }
        self.in_flight = None;
        self.sampler = BatchSampler::new(self.sampler.vocab());
        std::mem::take(&mut self.rows)
    }

    /// One step: drop finished rows, add `joining`, queue the next forward pass, then read back
    /// and hand out the tokens of the previous one. Returns the rows that left.
    pub fn step(
        &mut self,
        model: &dyn CausalLm,
        joining: Vec<Prefilled>,
    ) -> Result<Vec<Departed>, Exception> {
        for seq in &mut self.rows {
            seq.acceptance.tick();
        }
        let started = Instant::now();
        if let (Some(spec), Some((kind, since, tokens))) = (self.spec.as_mut(), self.last_step) {
            // A step's time runs to the start of the next: whatever the loop does between
            // steps, and work a step left queued, count against it.
            spec.governor.record(kind, tokens, started - since);
            tracing::trace!(
                target: "mlxd_engine::step",
                ?kind,
                tokens,
                micros = (started - since).as_micros() as u64,
                "step timed"
            );
        }
        let held: usize = self.rows.iter().map(|s| s.tokens.len()).sum::<usize>()
            + joining
                .iter()
                .flat_map(|u| &u.seqs)
                .map(|s| s.tokens.len())
                .sum::<usize>();
        let (kind, departed) = if self.drafts_this_step(&joining) {
            // The speculative step starts with every row's last token on the host.
            self.hand_out_now()?;
            (
                StepKind::Speculative,
                self.speculative_step(model, joining)?,
            )
        } else {
            (StepKind::Pipelined, self.pipelined_step(model, joining)?)
        };
        if let Some(spec) = self.spec.as_mut() {
            let now_held: usize = self.rows.iter().map(|s| s.tokens.len()).sum::<usize>()
                + departed.iter().map(|d| d.seq.tokens.len()).sum::<usize>();
            self.last_step = Some((kind, started, now_held.saturating_sub(held)));
            if self.rows.is_empty() {
                // The next rows are another workload: measure afresh.
                spec.governor = Default::default();
                self.last_step = None;
            }
        }
        self.replay_lookups();
        self.quantize_past_start()?;
        Ok(departed)
    }

    /// Whether this step drafts: speculation is on, the governor finds drafting faster, and
    /// some row may be given drafts. With a draft model, rows joining always go through the
    /// speculative step, which prefills them into the draft model's cache, so that cache
    /// keeps a row for every batch row.
    fn drafts_this_step(&self, joining: &[Prefilled]) -> bool {
        let Some(spec) = &self.spec else {
            return false;
        };
        if matches!(spec.drafter, Drafter::Model(_)) && !joining.is_empty() {
            return true;
        }
        // Joining rows never draft at once (a draft model's are handled above; a shadowed
        // row has no record yet). A prompt-lookup row drafts only when its lookup finds
        // something (on the text read back so far: a pipelined step's tokens are still in
        // flight).
        let finds = |s: &Sequence| match &spec.drafter {
            Drafter::Ngram(sizes) => !ngram::propose(&s.tokens, *sizes, 1).is_empty(),
            Drafter::Model(_) => true,
        };
        spec.governor.next_kind() == StepKind::Speculative
            && self
                .rows
                .iter()
                .enumerate()
                .any(|(r, s)| s.wants_more() && row_drafts(&self.sampler, r, s) && finds(s))
    }

    /// Settles each shadowed row's replayed lookups against the tokens it has emitted
    /// without drafts, into its acceptance record.
    fn replay_lookups(&mut self) {
        let Some(Speculator {
            drafter: Drafter::Ngram(sizes),
            num_draft,
            ..
        }) = &self.spec
        else {
            return;
        };
        for seq in &mut self.rows {
            seq.acceptance.replay(&seq.tokens, *sizes, *num_draft);
        }
    }

    /// Switches the caches to quantized storage once the longest row passes the layout's
    /// start (every row: a buffer has one layout).
    fn quantize_past_start(&mut self) -> Result<(), Exception> {
        let Some(q) = self.layout.quant else {
            return Ok(());
        };
        let longest = self
            .caches
            .iter()
            .filter_map(|c| match c {
                LayerCache::Batched(b) if b.quant().is_none() => Some(b.longest_row()),
                _ => None,
            })
            .max();
        if longest.is_some_and(|len| self.layout.at(len).is_some()) {
            for cache in &mut self.caches {
                if let Some(c) = cache.as_batched_mut() {
                    c.quantize(q)?;
                }
            }
        }
        Ok(())
    }

    /// One decode step of the pipelined path (see the module comment).
    fn pipelined_step(
        &mut self,
        model: &dyn CausalLm,
        joining: Vec<Prefilled>,
    ) -> Result<Vec<Departed>, Exception> {
        let mut clock = StepClock::start();
        let pending = self.in_flight.take();
        let mut keep = Vec::new();
        let mut kept = Vec::new();
        // Rows leaving now that are still owed their pending token, with its position.
        let mut leaving = Vec::new();
        let mut departed = Vec::new();
        for (i, seq) in std::mem::take(&mut self.rows).into_iter().enumerate() {
            if seq.wants_more() {
                keep.push(i);
                kept.push((seq, i));
                continue;
            }
            let kv = self.row_kv(i, &seq)?;
            if seq.finished {
                // Its pending token was sampled after the end: discard it.
                departed.push(Departed { seq, kv });
            } else {
                leaving.push((seq, i, kv));
            }
        }
        let all_stay = keep.iter().enumerate().all(|(i, &r)| i == r) && leaving.is_empty();
        let pending_input = match &pending {
            Some(p) if !keep.is_empty() && all_stay && departed.is_empty() => Some(p.clone()),
            Some(p) if !keep.is_empty() => {
                let idx = Array::from_slice(
                    &keep.iter().map(|&r| r as i32).collect::<Vec<_>>(),
                    &[keep.len() as i32],
                );
                Some(p.take_axis(&idx, 0)?)
            }
            // The last step was synchronous: every kept row's last token is on the host.
            None if !kept.is_empty() => {
                let last: Vec<u32> = kept
                    .iter()
                    .map(|(s, _)| s.tokens[s.tokens.len() - 1])
                    .collect();
                Some(Array::from_slice(&last, &[last.len() as i32]))
            }
            _ => None,
        };
        self.filter(&keep)?;
        let kept_positions: Vec<usize> = kept.iter().map(|(_, i)| *i).collect();
        self.rows = kept.into_iter().map(|(s, _)| s).collect();

        // Rows whose first token this step samples (their prompt's last token is its input).
        let first_here = joining.iter().flat_map(|u| &u.seqs).any(|s| s.sampled == 0);
        let mut join_tokens = Vec::new();
        if let Some(unit) = merged(joining)? {
            self.join(unit, &mut join_tokens)?;
        }

        if !self.rows.is_empty() {
            let mut inputs: Vec<Array> = pending_input.into_iter().collect();
            if !join_tokens.is_empty() {
                inputs.push(Array::from_slice(&join_tokens, &[join_tokens.len() as i32]));
            }
            let input = match inputs.len() {
                1 => inputs.pop().expect("one input"),
                _ => concatenate(&inputs, 0)?,
            };
            let b = self.rows.len() as i32;
            let _adapters = adapters::select(model, self.rows.iter().map(|s| s.adapter))?;
            let logits = model.forward(&input.reshape(&[b, 1])?, &mut self.caches)?;
            clock.forward_built();
            if let Some(mask) = self.constraint_mask()? {
                self.sampler.set_mask(mask);
            }
            let next = self.sampler.sample(&logits.index((.., -1, ..)))?;
            clock.sampler_built();
            if wait_before_queue() {
                if let Some(p) = &pending {
                    p.eval()?;
                }
            }
            let mut state: Vec<&Array> = vec![&next];
            state.extend(self.sampler.state());
            super::step_graph::maybe_write(&state, pending.as_ref());
            mlx_rs::transforms::async_eval(state)?;
            clock.queued();
            for seq in &mut self.rows {
                seq.sampled += 1;
            }
            self.in_flight = Some(next);
        }

        // Rows joining a batch with nothing in flight (a burst arriving together, or a request
        // alone) get their first token now rather than one step later: there is no earlier
        // step to overlap this one with, so waiting for it costs the device nothing but saves
        // every new row a whole step of time to first token. The next step then starts from
        // the host's tokens and the pipeline resumes.
        let first_tokens_now = pending.is_none() && first_here;
        match pending {
            Some(pending) => {
                clock.reading();
                pending.eval()?;
                clock.read();
                let tokens: &[u32] = pending.as_slice();
                for (seq, &i) in self.rows.iter_mut().zip(&kept_positions) {
                    seq.emit(tokens[i], false);
                }
                for (mut seq, i, kv) in leaving {
                    seq.emit(tokens[i], true);
                    departed.push(Departed { seq, kv });
                }
            }
            None => {
                for (mut seq, _, kv) in leaving {
                    seq.finish(FinishReason::Length);
                    departed.push(Departed { seq, kv });
                }
            }
        }
        if first_tokens_now
            || self.rows.iter().any(|s| s.constraint.is_some())
            || self.sampler.wants_logprobs()
        {
            self.hand_out_now()?;
        }
        if clock.is_on() {
            let joined = join_tokens.len();
            clock.finish(self.rows.len(), joined, self.sampler.sampled_rows());
        }
        Ok(departed)
    }

    /// One speculative step: rows that are done leave, `joining` joins, every row gets up to
    /// `num_draft` drafts, one forward pass of the model verifies them all, each row keeps its
    /// accepted prefix plus the model's next token, and every cache drops what it rejected.
    /// Synchronous: between steps every row's last token is read back and not yet in the KV.
    fn speculative_step(
        &mut self,
        model: &dyn CausalLm,
        joining: Vec<Prefilled>,
    ) -> Result<Vec<Departed>, Exception> {
        let departed = self.leave_done()?;
        let first_joined = self.rows.len();
        let mut unused = Vec::new();
        if let Some(unit) = merged(joining)? {
            self.join(unit, &mut unused)?;
        }
        if self.rows.is_empty() {
            return Ok(departed);
        }
        let spec = self.spec.as_mut().expect("a speculative batch");
        if let Drafter::Model(m) = &mut spec.drafter {
            let contexts: Vec<&[u32]> = self.rows[first_joined..]
                .iter()
                .map(|s| &s.tokens[..s.tokens.len() - 1])
                .collect();
            if !contexts.is_empty() {
                m.join(&contexts)?;
            }
        }

        let b = self.rows.len();
        let last: Vec<u32> = self.rows.iter().map(|s| s.last_token()).collect();
        // Drafts a row may take: none with position-dependent sampling state, and never more
        // than it can still emit (its accepted drafts plus one token).
        let budget: Vec<usize> = self
            .rows
            .iter()
            .enumerate()
            .map(|(r, s)| {
                if row_drafts(&self.sampler, r, s) {
                    spec.num_draft.min(s.remaining() - 1)
                } else {
                    0
                }
            })
            .collect();
        let last_array = Array::from_slice(&last, &[b as i32]);
        let (input, drafts): (Array, Drafts) = match &mut spec.drafter {
            Drafter::Ngram(sizes) => {
                let proposals: Vec<Vec<u32>> = self
                    .rows
                    .iter()
                    .zip(&budget)
                    .map(|(s, &k)| ngram::propose(&s.tokens, *sizes, k))
                    .collect();
                let q = proposals.iter().map(Vec::len).max().unwrap_or(0);
                let mut tokens = Vec::with_capacity(b * (q + 1));
                for (p, &t) in proposals.iter().zip(&last) {
                    tokens.push(t);
                    tokens.extend_from_slice(p);
                    // Fillers past a row's own drafts are rejected and rolled back.
                    tokens.extend(std::iter::repeat_n(t, q - p.len()));
                }
                let input = Array::from_slice(&tokens, &[b as i32, q as i32 + 1]);
                (input, Drafts::Host(proposals))
            }
            Drafter::Model(m) => {
                let q = budget.iter().copied().max().unwrap_or(0);
                if q == 0 {
                    (
                        last_array.reshape(&[b as i32, 1])?,
                        Drafts::Host(vec![Vec::new(); b]),
                    )
                } else {
                    let proposed = m.propose(&last_array, q)?;
                    let input =
                        concatenate(&[last_array.reshape(&[b as i32, 1])?, proposed.clone()], 1)?;
                    (input, Drafts::Device(proposed))
                }
            }
        };
        let l = input.shape()[1] as usize;
        tracing::trace!(
            target: "mlxd_engine::step",
            rows = b,
            width = l,
            drafting = budget.iter().filter(|&&k| k > 0).count(),
            "speculative pass"
        );
        let adapters = adapters::select(model, self.rows.iter().map(|s| s.adapter))?;
        let logits = model.forward(&input, &mut self.caches)?;
        drop(adapters);
        if let Some(mask) = self.constraint_mask()? {
            self.sampler.set_mask(mask);
        }
        let sampled = self.sampler.sample_positions(&logits)?;
        let logprobs = self.sampler.take_logprobs();
        let mut state: Vec<&Array> = vec![&sampled];
        state.extend(logprobs.iter().flat_map(PickedLogprobs::arrays));
        if let Drafts::Device(d) = &drafts {
            state.push(d);
        }
        let spec = self.spec.as_ref().expect("a speculative batch");
        if let Drafter::Model(m) = &spec.drafter {
            state.extend(m.state());
        }
        mlx_rs::transforms::eval(state)?;
        let sampled: &[u32] = sampled.as_slice();
        let proposals: Vec<Vec<u32>> = match drafts {
            Drafts::Host(p) => p,
            Drafts::Device(d) => {
                let q = d.shape()[1] as usize;
                let all: &[u32] = d.as_slice();
                (0..b)
                    .map(|r| all[r * q..r * q + budget[r]].to_vec())
                    .collect()
            }
        };

        let mut drop = Vec::with_capacity(b);
        let mut advanced = Vec::with_capacity(b);
        let mut newest = Vec::with_capacity(b);
        for (r, seq) in self.rows.iter_mut().enumerate() {
            let v = verify::verdict(&proposals[r], &sampled[r * l..(r + 1) * l]);
            if let (Some(want), Some(lp)) = (seq.logprobs, &logprobs) {
                // Such a row has no drafts: its one token is position 0's.
                seq.set_logprobs(lp.at(r * l, want)?);
            }
            seq.drafted += proposals[r].len();
            seq.accepted += v.accepted;
            self.draft_counts.drafted += proposals[r].len() as u64;
            self.draft_counts.accepted += v.accepted as u64;
            for &token in &v.emitted {
                seq.sampled += 1;
                let limit = seq.remaining() == 0;
                seq.emit(token, limit);
            }
            // A row whose lookup found nothing took its one token like a row without drafts.
            if !proposals[r].is_empty() {
                let at = seq.tokens.len();
                seq.acceptance.verified(proposals[r].len(), v.accepted, at);
            }
            drop.push(v.rollback);
            advanced.push(v.emitted.len() as u32);
            newest.push(
                *v.emitted
                    .last()
                    .expect("a verdict emits at least one token"),
            );
        }
        for cache in &mut self.caches {
            cache.rollback(&drop)?;
        }
        if let Some(Drafter::Model(m)) = self.spec.as_mut().map(|s| &mut s.drafter) {
            m.rollback(&drop)?;
        }
        // The rollback (a gather when rows drop different counts) is this step's work: done
        // here, it is timed with the step that caused it.
        mlx_rs::transforms::eval(self.caches.iter().flat_map(LayerCache::state))?;
        self.sampler
            .advance(&advanced, &Array::from_slice(&newest, &[b as i32]))?;
        Ok(departed)
    }

    /// The `[B, vocab]` mask of the next token when some row is constrained: each constrained
    /// row's allowed set, zeros for the others.
    fn constraint_mask(&mut self) -> Result<Option<Array>, Exception> {
        super::first_token::constraint_mask(&mut self.rows, self.sampler.vocab())
    }

    /// Reads this step's tokens back and hands them out at once (the synchronous step of a
    /// batch with a constrained row or one that reports log-probabilities), advancing each
    /// row's constraint.
    fn hand_out_now(&mut self) -> Result<(), Exception> {
        let Some(next) = self.in_flight.take() else {
            return Ok(());
        };
        let logprobs = self.sampler.take_logprobs();
        let mut arrays = vec![&next];
        arrays.extend(logprobs.iter().flat_map(PickedLogprobs::arrays));
        mlx_rs::transforms::eval(arrays)?;
        let tokens: &[u32] = next.as_slice();
        for (r, (seq, &token)) in self.rows.iter_mut().zip(tokens).enumerate() {
            if let (Some(want), Some(lp)) = (seq.logprobs, &logprobs) {
                seq.set_logprobs(lp.at(r, want)?);
            }
            let last = seq.at_limit();
            seq.emit(token, last);
        }
        Ok(())
    }

    /// Rows that are done while none of their tokens is in flight (a row whose first token was
    /// its last is handed it at once, in the step it joins): they leave now, with their KV,
    /// rather than at the next step, which a request sent the moment they finished would
    /// otherwise follow, its prefix lookup missing their prompt (seen: every family's
    /// one-token requests followed at once by longer ones missed the last of them).
    pub fn release_finished(&mut self) -> Result<Vec<Departed>, Exception> {
        if self.in_flight.is_some() || self.rows.iter().all(Sequence::wants_more) {
            return Ok(Vec::new());
        }
        self.leave_done()
    }

    /// Takes out the rows that want no more tokens, each with its KV (those not finished yet,
    /// a closed or full row, finish for length): nothing of theirs may be in flight.
    fn leave_done(&mut self) -> Result<Vec<Departed>, Exception> {
        let mut keep = Vec::new();
        let mut kept = Vec::new();
        let mut departed = Vec::new();
        for (i, mut seq) in std::mem::take(&mut self.rows).into_iter().enumerate() {
            if seq.wants_more() {
                keep.push(i);
                kept.push(seq);
                continue;
            }
            let kv = self.row_kv(i, &seq)?;
            if !seq.finished {
                seq.finish(FinishReason::Length);
            }
            departed.push(Departed { seq, kv });
        }
        self.filter(&keep)?;
        self.rows = kept;
        Ok(departed)
    }

    /// A copy of row `r`'s KV and the tokens it holds, when the prefix cache wants it.
    fn row_kv(&self, r: usize, seq: &Sequence) -> Result<Option<RowKv>, Exception> {
        // A row with no known space (see `Sequence::space`) is not kept.
        if !self.keep_kv || seq.space.is_none() {
            return Ok(None);
        }
        let mut layers = Vec::with_capacity(self.caches.len());
        let mut starts = Vec::with_capacity(self.caches.len());
        let mut len = None;
        for cache in &self.caches {
            let n = cache.row_len(r);
            if len.is_some_and(|l| l != n) {
                // Layers disagree on what the row holds: nothing exact to keep.
                return Ok(None);
            }
            len = Some(n);
            match cache.row_copy(r)? {
                Some((layer, start)) => {
                    layers.push(layer);
                    starts.push(start);
                }
                None => return Ok(None),
            }
        }
        match len {
            Some(n) if n > 0 && n <= seq.tokens.len() => {
                Ok(Some((seq.tokens[..n].to_vec(), SeqKv::new(layers, starts))))
            }
            _ => Ok(None),
        }
    }

    /// Copies of the KV of running rows that generated `every` tokens or more since their
    /// last checkpoint, with their spaces and generated counts (generation checkpoints).
    pub fn checkpoints(&mut self, every: usize) -> Result<Vec<(KvSpace, RowKv, usize)>, Exception> {
        let mut out = Vec::new();
        for r in 0..self.rows.len() {
            let seq = &self.rows[r];
            let generated = seq.tokens.len() - seq.prompt_len;
            if !seq.wants_more() || generated < seq.checkpointed + every {
                continue;
            }
            if let (Some(space), Some(kv)) = (seq.space, self.row_kv(r, seq)?) {
                let held = kv.0.len().saturating_sub(seq.prompt_len);
                out.push((space, kv, held));
            }
            self.rows[r].checkpointed = generated;
        }
        Ok(out)
    }

    fn filter(&mut self, keep: &[usize]) -> Result<(), Exception> {
        if let Some(Drafter::Model(m)) = self.spec.as_mut().map(|s| &mut s.drafter) {
            m.filter(keep)?;
        }
        if keep.is_empty() {
            self.caches.clear();
            self.sampler = BatchSampler::new(self.sampler.vocab());
            return Ok(());
        }
        for cache in &mut self.caches {
            cache.filter(keep)?;
        }
        self.sampler.filter(keep)
    }

    fn join(&mut self, unit: Prefilled, join_tokens: &mut Vec<u32>) -> Result<(), Exception> {
        let Prefilled { seqs, layers } = unit;
        if self.caches.is_empty() {
            self.caches = self
                .kinds
                .iter()
                .map(|&kind| kind.fresh(Vec::new(), None))
                .collect();
        }
        for (cache, layer) in self.caches.iter_mut().zip(layers) {
            cache.extend(layer)?;
        }
        let joining: Vec<RowSampling> = seqs.iter().map(Sequence::row_sampling).collect();
        self.sampler.extend(&joining)?;
        join_tokens.extend(seqs.iter().map(Sequence::last_token));
        let shadowed = matches!(
            self.spec,
            Some(Speculator {
                drafter: Drafter::Ngram(_),
                ..
            })
        );
        self.rows.extend(seqs.into_iter().map(|mut seq| {
            if shadowed {
                seq.acceptance = Acceptance::shadowed(seq.tokens.len());
            }
            seq
        }));
        Ok(())
    }
}
