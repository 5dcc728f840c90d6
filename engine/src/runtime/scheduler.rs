//! Scheduling policy as pure functions over a snapshot, with no MLX in it: which waiting
//! requests to admit, and which prefill work runs in the next step.
//!
//! Admission is first come, first served: a request waits while the batch is full
//! (`max_batch_size` counts sequences prefilling and decoding) or while its KV reservation
//! does not fit beside the others'; a request larger than the whole budget is refused at once
//! rather than left to block the queue.
//!
//! Each step runs one prefill unit beside the decode step, so a long prompt delays running
//! streams by at most one chunk. A unit is either one chunk of one prompt — when that prompt is
//! long or continues a cached prefix — or a group of short fresh prompts padded on the left
//! into one forward pass, so that a burst of new requests gets its first tokens together
//! instead of one step apart.
//!
//! Prompts take turns: each unit goes to the prompt served least recently (a prompt never
//! served first, then in admission order), so a short prompt admitted behind a long one is
//! prefilled at the long one's next chunk boundary instead of after its last chunk, and long
//! prompts share the steps round-robin.
//!
//! A chunk holds at most the step's token budget ([`chunk_budget`]): `prefill_chunk` on a fast
//! device, fewer where the measured prefill speed would make a chunk outlast
//! `prefill_unit_target`. A chunk is the unit of cancellation (a prompt whose client left is
//! dropped between two units) and of interleaving, so on a slow device (a CPU) both come
//! within about the target time instead of after a 2 048-token forward pass.
use std::time::Duration;

use crate::cache::KvBudget;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerLimits {
    pub max_batch_size: usize,
    /// Most prompt tokens of one sequence per prefill forward pass.
    pub prefill_chunk: usize,
    /// Fewest tokens of a chunk that the measured prefill speed may shrink it to.
    pub min_prefill_chunk: usize,
    /// Wall time one prefill unit should take at most, where the speed allows.
    pub prefill_unit_target: Duration,
    /// Whether chunks end at multiples of `state_snapshot_every` (a model with recurrent
    /// layers snapshots its state there, and a state is only copied between forward passes).
    pub snapshot_boundaries: bool,
    /// Most tokens (rows × padded length) of a grouped prefill forward pass.
    pub prefill_group_tokens: usize,
    /// Prompt tokens between two snapshots of a recurrent state (see
    /// [`RuntimeLimits::state_snapshot_every`](super::RuntimeLimits::state_snapshot_every)).
    pub state_snapshot_every: usize,
}

/// A request waiting for admission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WaitingView {
    /// KV bytes it would reserve.
    pub reservation: u64,
}

/// A sequence admitted and still prefilling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillView {
    /// Prompt tokens still to run before decoding (its last token runs in the decode step).
    pub remaining: usize,
    /// Positions already in its cache (a prefix-cache hit or earlier chunks).
    pub written: usize,
    /// The unit number of its last prefill work; 0 while it has had none.
    pub last_unit: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    Admit,
    /// Needs more KV than the whole budget: it can never run.
    Refuse,
}

/// Decisions for the first waiting requests, in order; those after them keep waiting.
pub fn admit(
    limits: &SchedulerLimits,
    budget: &KvBudget,
    waiting: &[WaitingView],
    running: usize,
) -> Vec<Admission> {
    let mut decisions = Vec::new();
    let mut reserved = 0u64;
    let mut running = running;
    for w in waiting {
        if !budget.can_ever_fit(w.reservation) {
            decisions.push(Admission::Refuse);
            continue;
        }
        if running >= limits.max_batch_size || !budget.fits(reserved + w.reservation) {
            break;
        }
        reserved += w.reservation;
        running += 1;
        decisions.push(Admission::Admit);
    }
    decisions
}

/// The prefill work of the next step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrefillWork {
    /// The next `tokens` prompt tokens of sequence `index`.
    Chunk { index: usize, tokens: usize },
    /// All remaining prompt tokens of these fresh sequences, in one padded pass.
    Group { indices: Vec<usize> },
}

/// The most prompt tokens of one chunk, given the prefill speed measured so far (tokens per
/// second, `None` before the first unit): `prefill_chunk` where it runs within
/// `prefill_unit_target`, else as many as run in that time rounded down to a power of two (few
/// distinct shapes), at least `min_prefill_chunk`.
pub fn chunk_budget(limits: &SchedulerLimits, tokens_per_s: Option<f64>) -> usize {
    let most = limits.prefill_chunk.max(1);
    let Some(speed) = tokens_per_s.filter(|s| s.is_finite() && *s > 0.0) else {
        return most;
    };
    let fits = (speed * limits.prefill_unit_target.as_secs_f64()).min(most as f64) as usize;
    if fits >= most {
        return most;
    }
    let rounded = if fits == 0 {
        0
    } else {
        1 << (usize::BITS - 1 - fits.leading_zeros())
    };
    rounded
        .max(limits.min_prefill_chunk.clamp(1, most))
        .min(most)
}

