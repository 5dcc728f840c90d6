//! Scheduling policy as pure functions over a snapshot, with no MLX in it: which waiting
//! requests to admit, and which prefill work runs in the next step.
//!
//! Admission is first come, first served: a request waits while the batch is full
//! (`max_batch_size` counts sequences prefilling and decoding) or while its KV reservation
//! does not fit beside the others'; a request larger than the whole budget is refused at once
//! rather than left to block the queue.
//!
//! Each step runs the decode step and, beside it, prefill passes that hold together at most the
//! step's token budget ([`step_budget`]: `prefill_step_tokens`, padding included), so a burst
//! of new requests is prefilled in the step it arrives in rather than one prompt or one small
//! group per step, and running streams wait at most one budget's worth of prefill per token.
//! A pass is either one chunk of one prompt — when that prompt is long or continues a cached
//! prefix — or a group of short fresh prompts padded on the left into one forward pass (no
//! padding, so the plain kernels, when they are of one length), so that they get their first
//! tokens together.
//!
//! Prompts take turns: the budget goes first to the prompt served least recently (a prompt
//! never served first, then in admission order) and what is left to those after it, so a short
//! prompt admitted behind a long one is prefilled at the long one's next chunk boundary (or in
//! the same step, when both fit) instead of after its last chunk, and long prompts share the
//! steps round-robin.
//!
//! A chunk holds at most [`chunk_budget`] tokens: `prefill_chunk` on a fast device, fewer
//! where the measured prefill speed would make it outlast `prefill_unit_target`; the step's
//! budget shrinks the same way. A chunk is the unit of cancellation (a prompt whose client left
//! is dropped between two steps) and of interleaving, so on a slow device (a CPU) both come
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
    /// Most prompt tokens (rows × padded length) of all prefill passes of one step.
    pub prefill_step_tokens: usize,
    /// A group's padded length is a multiple of this ([`padded_length`]).
    pub prefill_pad_to: usize,
    /// Prompt tokens between two snapshots of a recurrent state (see
    /// [`RuntimeLimits::state_snapshot_every`](super::RuntimeLimits::state_snapshot_every)).
    pub state_snapshot_every: usize,
    /// Whether the pass that ends a prompt runs its last token and samples the first token
    /// ([`super::first_token`]); otherwise the last token runs in the row's first decode step
    /// (mlx-lm's order). See [`super::RuntimeLimits::first_token_from_prefill`].
    pub first_token_from_prefill: bool,
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
    /// Prompt tokens still to run before decoding, its last token included.
    pub remaining: usize,
    /// Positions already in its cache (a prefix-cache hit or earlier chunks).
    pub written: usize,
    /// The unit number of its last prefill work; 0 while it has had none.
    pub last_unit: u64,
    /// Positions of its cache it may write again: all of them when its cache can be cut back
    /// (one row of attention keys and values, `LayerCache::rewindable`), else 0. A continued
    /// prompt re-feeds cached tokens to take the length of a group of continued prompts.
    pub rewind: usize,
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

/// Which prompts share a group pass (see [`PrefillWork::Group`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Grouping {
    Fresh,
    Continued,
}

/// One forward pass of a step's prefill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrefillWork {
    /// The next `tokens` prompt tokens of sequence `index`.
    Chunk { index: usize, tokens: usize },
    /// All remaining prompt tokens of these sequences in one pass of the group's padded
    /// length: either all fresh, each padded on the left, or all continuing a cache, each
    /// re-feeding the cached tokens just before its remainder (the same keys and values
    /// again) up to that length, so that the pass has no padding.
    Group { indices: Vec<usize> },
}

impl PrefillWork {
    /// Tokens the pass runs, padding included (what it takes of the step's budget); a group's
    /// rows are padded to `pad_to` ([`padded_length`]).
    pub fn tokens(&self, prefilling: &[PrefillView], pad_to: usize) -> usize {
        match self {
            PrefillWork::Chunk { tokens, .. } => *tokens,
            PrefillWork::Group { indices } => {
                let longest = indices.iter().map(|&i| prefilling[i].remaining).max();
                indices.len() * padded_length(longest.unwrap_or(0), pad_to)
            }
        }
    }
}

