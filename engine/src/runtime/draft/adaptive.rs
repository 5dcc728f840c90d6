//! When a row stops drafting: speculative decoding pays for every draft (a draft model's
//! forward passes, a wider verification pass, and a synchronous step instead of the pipelined
//! one), and only accepted drafts pay back. A row whose recent drafts are mostly rejected —
//! or whose n-gram lookup keeps finding nothing — gets none for a while, and a batch in which
//! no row drafts takes the pipelined step. After a pause the row tries again, since a text can
//! move into a part that repeats its input. A retry is on probation: one rejected pass pauses
//! the row again, for twice as long (up to [`MAX_PAUSE_STEPS`]), so a row whose drafts never
//! pay costs ever fewer passes; a pass that accepts half its drafts or more restores the
//! first pause length.
//!
//! Prompt lookup needs no retries: its drafts can be judged without drafting, by replaying
//! lookups over the tokens the row emits anyway ([`ShadowLookup`](super::ngram::ShadowLookup)).
//! Such a row's record is kept from those replays while it does not draft, and it drafts only
//! once the record is judged and good ([`Trial::Shadow`]), and only at steps where its lookup
//! finds something.
//!
//! Pure bookkeeping over counts; the batch asks [`Acceptance::is_drafting`] for each row.

use super::ngram::{NgramSizes, ShadowLookup};

/// Below this share of accepted drafts a row stops drafting. With `q` = 3 drafts a pass
/// yields `(1 - a⁴) / (1 - a)` tokens at acceptance `a`: about 1.4 at 0.3, roughly what a
/// draft model and the lost pipelining cost.
pub const MIN_ACCEPTANCE: f32 = 0.3;
/// Drafts a row is judged on at the least.
pub const MIN_TRIAL: f32 = 8.0;
/// Replayed drafts a shadowed row is judged on at the least: one full lookup. Replays cost
/// nothing and real passes soon correct a lucky start, while a copied span that waits for
/// eight drafts is half over before drafting begins.
pub const MIN_SHADOW_TRIAL: f32 = 3.0;
/// Past this many drafts in the record, old counts weigh half: the record follows the
/// recent text.
pub const WINDOW: f32 = 32.0;
/// Steps a row that stopped drafting waits before it first tries again.
pub const PAUSE_STEPS: u32 = 32;
/// The longest pause.
pub const MAX_PAUSE_STEPS: u32 = 1024;

/// How a row's record is first made and, once drafting stopped, renewed.
#[derive(Debug, Clone, PartialEq)]
enum Trial {
    /// By drafting (a draft model, whose drafts cost its passes to know): a new row drafts
    /// until judged, and a paused one tries again on probation.
    Retry,
    /// By replayed lookups while the row does not draft: it drafts only while its record is
    /// judged and good.
    Shadow(ShadowLookup),
}

/// One row's recent drafting record.
#[derive(Debug, Clone, PartialEq)]
pub struct Acceptance {
    trial: Trial,
    drafted: f32,
    accepted: f32,
    /// Steps since the row stopped drafting.
    paused: u32,
    /// The length of the row's next pause.
    pause: u32,
}

impl Default for Acceptance {
    fn default() -> Self {
        Self::new(Trial::Retry)
    }
}

impl Acceptance {
    /// The record of a prompt-lookup row whose text is `at` tokens long, kept by replayed
    /// lookups while it does not draft.
    pub fn shadowed(at: usize) -> Self {
        Self::new(Trial::Shadow(ShadowLookup::new(at)))
    }

    fn new(trial: Trial) -> Self {
        Self {
            trial,
            drafted: 0.0,
            accepted: 0.0,
            paused: 0,
            pause: PAUSE_STEPS,
        }
    }

    /// Whether the row should be given drafts this step.
    pub fn is_drafting(&self) -> bool {
        let good = self.accepted >= MIN_ACCEPTANCE * self.drafted;
        match self.trial {
            Trial::Retry => self.drafted < MIN_TRIAL || good,
            Trial::Shadow(_) => self.drafted >= MIN_SHADOW_TRIAL && good,
        }
    }

    /// One decode step passed (whatever the batch ran): a paused row counts towards its retry.
    pub fn tick(&mut self) {
        if matches!(self.trial, Trial::Shadow(_)) || self.is_drafting() {
            return;
        }
        self.paused += 1;
        if self.paused >= self.pause {
            // Probation: one trial short of judged, at the threshold.
            self.drafted = MIN_TRIAL - 1.0;
            self.accepted = MIN_ACCEPTANCE * self.drafted;
            self.paused = 0;
            self.pause = (self.pause * 2).min(MAX_PAUSE_STEPS);
        }
    }

