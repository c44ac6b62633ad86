//! What a step costs, as the engine measured it, and the [`Pace`] that
//! bounds the batch work a step carries while real-time work is present.
//!
//! A step's time is not one straight line in its tokens: a step of a few
//! tokens costs reading the weights (memory-bound, nearly flat), a step of
//! hundreds is bound by its multiply-adds (steeper). A single line fitted
//! over both overestimates the small steps that real-time work runs alone —
//! and so let too much batch work ride along with them. The cost is kept
//! instead as a table: recent steps' time by their tokens in power-of-two
//! buckets, each an exponentially weighted mean, read by interpolating
//! between the buckets seen.
//!
//! On models whose steps are too cheap to pace, batch work instead sits out
//! real-time-only steps for a time it [`Owed`]: its share of the last step
//! it shared, over the slack.

/// Octaves of tokens per step: `[1], [2,3], [4,7], …, [2^15, …)`.
const OCTAVES: usize = 16;
/// The most buckets an octave is split into ([`StepCost::finer`]).
const MOST_PER_OCTAVE: usize = 4;
const BUCKETS: usize = OCTAVES * MOST_PER_OCTAVE;

#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Point {
    /// Mean tokens of the bucket's recent steps.
    tokens: f64,
    /// Their mean time.
    ms: f64,
    seen: bool,
}

/// A step's measured cost by its tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct StepCost {
    points: [Point; BUCKETS],
    /// Buckets an octave of tokens is split into.
    per_octave: usize,
}

impl Default for StepCost {
    /// An octave a bucket.
    fn default() -> Self {
        StepCost {
            points: [Point::default(); BUCKETS],
            per_octave: 1,
        }
    }
}

impl StepCost {
    /// Quarter octaves a bucket (`…, [32,39], [40,47], [48,55], [56,63], …`):
    /// fine enough to tell a step from one a few rows larger.
    pub(crate) fn finer() -> Self {
        StepCost {
            per_octave: MOST_PER_OCTAVE,
            ..StepCost::default()
        }
    }

    /// How much a new step moves its bucket's means.
    const WEIGHT: f64 = 0.2;

    /// A cost of `base_ms + per_token_ms × tokens` (for tests and benchmarks).
    #[cfg(test)]
    pub(crate) fn linear(base_ms: f64, per_token_ms: f64) -> Self {
        let mut cost = StepCost::default();
        for b in 0..OCTAVES {
            let tokens = (1usize << b) as f64;
            cost.points[b] = Point {
                tokens,
                ms: base_ms + per_token_ms * tokens,
                seen: true,
            };
        }
        cost
    }

    fn bucket(&self, tokens: usize) -> usize {
        let tokens = tokens.max(1);
        let octave = (usize::BITS - 1 - tokens.leading_zeros()) as usize;
        if octave >= OCTAVES {
            return OCTAVES * self.per_octave - 1;
        }
        // The part of the octave past its start, in `per_octave` steps.
        let within = ((tokens - (1 << octave)) * self.per_octave) >> octave;
        octave * self.per_octave + within
    }

    /// Count a step of `tokens` that took `ms`.
    pub(crate) fn observe(&mut self, tokens: usize, ms: f64) {
        if tokens == 0 || !ms.is_finite() {
            return;
        }
        let p = &mut self.points[self.bucket(tokens)];
        if p.seen {
            p.tokens += Self::WEIGHT * (tokens as f64 - p.tokens);
            p.ms += Self::WEIGHT * (ms - p.ms);
        } else {
            *p = Point {
                tokens: tokens as f64,
                ms,
                seen: true,
            };
        }
    }