/// The length a group of prompts whose longest has `longest` tokens is padded to: the next
/// multiple of `pad_to`. On a GPU each pass shape never run before costs a build of its
/// kernels (45-65 ms on an H100 whichever dimension changed, `scripts/bench/pass_shapes.py`),
/// so that bursts of prompts of nearby lengths share a few shapes.
pub fn padded_length(longest: usize, pad_to: usize) -> usize {
    longest.div_ceil(pad_to.max(1)) * pad_to.max(1)
}

/// Rounds `fits` tokens (what runs within the unit target at the measured speed) down to a
/// power of two, within `min..=most`: few distinct shapes.
fn speed_bound(fits: f64, min: usize, most: usize) -> usize {
    let most = most.max(1);
    if fits >= most as f64 {
        return most;
    }
    let fits = fits.max(0.0) as usize;
    let rounded = if fits == 0 {
        0
    } else {
        1 << (usize::BITS - 1 - fits.leading_zeros())
    };
    rounded.max(min.clamp(1, most)).min(most)
}

/// Most prompt tokens of a chunk before the device's prefill speed is measured. A fresh engine
/// knows nothing of its device: a first chunk of a full `prefill_chunk` (2 048 tokens) on a
/// slow CPU ran for tens of seconds, long past `prefill_unit_target`, with no chance to cancel
/// it or to prefill a short prompt beside it. A chunk this size measures the device at a
/// cost of a step or two on a fast one (on a GPU the first step of a new shape does not count,
/// so the second does), and later chunks are sized from the figure. Prompts that fit in one
/// chunk, and the step's budget for groups of them, are not held back by it.
pub const PROBE_CHUNK: usize = 256;

/// The measured speed when it is a usable figure.
fn usable(tokens_per_s: Option<f64>) -> Option<f64> {
    tokens_per_s.filter(|s| s.is_finite() && *s > 0.0)
}

/// The most prompt tokens of one chunk, given the prefill speed measured so far (tokens per
/// second, `None` before a step measured it): [`PROBE_CHUNK`] until then, then
/// `prefill_chunk` where it runs within `prefill_unit_target`, else as many as run in that
/// time rounded down to a power of two (few distinct shapes), at least `min_prefill_chunk`;
/// never more than the step's budget.
pub fn chunk_budget(limits: &SchedulerLimits, tokens_per_s: Option<f64>) -> usize {
    let most = limits.prefill_chunk.max(1);
    let chunk = match usable(tokens_per_s) {
        None => most.min(PROBE_CHUNK.max(limits.min_prefill_chunk)),
        Some(speed) => speed_bound(
            speed * limits.prefill_unit_target.as_secs_f64(),
            limits.min_prefill_chunk,
            most,
        ),
    };
    chunk.min(step_budget(limits, tokens_per_s))
}

/// The most prompt tokens (padding included) of all prefill passes of one step:
/// `prefill_step_tokens` where they run within `prefill_unit_target` at the measured speed,
/// else as many as do, rounded down to a power of two, at least `min_prefill_chunk`.
pub fn step_budget(limits: &SchedulerLimits, tokens_per_s: Option<f64>) -> usize {
    let most = limits.prefill_step_tokens.max(1);
    match usable(tokens_per_s) {
        None => most,
        Some(speed) => speed_bound(
            speed * limits.prefill_unit_target.as_secs_f64(),
            limits.min_prefill_chunk,
            most,
        ),
    }
}

/// Whether a prefill step of `tokens` that took `seconds` measures the device's prefill speed,
/// given the step's `chunk` and `step` budgets. A step that filled a chunk, used at least half
/// its step budget, or took a good part of the unit target does; a small step done quickly
/// says only that the device is fast enough (its time is mostly fixed costs) and must not
/// shrink the next budgets.
///
/// "Half the step budget" is what lets a shrunk budget grow back: on a GPU the first steps of
/// a new process compile their kernels, so they measure a speed far below the device's and
/// shrink the budget; the steps that follow fill that small budget only up to a whole number
/// of rows (16 prompts of 127 tokens are 2 032 of 2 048), which is less than a chunk, and
/// without this rule no later step would ever measure again (seen on the H200: a burst of 64
/// prompts split into 4 steps for the life of the engine).
pub fn measures_speed(
    limits: &SchedulerLimits,
    chunk: usize,
    step: usize,
    tokens: usize,
    seconds: f64,
) -> bool {
    let target = limits.prefill_unit_target.as_secs_f64();
    seconds > 0.0 && (tokens >= chunk || tokens * 2 >= step || seconds >= target / 2.0)
}

