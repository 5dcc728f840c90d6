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
//! Pure bookkeeping over counts; the batch asks [`Acceptance::is_drafting`] for each row.

/// Below this share of accepted drafts a row stops drafting. With `q` = 3 drafts a pass
/// yields `(1 - a⁴) / (1 - a)` tokens at acceptance `a`: about 1.4 at 0.3, roughly what a
/// draft model and the lost pipelining cost.
pub const MIN_ACCEPTANCE: f32 = 0.3;
/// Drafts (or empty lookups) a row is judged on at the least.
pub const MIN_TRIAL: f32 = 8.0;
/// Past this many drafts in the record, old counts weigh half: the record follows the
/// recent text.
pub const WINDOW: f32 = 32.0;
/// Steps a row that stopped drafting waits before it first tries again.
pub const PAUSE_STEPS: u32 = 32;
/// The longest pause.
pub const MAX_PAUSE_STEPS: u32 = 1024;

/// One row's recent drafting record.
#[derive(Debug, Clone, PartialEq)]
pub struct Acceptance {
    drafted: f32,
    accepted: f32,
    /// Steps since the row stopped drafting.
    paused: u32,
    /// The length of the row's next pause.
    pause: u32,
}

impl Default for Acceptance {
    fn default() -> Self {
        Self {
            drafted: 0.0,
            accepted: 0.0,
            paused: 0,
            pause: PAUSE_STEPS,
        }
    }
}

impl Acceptance {
    /// Whether the row should be given drafts this step.
    pub fn is_drafting(&self) -> bool {
        self.drafted < MIN_TRIAL || self.accepted >= MIN_ACCEPTANCE * self.drafted
    }

    /// One decode step passed (whatever the batch ran): a paused row counts towards its retry.
    pub fn tick(&mut self) {
        if self.is_drafting() {
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

    /// A verification of `drafted` drafts accepted `accepted` of them. A lookup that found
    /// nothing counts as one rejected draft: it cost the pipelined step and brought nothing.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        self.drafted += drafted.max(1) as f32;
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
    fn empty_lookups_count_as_misses() {
        let mut a = Acceptance::default();
        for _ in 0..8 {
            a.record(0, 0);
        }
        assert!(!a.is_drafting());
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
}