    /// The predicted time of a step of `tokens`, once any step was seen:
    /// between two buckets seen, on the line between them; beyond the last
    /// (or before the first), on the line through the two nearest.
    pub(crate) fn predict(&self, tokens: usize) -> Option<f64> {
        // Called a few dozen times a step: the buckets seen, gathered on the stack.
        let mut seen = [Point::default(); BUCKETS];
        let mut count = 0;
        for p in self.points.iter().filter(|p| p.seen) {
            seen[count] = *p;
            count += 1;
        }
        let x = tokens.max(1) as f64;
        let proportional = |p: &Point| p.ms * x / p.tokens.max(1.0);
        let (a, b) = match &seen[..count] {
            [] => return None,
            [only] => return Some(proportional(only)),
            points => {
                let after = points.iter().position(|p| p.tokens >= x).unwrap_or(points.len());
                let i = after.clamp(1, points.len() - 1);
                (points[i - 1], points[i])
            }
        };
        let line = if (b.tokens - a.tokens).abs() < 1e-9 {
            b.ms
        } else {
            a.ms + (b.ms - a.ms) * (x - a.tokens) / (b.tokens - a.tokens)
        };
        // Outside the buckets seen, a line may head below zero: a step costs
        // at least its share of a larger one's time (a step's time per token
        // only falls as it grows), and no less than a smaller one's.
        let floor = if x < a.tokens {
            proportional(&a)
        } else if x > b.tokens {
            b.ms
        } else {
            0.0
        };
        Some(line.max(floor).max(0.0))
    }

    /// The predicted time of a step of `tokens`: from this table up to the
    /// largest step it has seen, and beyond it that step's time plus what
    /// `wider` (a table of more kinds of steps) predicts the further tokens
    /// add — so that a size never tried is first tried on the other table's
    /// word, and then known. `None` before this table has seen a step.
    pub(crate) fn predict_within(&self, tokens: usize, wider: &StepCost) -> Option<f64> {
        let largest = self.points.iter().rev().find(|p| p.seen)?;
        if tokens as f64 <= largest.tokens {
            return self.predict(tokens);
        }
        let from = largest.tokens.round().max(1.0) as usize;
        let extra = match (wider.predict(tokens), wider.predict(from)) {
            (Some(to), Some(from)) => (to - from).max(0.0),
            // Nothing wider: each further token at this table's mean.
            _ => largest.ms * (tokens as f64 - largest.tokens) / largest.tokens.max(1.0),
        };
        Some(largest.ms + extra)
    }

    /// The most tokens (at least `at_least`, at most `at_most`) a step may
    /// hold and still be predicted within `ms`.
    pub(crate) fn tokens_within(&self, ms: f64, at_least: usize, at_most: usize) -> usize {
        let mut tokens = at_least.min(at_most);
        // The predicted cost is near enough monotone; doubling then halving
        // finds the edge in a few dozen predictions.
        let mut step = 1;
        while tokens + step <= at_most && self.predict(tokens + step).is_some_and(|t| t <= ms) {
            tokens += step;
            step *= 2;
        }
        while step > 1 {
            step /= 2;
            if tokens + step <= at_most && self.predict(tokens + step).is_some_and(|t| t <= ms) {
                tokens += step;
            }
        }
        tokens
    }
}

/// How much batch work a step may carry beside its real-time work: the
/// measured step cost, and how much longer than its real-time work alone a
/// step may run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Pace {
    /// What steps cost.
    pub cost: StepCost,
    /// The fraction a step may run over its real-time work's cost (0.5: 1.5×).
    pub slack: f64,
}

impl Pace {
    /// Batch tokens a step whose real-time work is `rt_tokens` may carry (at
    /// least one, so the batch lane always moves).
    pub(crate) fn batch_tokens(&self, rt_tokens: usize, at_most: usize) -> usize {
        let rt = rt_tokens.max(1);
        let Some(alone) = self.cost.predict(rt) else { return 1 };
        let total = self
            .cost
            .tokens_within((1.0 + self.slack) * alone, rt, rt + at_most.max(1));
        total.saturating_sub(rt).max(1)
    }
}