/// The prefill passes of the next step, among sequences still prefilling (in admission order):
/// every prompt whose work fits in the step's `step` tokens (padding included) gets some, each
/// chunk holding at most `chunk` tokens (see [`chunk_budget`] and [`step_budget`]). Empty when
/// none has tokens left.
///
/// Prompts take turns: they are served least recently served first (a prompt never served
/// first, then in admission order), so the step's budget goes to whoever waited longest and
/// the rest to those after it; a prompt that does not fit in what is left waits for a later
/// step, where it comes first. A fresh prompt whose whole remainder fits in one chunk goes in
/// a group with the fresh prompts after it that fit beside it (padded on the left to the
/// longest, in one pass). A prompt that continues a cache and whose remainder fits in a chunk
/// groups likewise with the continued prompts after it, each re-feeding cached tokens up to
/// the group's padded length, no more than it can cut back (`rewind`) and no more than a chunk
/// for the whole group: prefix hits arriving together cost one pass, not one each. A longer
/// prompt, or one whose cache cannot be cut back, runs a chunk of its own.
pub fn plan_prefill(
    limits: &SchedulerLimits,
    prefilling: &[PrefillView],
    chunk: usize,
    step: usize,
) -> Vec<PrefillWork> {
    let chunk = chunk.clamp(1, limits.prefill_chunk.max(1));
    let mut left = step.max(chunk);
    let mut order: Vec<usize> = (0..prefilling.len())
        .filter(|&i| prefilling[i].remaining > 0)
        .collect();
    order.sort_by_key(|&i| (prefilling[i].last_unit, i));
    // Fresh prompts group with fresh ones, continued with continued ones (see `PrefillWork`).
    let group_kind = |p: &PrefillView| match (p.written, p.remaining <= chunk) {
        (_, false) => None,
        (0, true) => Some(Grouping::Fresh),
        (_, true) if p.rewind > 0 => Some(Grouping::Continued),
        _ => None,
    };
    let mut planned = vec![false; prefilling.len()];
    let mut work = Vec::new();
    for (at, &first) in order.iter().enumerate() {
        if left == 0 {
            break;
        }
        if planned[first] {
            continue;
        }
        let head = &prefilling[first];
        let Some(kind) = group_kind(head) else {
            let mut tokens = head.remaining.min(chunk).min(left);
            if limits.snapshot_boundaries {
                let every = limits.state_snapshot_every.max(1);
                tokens = tokens.min(every - head.written % every);
            }
            // A sliver of a chunk is mostly fixed costs: the prompt waits for a step where
            // it comes first instead.
            if !work.is_empty() && tokens < head.remaining.min(limits.min_prefill_chunk) {
                continue;
            }
            planned[first] = true;
            left -= tokens;
            work.push(PrefillWork::Chunk {
                index: first,
                tokens,
            });
            continue;
        };
        if head.remaining > left {
            continue;
        }
        planned[first] = true;
        let mut indices = vec![first];
        let mut longest = head.remaining;
        // The most tokens every member can run: a continued prompt no more than its remainder
        // and what it may re-feed.
        let reach = |p: &PrefillView| match kind {
            Grouping::Fresh => usize::MAX,
            Grouping::Continued => p.remaining + p.rewind,
        };
        let mut least_reach = reach(head);
        let mut real = head.remaining;
        for &i in &order[at + 1..] {
            let p = &prefilling[i];
            if planned[i] || group_kind(p) != Some(kind) {
                continue;
            }
            let padded = padded_length(longest.max(p.remaining), limits.prefill_pad_to);
            let pass = (indices.len() + 1) * padded;
            if pass > left || padded > least_reach.min(reach(p)) {
                continue;
            }
            // Re-fed tokens are work a pass of its own would not do: a continued group re-feeds
            // at most one chunk's worth (a hit with a long remainder beside many short ones
            // would otherwise make each re-feed nearly all of it).
            if kind == Grouping::Continued && pass - (real + p.remaining) > chunk {
                continue;
            }
            real += p.remaining;
            longest = longest.max(p.remaining);
            least_reach = least_reach.min(reach(p));
            planned[i] = true;
            indices.push(i);
        }
        left -= match indices.len() {
            1 => longest,
            n => n * padded_length(longest, limits.prefill_pad_to),
        };
        work.push(if indices.len() == 1 {
            PrefillWork::Chunk {
                index: first,
                tokens: head.remaining,
            }
        } else {
            PrefillWork::Group { indices }
        });
    }
    work
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chunks of at most 100 tokens, 300 tokens a step.
    fn limits() -> SchedulerLimits {
        SchedulerLimits {
            max_batch_size: 3,
            prefill_chunk: 100,
            min_prefill_chunk: 8,
            prefill_unit_target: Duration::from_secs(1),
            snapshot_boundaries: false,
            prefill_step_tokens: 300,
            prefill_pad_to: 1,
            state_snapshot_every: 4096,
            first_token_from_prefill: false,
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
            rewind: 0,
        }
    }

    fn plan(views: &[PrefillView], chunk: usize, step: usize) -> Vec<PrefillWork> {
        plan_prefill(&limits(), views, chunk, step)
    }

    fn chunk(index: usize, tokens: usize) -> PrefillWork {
        PrefillWork::Chunk { index, tokens }
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
    fn a_long_prompt_goes_one_chunk_at_a_time_and_a_short_one_beside_it() {
        assert_eq!(
            plan(&[fresh(250), fresh(5)], 100, 300),
            vec![chunk(0, 100), chunk(1, 5)]
        );
        // A step of one chunk: the short prompt comes first at the next step.
        assert_eq!(plan(&[fresh(250), fresh(5)], 100, 100), vec![chunk(0, 100)]);
    }

    #[test]
    fn a_cached_prefix_continues_in_a_chunk_of_its_own() {
        let p = [
            PrefillView {
                remaining: 10,
                written: 40,
                last_unit: 0,
                rewind: 0,
            },
            fresh(5),
            fresh(7),
        ];
        assert_eq!(
            plan(&p, 100, 300),
            vec![
                chunk(0, 10),
                PrefillWork::Group {
                    indices: vec![1, 2]
                }
            ]
        );
    }

    /// A prompt continuing a cache of `written` positions it can all cut back.
    fn continued(remaining: usize, written: usize) -> PrefillView {
        PrefillView {
            remaining,
            written,
            last_unit: 0,
            rewind: written,
        }
    }

    #[test]
    fn continued_prompts_group_with_continued_ones_only() {
        let p = [
            continued(2, 40),
            fresh(4),
            continued(9, 30),
            fresh(6),
            continued(5, 50),
        ];
        assert_eq!(
            plan(&p, 100, 300),
            vec![
                PrefillWork::Group {
                    indices: vec![0, 2, 4]
                },
                PrefillWork::Group {
                    indices: vec![1, 3]
                },
            ]
        );
        // The group takes 3 × 9 tokens of the step's budget: its rows re-feed up to 9 each.
        assert_eq!(plan(&p, 100, 300)[0].tokens(&p, 1), 27);
    }

    #[test]
    fn a_continued_prompt_joins_a_group_only_within_what_it_can_re_feed() {
        // The second of each runs on its own: holding 3 positions, with its 2 left it reaches
        // 5, short of the group's 9; or its cache cannot be cut back at all.
        let mut fixed = continued(2, 40);
        fixed.rewind = 0;
        for second in [continued(2, 3), fixed] {
            let p = [continued(9, 40), second, continued(7, 40)];
            assert_eq!(
                plan(&p, 100, 300),
                vec![
                    PrefillWork::Group {
                        indices: vec![0, 2]
                    },
                    chunk(1, 2)
                ]
            );
        }
        // The group re-feeds at most a chunk (100): beside a remainder of 90, one of 5 re-feeds
        // 85; a second would bring it to 170, so the short ones group on their own.
        let p = [
            continued(90, 400),
            continued(5, 400),
            continued(5, 400),
            continued(5, 400),
        ];
        assert_eq!(
            plan(&p, 100, 300),
            vec![
                PrefillWork::Group {
                    indices: vec![0, 1]
                },
                PrefillWork::Group {
                    indices: vec![2, 3]
                }
            ]
        );
        // A remainder longer than a chunk runs in chunks, not in a group.
        let p = [continued(150, 40), continued(7, 40)];
        assert_eq!(plan(&p, 100, 300), vec![chunk(0, 100), chunk(1, 7)]);
    }

    #[test]
    fn short_fresh_prompts_are_grouped_within_the_step_budget() {
        // 3 × 90 = 270 fits in 300; a fourth (4 × 90) does not, and runs in the 30 left.
        let p = [fresh(50), fresh(90), fresh(0), fresh(20), fresh(30)];
        assert_eq!(
            plan(&p, 100, 300),
            vec![
                PrefillWork::Group {
                    indices: vec![0, 1, 3]
                },
                chunk(4, 30)
            ]
        );
    }

    #[test]
    fn every_prompt_that_fits_the_budget_is_prefilled_in_one_step() {
        let p = vec![fresh(20); 15];
        assert_eq!(
            plan(&p, 100, 300),
            vec![PrefillWork::Group {
                indices: (0..15).collect()
            }]
        );
        // A sixteenth waits for the next step, where it comes first.
        let p = vec![fresh(20); 16];
        let w = plan(&p, 100, 300);
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].tokens(&p, 1), 300);
    }

    #[test]
    fn a_long_prompt_and_a_group_share_a_step() {
        let p = [fresh(250), fresh(10), fresh(90)];
        assert_eq!(
            plan(&p, 100, 300),
            vec![
                chunk(0, 100),
                PrefillWork::Group {
                    indices: vec![1, 2]
                }
            ]
        );
    }

    #[test]
    fn no_sliver_of_a_chunk_after_the_budget_is_nearly_spent() {
        assert_eq!(
            plan(&[fresh(250), fresh(250)], 100, 105),
            vec![chunk(0, 100)]
        );
        // The first unit of a step always runs, whatever the budget.
        assert_eq!(plan(&[fresh(250)], 100, 1), vec![chunk(0, 100)]);
    }

    #[test]
    fn groups_are_padded_to_a_multiple_and_the_padding_counts_against_the_step() {
        let l = SchedulerLimits {
            prefill_pad_to: 32,
            ..limits()
        };
        assert_eq!(padded_length(33, 32), 64);
        assert_eq!(padded_length(64, 32), 64);
        assert_eq!(padded_length(5, 1), 5);
        // Three prompts of up to 40 tokens: 3 × 64 = 192 of 300.
        let views = [fresh(40), fresh(35), fresh(3)];
        let work = plan_prefill(&l, &views, 100, 300);
        assert_eq!(
            work,
            vec![PrefillWork::Group {
                indices: vec![0, 1, 2]
            }]
        );
        assert_eq!(work[0].tokens(&views, 32), 192);
        // A step of 150: two rows padded to 64 fit (128), a third does not (192) and runs
        // alone in what is left; unpadded the three are one group (120).
        assert_eq!(
            plan_prefill(&l, &views, 100, 150),
            vec![
                PrefillWork::Group {
                    indices: vec![0, 1]
                },
                chunk(2, 3)
            ]
        );
        assert_eq!(
            plan(&views, 100, 150),
            vec![PrefillWork::Group {
                indices: vec![0, 1, 2]
            }]
        );
        // A prompt alone is a chunk of its own length: nothing to pad it beside.
        assert_eq!(plan_prefill(&l, &[fresh(40)], 100, 300), vec![chunk(0, 40)]);
    }

    #[test]
    fn nothing_to_prefill() {
        assert!(plan(&[fresh(0)], 100, 300).is_empty());
        assert!(plan(&[], 100, 300).is_empty());
    }

    /// Runs the scheduler's plans over `views` the way the executor applies them, checking
    /// each step against the budget; returns the step at which each sequence finished its
    /// prompt.
    fn finish_order(views: &mut [PrefillView], chunk: usize, step: usize) -> Vec<u64> {
        let mut done = vec![0; views.len()];
        let mut unit = 0;
        loop {
            let work = plan(views, chunk, step);
            if work.is_empty() {
                break;
            }
            unit += 1;
            let spent: usize = work.iter().map(|w| w.tokens(views, 1)).sum();
            assert!(
                spent <= step.max(chunk),
                "step {unit} spent {spent} of {step}"
            );
            let mut served = Vec::new();
            for w in work {
                match w {
                    PrefillWork::Chunk { index, tokens } => {
                        assert!(tokens <= chunk);
                        served.push((index, tokens));
                    }
                    PrefillWork::Group { indices } => {
                        let fresh = views[indices[0]].written == 0;
                        let longest = indices.iter().map(|&i| views[i].remaining).max();
                        let refed: usize = indices
                            .iter()
                            .map(|&i| longest.unwrap_or(0) - views[i].remaining)
                            .sum();
                        assert!(fresh || refed <= chunk, "a group re-fed {refed} tokens");
                        for i in indices {
                            let v = &views[i];
                            if fresh {
                                assert_eq!(v.written, 0, "a fresh group holds fresh prompts");
                            } else {
                                assert!(v.written > 0, "a continued group holds no fresh one");
                                assert!(
                                    longest.unwrap_or(0) <= v.remaining + v.rewind,
                                    "a continued prompt grouped past what it can re-feed"
                                );
                            }
                            served.push((i, v.remaining));
                        }
                    }
                }
            }
            let mut seen: Vec<usize> = served.iter().map(|s| s.0).collect();
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen.len(), served.len(), "a prompt twice in one step");
            for (i, tokens) in served {
                let v = &mut views[i];
                // A fresh prompt's cache, or one that could be cut back, still can.
                let cuttable = v.written == 0 || v.rewind > 0;
                v.remaining -= tokens;
                v.written += tokens;
                v.rewind = if cuttable { v.written } else { 0 };
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
    fn a_short_prompt_is_prefilled_at_the_next_step_of_a_long_prompt() {
        // The long prompt (admitted first) has had its first chunk; a short one arrives.
        let mut views = [
            PrefillView {
                remaining: 900,
                written: 100,
                last_unit: 1,
                rewind: 0,
            },
            fresh(30),
        ];
        let done = finish_order(&mut views, 100, 100);
        assert_eq!(done[1], 1, "the short prompt goes first");
        // The long one takes the 70 tokens left that step, then nine more steps.
        assert_eq!(done[0], 10);
    }

    #[test]
    fn long_prompts_take_turns_and_short_ones_go_between() {
        let mut views = [fresh(300), fresh(300), fresh(300), fresh(20)];
        let done = finish_order(&mut views, 100, 100);
        // Steps: L0 L1 L2, then the short prompt first (with 80 of L0 beside it), then the
        // long ones round-robin: each long prompt's first chunk before any second chunk.
        assert_eq!(done[3], 4);
        assert_eq!(done, vec![10, 8, 9, 4]);
        // A step of three chunks serves them all at once.
        let mut views = [fresh(300), fresh(300), fresh(300), fresh(20)];
        let done = finish_order(&mut views, 100, 300);
        assert_eq!(done[3], 2, "the short prompt goes in the second step");
        assert!(done[..3].iter().all(|&d| d <= 4), "{done:?}");
    }

    #[test]
    fn a_random_mix_respects_the_budget_and_finishes() {
        // Linear congruential lengths and prefix hits, every plan checked by finish_order.
        let mut x: u64 = 7;
        for (chunk, step) in [(100, 300), (100, 100), (16, 48), (64, 1000)] {
            let mut views: Vec<PrefillView> = (0..40)
                .map(|_| {
                    x = (x * 1103515245 + 12345) % (1 << 31);
                    let remaining = (x % 400) as usize;
                    let written = if x.is_multiple_of(3) {
                        (x % 50) as usize
                    } else {
                        0
                    };
                    // Half of the hits' caches can be cut back.
                    let rewind = if x.is_multiple_of(2) { written } else { 0 };
                    PrefillView {
                        remaining,
                        written,
                        last_unit: 0,
                        rewind,
                    }
                })
                .collect();
            let had_work: Vec<bool> = views.iter().map(|v| v.remaining > 0).collect();
            let done = finish_order(&mut views, chunk, step);
            assert!(views.iter().all(|v| v.remaining == 0));
            for (i, (&d, &had)) in done.iter().zip(&had_work).enumerate() {
                assert_eq!(d > 0, had, "prompt {i} ({chunk}, {step})");
            }
        }
    }

    #[test]
    fn the_budgets_follow_the_measured_speed() {
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
        // A fresh engine's first chunk is a probe, whatever the configured chunk.
        let long = SchedulerLimits {
            prefill_chunk: 2048,
            prefill_step_tokens: 4096,
            ..limits()
        };
        assert_eq!(chunk_budget(&long, None), PROBE_CHUNK);
        assert_eq!(
            chunk_budget(&long, Some(1e6)),
            2048,
            "measured fast: the full chunk"
        );
        assert_eq!(
            step_budget(&long, None),
            4096,
            "groups of short prompts: the full step"
        );
        assert_eq!(step_budget(&l, None), 300);
        assert_eq!(step_budget(&l, Some(1e6)), 300);
        assert_eq!(step_budget(&l, Some(200.0)), 128);
        assert_eq!(step_budget(&l, Some(0.5)), 8);
        // A chunk never holds more than a step.
        let small = SchedulerLimits {
            prefill_step_tokens: 50,
            ..limits()
        };
        assert_eq!(chunk_budget(&small, None), 50);
    }

    #[test]
    fn a_shrunk_budget_grows_back_once_a_step_fills_it() {
        let l = limits(); // 1 s target
                          // A cold first step (kernels compiling) measured a slow device: the budgets shrank.
        let slow = Some(90.0);
        let (chunk, step) = (chunk_budget(&l, slow), step_budget(&l, slow));
        assert!(step < l.prefill_step_tokens);
        // The next step fills that budget to a whole number of rows, short of a chunk, and
        // runs fast: it measures, so the budgets grow back.
        let tokens = step - step / 16;
        assert_eq!((chunk, step), (64, 64));
        assert!(
            tokens < chunk,
            "short of a chunk: the old rule never measured it"
        );
        assert!(measures_speed(&l, chunk, step, tokens, 0.005));
        let fast = Some(tokens as f64 / 0.005);
        assert_eq!(step_budget(&l, fast), l.prefill_step_tokens);
        // A small step done quickly (one short prompt) does not measure.
        assert!(!measures_speed(&l, 100, 300, 20, 0.005));
        // A step that took half the target does, however small.
        assert!(measures_speed(&l, 100, 300, 20, 0.6));
        assert!(!measures_speed(&l, 100, 300, 300, 0.0));
    }

    #[test]
    fn a_small_budget_bounds_chunks_and_groups() {
        assert_eq!(plan(&[fresh(250)], 16, 16), vec![chunk(0, 16)]);
        // Three rows of 12 fit in 48 tokens; of 16, three (48) but not four (64).
        let p = [fresh(12), fresh(12), fresh(12)];
        assert_eq!(
            plan(&p, 16, 48),
            vec![PrefillWork::Group {
                indices: vec![0, 1, 2]
            }]
        );
        let p = [fresh(16), fresh(16), fresh(16), fresh(16)];
        assert_eq!(
            plan(&p, 16, 48),
            vec![PrefillWork::Group {
                indices: vec![0, 1, 2]
            }]
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
            rewind: 0,
        }];
        assert_eq!(plan_prefill(&l, &p, 100, 300), vec![chunk(0, 27)]);
    }
}