    /// A verification pass of `drafted` drafts accepted `accepted` of them, and left the
    /// row's text `at` tokens long: a shadowed row's replaying resumes there.
    pub fn verified(&mut self, drafted: usize, accepted: usize, at: usize) {
        self.record(drafted, accepted);
        if let Trial::Shadow(shadow) = &mut self.trial {
            shadow.restart(at);
        }
    }

    /// Settles a shadowed row's replayed lookups of `k` drafts against its text `tokens`,
    /// into the record.
    pub fn replay(&mut self, tokens: &[u32], sizes: NgramSizes, k: usize) {
        let verdicts = match &mut self.trial {
            Trial::Shadow(shadow) => shadow.observe(tokens, sizes, k),
            Trial::Retry => return,
        };
        for (drafted, accepted) in verdicts {
            self.record(drafted, accepted);
        }
    }

    /// `drafted` drafts were, or would have been, accepted `accepted` times.
    fn record(&mut self, drafted: usize, accepted: usize) {
        self.drafted += drafted as f32;
        self.accepted += accepted as f32;
        if drafted > 0 && 2 * accepted >= drafted {
            self.pause = PAUSE_STEPS;
        }
        if self.drafted > WINDOW {
            self.drafted /= 2.0;
            self.accepted /= 2.0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_row_drafts_until_its_trial_says_otherwise() {
        let mut a = Acceptance::default();
        for _ in 0..2 {
            a.record(3, 0);
            assert!(a.is_drafting(), "judged before the trial: {a:?}");
        }
        a.record(3, 0);
        assert!(!a.is_drafting());
    }

    #[test]
    fn good_acceptance_keeps_drafting_and_a_bad_stretch_stops_it() {
        let mut a = Acceptance::default();
        for _ in 0..40 {
            a.record(3, 3);
            assert!(a.is_drafting());
        }
        // The window forgets the good past: a run of rejections stops drafting soon.
        let mut steps = 0;
        while a.is_drafting() {
            a.record(3, 0);
            steps += 1;
            assert!(steps < 20, "still drafting after {steps} rejected passes");
        }
    }

    #[test]
    fn a_paused_row_tries_again_after_the_pause() {
        let mut a = Acceptance::default();
        for _ in 0..4 {
            a.record(3, 0);
        }
        assert!(!a.is_drafting());
        for _ in 0..PAUSE_STEPS - 1 {
            a.tick();
            assert!(!a.is_drafting());
        }
        a.tick();
        assert!(a.is_drafting());
    }

    /// Steps until a paused row drafts again.
    fn pause_length(a: &mut Acceptance) -> u32 {
        let mut steps = 0;
        while !a.is_drafting() {
            a.tick();
            steps += 1;
        }
        steps
    }

    #[test]
    fn each_failed_retry_doubles_the_pause_and_a_good_pass_restores_it() {
        let mut a = Acceptance::default();
        for _ in 0..3 {
            a.record(3, 0);
        }
        let mut pauses = Vec::new();
        for _ in 0..7 {
            pauses.push(pause_length(&mut a));
            // One rejected pass on probation pauses again.
            a.record(3, 0);
            assert!(!a.is_drafting());
        }
        assert_eq!(pauses, [32, 64, 128, 256, 512, 1024, 1024]);
        pause_length(&mut a);
        // A retry that pays keeps drafting, and the next pause is the first length again.
        a.record(3, 3);
        assert!(a.is_drafting());
        for _ in 0..4 {
            a.record(3, 0);
        }
        assert_eq!(pause_length(&mut a), PAUSE_STEPS);
    }

    #[test]
    fn borderline_acceptance_is_kept() {
        let mut a = Acceptance::default();
        for _ in 0..10 {
            a.record(10, 3);
        }
        assert!(a.is_drafting(), "{a:?}");
    }

    #[test]
    fn a_shadowed_row_drafts_only_once_its_replayed_record_is_judged_good() {
        let mut a = Acceptance::shadowed(0);
        assert!(
            !a.is_drafting(),
            "a new shadowed row drafts before any record"
        );
        a.record(2, 2);
        assert!(!a.is_drafting(), "judged on 2 drafts");
        a.record(3, 0);
        assert!(a.is_drafting(), "2 of 5 is above the threshold");
        a.record(3, 0);
        assert!(!a.is_drafting(), "2 of 8 is below it");
        a.record(3, 3);
        // A bad stretch stops it, and no pause ends: only a better record restarts it.
        for _ in 0..12 {
            a.record(3, 0);
        }
        assert!(!a.is_drafting());
        for _ in 0..4 * MAX_PAUSE_STEPS {
            a.tick();
        }
        assert!(!a.is_drafting(), "a shadowed row was retried after a pause");
        let mut passes = 0;
        while !a.is_drafting() {
            a.record(3, 3);
            passes += 1;
            assert!(
                passes < 20,
                "a good replayed record never restarted drafting"
            );
        }
    }
}