/// How the batch lane shares a step with the real-time lane.
#[derive(Debug, Clone, Copy, PartialEq)]
// Made once a step and handed down by value: boxing the pace would allocate every step.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Share {
    /// While real-time work runs, batch work sits out `rt_hold_steps` steps
    /// in a row, then shares one (before the engine has measured its steps,
    /// or with no slack).
    Counted,
    /// Batch work rides along in every step, within the pace.
    Paced(Pace),
    /// While real-time work runs, batch work sits out this step or not, as
    /// the engine's [`Owed`] time says.
    Timed {
        /// Whether batch work sits out this step.
        sits_out: bool,
    },
}

/// The hold in time, for models whose steps are too cheap to pace: after a
/// step that carried batch work — beside real-time work, or alone, before a
/// real-time request arrived — batch work sits out real-time-only steps
/// until they add up to its part of that step over the slack. So while
/// real-time work runs the batch lane takes about `slack / (1 + slack)` of
/// the engine's time whatever a step costs, and a request that arrives while
/// the batch lane runs alone starts on steps of its own.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Owed {
    /// Real-time-only milliseconds still owed.
    ms: f64,
}

impl Owed {
    /// Whether batch work sits out the next step.
    pub(crate) fn sits_out(&self) -> bool {
        self.ms > 0.0
    }