/// Picks the next prefill unit among sequences still prefilling (in admission order), chunks
/// holding at most `budget` tokens (see [`chunk_budget`]); `None` when none has tokens left.
pub fn next_prefill(
    limits: &SchedulerLimits,
    prefilling: &[PrefillView],
    budget: usize,
) -> Option<PrefillWork> {
    let budget = budget.clamp(1, limits.prefill_chunk.max(1));
    let (first, head) = prefilling
        .iter()
        .enumerate()
        .filter(|(_, p)| p.remaining > 0)
        .min_by_key(|(i, p)| (p.last_unit, *i))?;
    let groupable = |p: &PrefillView| p.written == 0 && p.remaining > 0 && p.remaining <= budget;
    if !groupable(head) {
        let mut tokens = head.remaining.min(budget);
        if limits.snapshot_boundaries {
            let every = limits.state_snapshot_every.max(1);
            tokens = tokens.min(every - head.written % every);
        }
        return Some(PrefillWork::Chunk {
            index: first,
            tokens,
        });
    }
    // A group's padded tokens scale with the budget, so a slow device's group is no longer
    // than its chunks either.
    let group_tokens = (limits.prefill_group_tokens as u128 * budget as u128
        / limits.prefill_chunk.max(1) as u128)
        .max(budget as u128) as usize;
    let mut indices = vec![first];
    let mut longest = head.remaining;
    for (i, p) in prefilling.iter().enumerate() {
        if i == first || !groupable(p) {
            continue;
        }
        let padded = longest.max(p.remaining);
        if (indices.len() + 1) * padded > group_tokens {
            continue;
        }
        longest = padded;
        indices.push(i);
    }
    if indices.len() == 1 {
        Some(PrefillWork::Chunk {
            index: first,
            tokens: head.remaining,
        })
    } else {
        Some(PrefillWork::Group { indices })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> SchedulerLimits {
        SchedulerLimits {
            max_batch_size: 3,
            prefill_chunk: 100,
            min_prefill_chunk: 8,
            prefill_unit_target: Duration::from_secs(1),
            snapshot_boundaries: false,
            prefill_group_tokens: 300,
            state_snapshot_every: 4096,
        }
    }

    fn waiting(bytes: &[u64]) -> Vec<WaitingView> {
        bytes
            .iter()
            .map(|&reservation| WaitingView { reservation })
            .collect()
    }

    fn fresh(remaining: usize) -> PrefillView {
        PrefillView {
            remaining,
            written: 0,
            last_unit: 0,
        }
    }

    #[test]
    fn admits_in_order_up_to_the_batch_size() {
        let d = admit(&limits(), &KvBudget::new(None), &waiting(&[1, 1, 1, 1]), 1);
        assert_eq!(d, vec![Admission::Admit, Admission::Admit]);
    }

    #[test]
    fn waits_at_the_first_request_that_does_not_fit() {
        let mut budget = KvBudget::new(Some(100));
        let _held = budget.reserve(50);
        // 30 fits, 40 does not beside it (50 + 30 + 40 > 100), and 10 behind it waits too.
        let d = admit(&limits(), &budget, &waiting(&[30, 40, 10]), 0);
        assert_eq!(d, vec![Admission::Admit]);
    }

    #[test]
    fn refuses_what_can_never_fit_without_blocking_the_queue() {
        let budget = KvBudget::new(Some(100));
        let d = admit(&limits(), &budget, &waiting(&[500, 20]), 0);
        assert_eq!(d, vec![Admission::Refuse, Admission::Admit]);
    }

    #[test]
    fn a_long_prompt_goes_one_chunk_at_a_time() {
        let w = next_prefill(&limits(), &[fresh(250), fresh(5)], 100);
        assert_eq!(
            w,
            Some(PrefillWork::Chunk {
                index: 0,
                tokens: 100
            })
        );
    }

    #[test]
    fn a_cached_prefix_continues_alone() {
        let p = [
            PrefillView {
                remaining: 10,
                written: 40,
                last_unit: 0,
            },
            fresh(5),
        ];
        assert_eq!(
            next_prefill(&limits(), &p, 100),
            Some(PrefillWork::Chunk {
                index: 0,
                tokens: 10
            })
        );
    }

    #[test]
    fn short_fresh_prompts_are_grouped_within_the_token_budget() {
        // 3 × 90 = 270 fits in 300; adding a fourth (4 × 90) does not.
        let p = [fresh(50), fresh(90), fresh(0), fresh(20), fresh(30)];
        assert_eq!(
            next_prefill(&limits(), &p, 100),
            Some(PrefillWork::Group {
                indices: vec![0, 1, 3]
            })
        );
    }

    #[test]
    fn nothing_to_prefill() {
        assert_eq!(next_prefill(&limits(), &[fresh(0)], 100), None);
        assert_eq!(next_prefill(&limits(), &[], 100), None);
    }

    /// Runs the scheduler's prefill plan over `views` the way the executor applies it, and
    /// returns the unit number at which each sequence finished its prompt.
    fn finish_order(views: &mut [PrefillView], budget: usize) -> Vec<u64> {
        let mut done = vec![0; views.len()];
        let mut unit = 0;
        while let Some(work) = next_prefill(&limits(), views, budget) {
            unit += 1;
            let served: Vec<(usize, usize)> = match work {
                PrefillWork::Chunk { index, tokens } => vec![(index, tokens)],
                PrefillWork::Group { indices } => indices
                    .into_iter()
                    .map(|i| (i, views[i].remaining))
                    .collect(),
            };
            for (i, tokens) in served {
                let v = &mut views[i];
                v.remaining -= tokens;
                v.written += tokens;
                v.last_unit = unit;
                if v.remaining == 0 {
                    done[i] = unit;
                }
            }
            assert!(unit < 1000, "the plan does not end");
        }
        done
    }

    #[test]
    fn a_short_prompt_is_prefilled_between_a_long_prompts_chunks() {
        // The long prompt (admitted first) has had its first chunk; a short one arrives.
        let mut views = [
            PrefillView {
                remaining: 900,
                written: 100,
                last_unit: 1,
            },
            fresh(30),
        ];
        let done = finish_order(&mut views, 100);
        assert_eq!(
            done[1], 1,
            "the short prompt goes at the next chunk boundary"
        );
        assert_eq!(done[0], 10, "the long one then runs its nine chunks");
    }

    #[test]
    fn long_prompts_take_turns_and_short_ones_go_between() {
        let mut views = [fresh(300), fresh(300), fresh(300), fresh(20)];
        let done = finish_order(&mut views, 100);
        // Units: L0 L1 L2 S L0 L1 L2 L0 L1 L2 (each long prompt's first chunk before any
        // second chunk, the short prompt right after the first round).
        assert_eq!(done, vec![8, 9, 10, 4]);
    }

    #[test]
    fn the_chunk_budget_follows_the_measured_speed() {
        let l = limits();
        assert_eq!(
            chunk_budget(&l, None),
            100,
            "no measure yet: the full chunk"
        );
        assert_eq!(chunk_budget(&l, Some(1e6)), 100, "fast: the full chunk");
        // 40 tokens fit in the 1 s target: 32, a power of two.
        assert_eq!(chunk_budget(&l, Some(40.0)), 32);
        assert_eq!(chunk_budget(&l, Some(0.5)), 8, "never below the minimum");
        assert_eq!(chunk_budget(&l, Some(f64::NAN)), 100);
    }

    #[test]
    fn a_small_budget_bounds_chunks_and_groups() {
        let w = next_prefill(&limits(), &[fresh(250)], 16);
        assert_eq!(
            w,
            Some(PrefillWork::Chunk {
                index: 0,
                tokens: 16
            })
        );
        // Groups scale with the budget: 300 × 16 / 100 = 48 tokens, so three rows of 12 fit,
        // and of 16 three (48) but not four (64).
        let p = [fresh(12), fresh(12), fresh(12)];
        assert_eq!(
            next_prefill(&limits(), &p, 16),
            Some(PrefillWork::Group {
                indices: vec![0, 1, 2]
            })
        );
        let p = [fresh(16), fresh(16), fresh(16), fresh(16)];
        assert_eq!(
            next_prefill(&limits(), &p, 16),
            Some(PrefillWork::Group {
                indices: vec![0, 1, 2]
            })
        );
    }

    #[test]
    fn recurrent_chunks_end_at_snapshot_boundaries() {
        let l = SchedulerLimits {
            snapshot_boundaries: true,
            state_snapshot_every: 64,
            ..limits()
        };
        // Resuming from a prompt-end snapshot at 37: the chunk stops at 64.
        let p = [PrefillView {
            remaining: 200,
            written: 37,
            last_unit: 0,
        }];
        assert_eq!(
            next_prefill(&l, &p, 100),
            Some(PrefillWork::Chunk {
                index: 0,
                tokens: 27
            })
        );
    }
}
