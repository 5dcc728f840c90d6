//! Scheduling policy as pure functions over a snapshot, with no MLX in it: which waiting
//! requests to admit, and which prefill work runs in the next step.
//!
//! Admission is first come, first served: a request waits while the batch is full
//! (`max_batch_size` counts sequences prefilling and decoding) or while its KV reservation
//! does not fit beside the others'; a request larger than the whole budget is refused at once
//! rather than left to block the queue.
//!
//! Each step runs one prefill unit beside the decode step, so a long prompt delays running
//! streams by at most one chunk. A unit is either one chunk (at most `prefill_chunk` tokens)
//! of the oldest prompt — when that prompt is long or continues a cached prefix — or a group of
//! short fresh prompts padded on the left into one forward pass, so that a burst of new
//! requests gets its first tokens together instead of one step apart.
use crate::cache::KvBudget;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerLimits {
    pub max_batch_size: usize,
    /// Most prompt tokens of one sequence per prefill forward pass.
    pub prefill_chunk: usize,
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

/// Picks the next prefill unit among sequences still prefilling (in admission order); `None`
/// when none has tokens left.
pub fn next_prefill(limits: &SchedulerLimits, prefilling: &[PrefillView]) -> Option<PrefillWork> {
    let (first, head) = prefilling
        .iter()
        .enumerate()
        .find(|(_, p)| p.remaining > 0)?;
    let groupable =
        |p: &PrefillView| p.written == 0 && p.remaining > 0 && p.remaining <= limits.prefill_chunk;
    if !groupable(head) {
        return Some(PrefillWork::Chunk {
            index: first,
            tokens: head.remaining.min(limits.prefill_chunk),
        });
    }
    let mut indices = vec![first];
    let mut longest = head.remaining;
    for (i, p) in prefilling.iter().enumerate().skip(first + 1) {
        if !groupable(p) {
            continue;
        }
        let padded = longest.max(p.remaining);
        if (indices.len() + 1) * padded > limits.prefill_group_tokens {
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
        let w = next_prefill(&limits(), &[fresh(250), fresh(5)]);
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
            },
            fresh(5),
        ];
        assert_eq!(
            next_prefill(&limits(), &p),
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
            next_prefill(&limits(), &p),
            Some(PrefillWork::Group {
                indices: vec![0, 1, 3]
            })
        );
    }

    #[test]
    fn nothing_to_prefill() {
        assert_eq!(next_prefill(&limits(), &[fresh(0)]), None);
        assert_eq!(next_prefill(&limits(), &[]), None);
    }
}