    /// Count a step that took `ms`; `rt_alone_ms` is what its real-time
    /// work alone is predicted to cost (0 for none), `batch` whether it
    /// carried batch work.
    pub(crate) fn observe(&mut self, ms: f64, rt_alone_ms: f64, batch: bool, slack: f64) {
        if !ms.is_finite() {
            return;
        }
        self.ms = if batch {
            (ms - rt_alone_ms.min(ms)) / slack.max(f64::EPSILON)
        } else {
            (self.ms - ms).max(0.0)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_linear_cost_is_read_back_and_bounds_batch_tokens_by_its_slack() {
        let cost = StepCost::linear(10.0, 1.0);
        assert_eq!(cost.predict(1), Some(11.0));
        assert_eq!(cost.predict(100), Some(110.0));
        // A real-time pre-fill of 4 tokens costs 14 ms alone: 7 batch tokens fit in 21.
        let pace = Pace { cost, slack: 0.5 };
        assert_eq!(pace.batch_tokens(4, 512), 7);
        assert_eq!(pace.batch_tokens(4, 3), 3, "never more than asked");
        assert_eq!(pace.batch_tokens(1, 512), 5);
        assert_eq!(cost.tokens_within(60.0, 1, 512), 50);
        assert_eq!(cost.tokens_within(5.0, 1, 512), 1, "at least what was asked");
    }

    #[test]
    fn small_steps_are_predicted_from_small_steps_not_from_a_line_through_large_ones() {
        // Memory-bound below 16 tokens (30 ms and 1 ms a token), compute-bound above (3.3 ms a token).
        let truth = |t: usize| {
            if t <= 16 {
                30.0 + t as f64
            } else {
                46.0 + 3.3 * (t - 16) as f64
            }
        };
        let mut cost = StepCost::default();
        for _ in 0..20 {
            for t in [1, 2, 4, 8, 16, 32, 64, 128, 256, 512] {
                cost.observe(t, truth(t));
            }
        }
        for t in [1, 3, 8, 12, 16, 24, 200, 512, 1000] {
            let p = cost.predict(t).unwrap();
            assert!((p - truth(t)).abs() < 1e-6, "{t} tokens: {p} against {}", truth(t));
        }
        // Real time alone at 8 tokens costs 38 ms: within 57 ms the step
        // holds 19 tokens (46 + 3.3 × 3 = 55.9; 20 would cost 59.2), 11 of them
        // batch work.
        let pace = Pace { cost, slack: 0.5 };
        assert_eq!(pace.batch_tokens(8, 512), 11);
    }

    #[test]
    fn decode_steps_are_priced_by_their_own_table_and_extended_by_the_wider_one() {
        // Pre-fill tokens at 1 ms each past a 10 ms base; decode rows at 3 ms.
        let mut wide = StepCost::default();
        let mut decodes = StepCost::finer();
        assert_eq!(decodes.predict_within(8, &wide), None, "no decode step seen");
        for (tokens, ms) in [(8, 34.0), (128, 138.0)] {
            wide.observe(tokens, ms);
        }
        decodes.observe(8, 34.0);
        // Beyond the decodes seen: their time plus the wider table's extra.
        assert_eq!(decodes.predict_within(8, &wide), Some(34.0));
        assert_eq!(decodes.predict_within(20, &wide), Some(34.0 + 12.0 * (104.0 / 120.0)));
        // Once steps of guesses are measured, they are what counts.
        decodes.observe(20, 70.0);
        assert_eq!(decodes.predict_within(20, &wide), Some(70.0));
        assert_eq!(decodes.predict_within(14, &wide), Some(52.0));
        // Nothing wider: further rows at the decodes' own mean.
        assert_eq!(decodes.predict_within(40, &StepCost::default()), Some(70.0 + 70.0));
        // Quarter octaves tell a 32-row step from one of 44: an octave a bucket does not.
        let (mut finer, mut coarse) = (StepCost::finer(), StepCost::default());
        for cost in [&mut finer, &mut coarse] {
            cost.observe(32, 100.0);
            cost.observe(44, 150.0);
        }
        assert_eq!(finer.predict(38), Some(125.0));
        assert_eq!(finer.predict(32), Some(100.0));
        assert_ne!(coarse.predict(32), Some(100.0));
    }

    #[test]
    fn a_bucket_follows_its_recent_steps() {
        let mut cost = StepCost::default();
        assert_eq!(cost.predict(4), None);
        cost.observe(4, 100.0);
        assert_eq!(cost.predict(4), Some(100.0));
        assert_eq!(cost.predict(8), Some(200.0), "one bucket seen: proportional");
        for _ in 0..60 {
            cost.observe(4, 20.0);
        }
        assert!((cost.predict(4).unwrap() - 20.0).abs() < 0.01);
        cost.observe(0, 5.0);
        cost.observe(4, f64::NAN);
        assert!(
            (cost.predict(4).unwrap() - 20.0).abs() < 0.01,
            "empty and unmeasured steps are not counted"
        );
    }

    #[test]
    fn batch_work_owes_real_time_only_steps_in_proportion_to_the_time_it_took() {
        let mut owed = Owed::default();
        assert!(!owed.sits_out(), "nothing owed at first");
        // A shared step of 30 ms whose real-time work alone costs 10: the
        // batch lane took 20 ms, and at 50% slack owes 40 ms of real time.
        owed.observe(30.0, 10.0, true, 0.5);
        assert!(owed.sits_out());
        owed.observe(15.0, 15.0, false, 0.5);
        owed.observe(15.0, 15.0, false, 0.5);
        assert!(owed.sits_out(), "30 of 40 ms paid");
        owed.observe(15.0, 15.0, false, 0.5);
        assert!(!owed.sits_out(), "paid");
        // A shared step that cost no more than its real-time work owes nothing.
        owed.observe(10.0, 12.0, true, 0.5);
        assert!(!owed.sits_out());
        owed.observe(30.0, 10.0, true, 0.5);
        owed.observe(f64::NAN, 10.0, false, 0.5);
        assert!(owed.sits_out(), "an unmeasured step pays nothing");
        // A step of batch work alone is owed in full: real time arriving
        // next starts on steps of its own for 8 / 0.5 ms.
        let mut owed = Owed::default();
        owed.observe(8.0, 0.0, true, 0.5);
        for _ in 0..3 {
            owed.observe(5.0, 5.0, false, 0.5);
            assert!(owed.sits_out());
        }
        owed.observe(1.0, 1.0, false, 0.5);
        assert!(!owed.sits_out(), "16 ms paid");
    }
}
