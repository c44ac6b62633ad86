//! Choosing the next token: greedy, or temperature with top-k and top-p
//! (nucleus) filtering, drawn from a per-request generator so that a seed gives
//! the same output whatever else shares the batch.

use std::borrow::Cow;

use crate::runtime::rng::SplitMix;

/// How one request samples, already range-checked at the edge.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 or `None`: no limit).
    pub top_k: Option<usize>,
    /// Keep the smallest set of tokens whose probability reaches p.
    pub top_p: Option<f32>,
    /// The request's seed.
    pub seed: u64,
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 0,
        }
    }
}

/// One request's sampler.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix,
}

/// The index of the largest value; the first one on ties, as `torch.argmax`.
pub(crate) fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// e^x for x ≤ 0 within 2 ulp, in straight-line arithmetic the compiler
/// vectorises (log-probabilities take one for every logit of every row).
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Round x·log2(e) to the nearest integer k by the 1.5·2^23 trick, so that x = k·ln2 + r, |r| ≤ ln2/2.
    const SHIFT: f32 = 12_582_912.0;
    let x = x.max(-87.0);
    let k = (x * LOG2_E + SHIFT) - SHIFT;
    let r = x - k * LN2_HI - k * LN2_LO;
    // e^r by its Taylor polynomial to r^7 (Horner).
    let mut p = 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    // 2^k from its exponent bits (k ≥ -126 since x ≥ -87).
    f32::from_bits(((k as i32 + 127) as u32) << 23) * p
}

/// `token`'s natural log-probability under `logits` (a log-softmax over
/// the whole vocabulary, before temperature or any filter), and the `top`
/// most likely tokens with theirs, most likely first, ties by id.
pub(crate) fn log_probs(logits: &[f32], token: u32, top: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // Exponentials in f32 (as torch's log_softmax takes them), eight lanes
    // at a time, each lane summed in f64.
    let mut lanes = [0f64; 8];
    let mut chunks = logits.chunks_exact(8);
    for chunk in chunks.by_ref() {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane += exp_nonpositive(x - max) as f64;
        }
    }
    let tail: f64 = chunks
        .remainder()
        .iter()
        .map(|&x| exp_nonpositive(x - max) as f64)
        .sum();
    let sum = lanes.iter().sum::<f64>() + tail;
    let log_z = max as f64 + sum.ln();
    let of = |x: f32| (x as f64 - log_z) as f32;
    let chosen = of(logits[token as usize]);
    let k = top.min(logits.len());
    // One pass keeping the best k, best first; a later id with an equal
    // logit ranks after the earlier one, so it never displaces it.
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k > 0 {
        for (id, &x) in logits.iter().enumerate() {
            if best.len() == k && x <= best[k - 1].1 {
                continue;
            }
            let at = best.partition_point(|&(_, y)| y >= x);
            best.insert(at, (id as u32, x));
            best.truncate(k);
        }
    }
    (chosen, best.into_iter().map(|(id, x)| (id, of(x))).collect())
}

impl Sampler {
    /// A sampler for one request.
    pub fn new(params: SamplingParams) -> Self {
        Sampler {
            rng: SplitMix::new(params.seed),
            params,
        }
    }

    /// Whether this sampler always takes the most likely token.
    pub(crate) fn is_greedy(&self) -> bool {
        self.params.temperature <= 0.0 || self.params.top_k == Some(1)
    }

    /// The filtered, renormalised distribution this sampler draws from, as (token, probability).
    pub fn distribution(&self, logits: &[f32]) -> Vec<(u32, f64)> {
        if self.is_greedy() {
            return vec![(argmax(logits), 1.0)];
        }
        let t = self.params.temperature as f64;
        // A token masked out (−∞, by a constraint) is no candidate at all.
        let mut ranked: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .filter(|(_, &x)| x != f32::NEG_INFINITY)
            .map(|(i, &x)| (i as u32, x as f64 / t))
            .collect();
        // Most likely first, ties by id: a total order, so the draw is the
        // same on every run. Only top-k and top-p need the order; without
        // them the whole vocabulary is drawn from in id order, unsorted
        // (sorting 50,000 logits a token cost a sampled batch half its rate).
        let likelier = |a: &(u32, f64), b: &(u32, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let top_k = self.params.top_k.filter(|&k| k > 0 && k < ranked.len());
        if let Some(k) = top_k {
            ranked.select_nth_unstable_by(k - 1, likelier);
            ranked.truncate(k);
        }
        let top_p = self.params.top_p.filter(|&p| p < 1.0);
        if top_k.is_some() || top_p.is_some() {
            ranked.sort_by(likelier);
        }
        let max = ranked.iter().map(|e| e.1).fold(f64::NEG_INFINITY, f64::max);
        let mut total = 0.0;
        for entry in ranked.iter_mut() {
            entry.1 = (entry.1 - max).exp();
            total += entry.1;
        }
        for entry in ranked.iter_mut() {
            entry.1 /= total;
        }
        if let Some(p) = top_p {
            let mut mass = 0.0;
            let keep = ranked
                .iter()
                .position(|&(_, q)| {
                    mass += q;
                    mass >= p as f64
                })
                .map_or(ranked.len(), |i| i + 1);
            ranked.truncate(keep);
            let kept: f64 = ranked.iter().map(|e| e.1).sum();
            for entry in ranked.iter_mut() {
                entry.1 /= kept;
            }
        }
        ranked
    }

    /// Draw the next token.
    pub(crate) fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.is_greedy() {
            return argmax(logits);
        }
        let distribution = self.distribution(logits);
        self.draw(&distribution)
    }

    /// Draw from a distribution given as (token, probability).
    pub(crate) fn draw(&mut self, distribution: &[(u32, f64)]) -> u32 {
        let mut u = self.rng.uniform() * distribution.iter().map(|e| e.1).sum::<f64>();
        for &(token, p) in distribution {
            if u < p {
                return token;
            }
            u -= p;
        }
        distribution.last().map_or(0, |e| e.0)
    }

    /// Verify proposed tokens against the target's logits after each of them
    /// (`logits[i]` follows the sequence before `drafts[i]`; one more row
    /// follows the last draft). Returns the tokens to emit, which are the
    /// accepted drafts and one token of the target's own, and how many drafts
    /// were accepted.
    ///
    /// Greedy: drafts are accepted while they equal the target's argmax, so the
    /// output is exactly plain greedy decoding. Sampled: speculative sampling
    /// (Leviathan et al., 2023; Chen et al., 2023): draft `x` drawn from `q` is
    /// accepted with probability `min(1, p(x)/q(x))`; on rejection the token is
    /// drawn from `norm(max(0, p − q))`; the output is distributed exactly as
    /// the target's. `q[i]` is the draft's distribution for `drafts[i]`; `None`
    /// means the drafts were proposed deterministically (a point mass, as
    /// n-gram lookup's).
    pub fn verify(&mut self, drafts: &[u32], q: Option<&[Vec<(u32, f64)>]>, logits: &[&[f32]]) -> (Vec<u32>, usize) {
        assert_eq!(logits.len(), drafts.len() + 1, "one row per draft and one after");
        let rows = self.verify_with(drafts, q, |i| {
            Ok::<_, std::convert::Infallible>(Cow::Borrowed(logits[i]))
        });
        match rows {
            Ok(verified) => verified,
            Err(never) => match never {},
        }
    }

    /// [`Sampler::verify`] with each row asked of `row`, in order, only once
    /// the drafts before it were accepted (a constrained request's row `i`
    /// is masked by the grammar's state after `drafts[..i]`).
    pub(crate) fn verify_with<'a, E>(
        &mut self,
        drafts: &[u32],
        q: Option<&[Vec<(u32, f64)>]>,
        mut row: impl FnMut(usize) -> Result<Cow<'a, [f32]>, E>,
    ) -> Result<(Vec<u32>, usize), E> {
        let mut out = Vec::with_capacity(drafts.len() + 1);
        for (i, &draft) in drafts.iter().enumerate() {
            let logits = row(i)?;
            if self.is_greedy() {
                let best = argmax(&logits);
                out.push(best);
                if best != draft {
                    return Ok((out, i));
                }
                continue;
            }
            let p = self.distribution(&logits);
            let prob = |d: &[(u32, f64)], t: u32| d.iter().find(|e| e.0 == t).map_or(0.0, |e| e.1);
            let (p_x, q_x) = match q {
                Some(q) => (prob(&p, draft), prob(&q[i], draft)),
                None => (prob(&p, draft), 1.0),
            };
            if q_x > 0.0 && self.rng.uniform() < (p_x / q_x).min(1.0) {
                out.push(draft);
                continue;
            }
            let residual: Vec<(u32, f64)> = p
                .iter()
                .map(|&(t, pt)| {
                    let qt = match q {
                        Some(q) => prob(&q[i], t),
                        None => f64::from(u8::from(t == draft)),
                    };
                    (t, (pt - qt).max(0.0))
                })
                .filter(|e| e.1 > 0.0)
                .collect();
            // Rejection happens only where p(x) < q(x), so some mass is left;
            // rounding aside, in which case p itself is the right law.
            let next = if residual.is_empty() {
                self.draw(&p)
            } else {
                self.draw(&residual)
            };
            out.push(next);
            return Ok((out, i));
        }
        let last = row(drafts.len())?;
        out.push(self.sample(&last));
        Ok((out, drafts.len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: Option<usize>, top_p: Option<f32>, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
        }
    }

    const LOGITS: [f32; 5] = [1.0, 3.0, 0.5, 2.5, -1.0];

    #[test]
    fn the_vectorised_exponential_is_within_a_few_ulp() {
        let mut worst = 0f64;
        let mut x = 0f32;
        while x > -87.0 {
            let exact = (x as f64).exp();
            let got = exp_nonpositive(x) as f64;
            worst = worst.max(((got - exact) / exact).abs());
            x -= 0.000_731;
        }
        assert!(worst < 4.0 * f32::EPSILON as f64, "relative error {worst}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert!(exp_nonpositive(-200.0) < 1e-37);
    }

    #[test]
    fn log_probs_are_a_log_softmax_with_the_best_alternatives_first() {
        let z: f64 = LOGITS.iter().map(|&x| (x as f64).exp()).sum();
        let expected = |i: usize| (LOGITS[i] as f64 - z.ln()) as f32;
        let (chosen, top) = log_probs(&LOGITS, 2, 3);
        assert!((chosen - expected(2)).abs() < 1e-6);
        let ids: Vec<u32> = top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 0]);
        for (id, lp) in &top {
            assert!((lp - expected(*id as usize)).abs() < 1e-6);
        }
        let total: f64 = (0..LOGITS.len()).map(|i| (expected(i) as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        // Ties by id, none asked for, more asked for than there are.
        assert_eq!(
            log_probs(&[0.0, 1.0, 1.0], 0, 2)
                .1
                .iter()
                .map(|t| t.0)
                .collect::<Vec<_>>(),
            vec![1, 2]
        );
        assert!(log_probs(&LOGITS, 1, 0).1.is_empty());
        assert_eq!(log_probs(&LOGITS, 1, 9).1.len(), 5);
        // Logits far from zero lose nothing.
        let shifted: Vec<f32> = LOGITS.iter().map(|x| x + 1000.0).collect();
        assert!((log_probs(&shifted, 2, 0).0 - expected(2)).abs() < 1e-4);
    }

    #[test]
    fn greedy_takes_the_first_best_token() {
        assert_eq!(Sampler::new(SamplingParams::greedy()).sample(&LOGITS), 1);
        assert_eq!(argmax(&[2.0, 5.0, 5.0]), 1);
        assert_eq!(Sampler::new(params(1.5, Some(1), None, 9)).sample(&LOGITS), 1);
    }

    #[test]
    fn a_seed_repeats_its_draws_and_another_seed_does_not() {
        let draw = |seed| {
            let mut s = Sampler::new(params(1.0, None, None, seed));
            (0..64).map(|_| s.sample(&LOGITS)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn top_k_and_top_p_cut_the_tail() {
        let mut s = Sampler::new(params(5.0, Some(2), None, 1));
        assert!((0..500).map(|_| s.sample(&LOGITS)).all(|t| t == 1 || t == 3));
        let nucleus = Sampler::new(params(1.0, None, Some(0.5), 1)).distribution(&LOGITS);
        assert_eq!(
            nucleus.len(),
            1,
            "the best token alone holds half the mass: {nucleus:?}"
        );
        let wide = Sampler::new(params(1.0, None, Some(0.9), 1)).distribution(&LOGITS);
        assert_eq!(wide.iter().map(|e| e.0).collect::<Vec<_>>(), vec![1, 3, 0]);
        assert!((wide.iter().map(|e| e.1).sum::<f64>() - 1.0).abs() < 1e-12);
    }

    fn chi_square(counts: &[usize], probabilities: &[f64]) -> f64 {
        let n: usize = counts.iter().sum();
        counts
            .iter()
            .zip(probabilities)
            .map(|(&c, &p)| {
                let expected = n as f64 * p;
                (c as f64 - expected).powi(2) / expected
            })
            .sum()
    }

    #[test]
    fn greedy_verification_accepts_the_drafts_that_match_the_argmax_and_adds_the_next() {
        let rows: [&[f32]; 3] = [&[0.0, 2.0, 1.0], &[3.0, 0.0, 1.0], &[0.0, 0.0, 5.0]];
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.verify(&[1, 0], None, &rows), (vec![1, 0, 2], 2));
        assert_eq!(s.verify(&[1, 2], None, &rows), (vec![1, 0], 1));
        assert_eq!(s.verify(&[0, 0], None, &rows), (vec![1], 0));
        assert_eq!(s.verify(&[], None, &rows[..1]), (vec![1], 0));
    }

    /// The first emitted token of speculative sampling, over many draws, with a
    /// poor draft (its distribution far from the target's, or a fixed token),
    /// follows the target's distribution: chi-square at 4 degrees of freedom
    /// below 18.47 (0.1%).
    #[test]
    fn speculative_sampling_keeps_the_target_distribution_with_a_poor_draft() {
        let target = Sampler::new(params(1.0, None, None, 0)).distribution(&LOGITS);
        let mut p = [0f64; 5];
        for &(t, q) in &target {
            p[t as usize] = q;
        }
        // A draft that prefers what the target does not.
        let draft_logits: Vec<f32> = LOGITS.iter().map(|x| -x).collect();
        let n = 20_000;
        for (case, deterministic) in [("draft model", false), ("point mass", true)] {
            let mut s = Sampler::new(params(1.0, None, None, 99));
            let mut drafter = Sampler::new(params(1.0, None, None, 5));
            let (mut first, mut second) = ([0usize; 5], [0usize; 5]);
            let mut accepted = 0;
            for _ in 0..n {
                let rows: [&[f32]; 3] = [&LOGITS, &LOGITS, &LOGITS];
                let (out, a) = if deterministic {
                    s.verify(&[4, 4], None, &rows)
                } else {
                    let q = drafter.distribution(&draft_logits);
                    let drafts = [drafter.draw(&q), drafter.draw(&q)];
                    s.verify(&drafts, Some(&[q.clone(), q]), &rows)
                };
                accepted += a;
                first[out[0] as usize] += 1;
                if out.len() > 1 {
                    second[out[1] as usize] += 1;
                }
            }
            assert!(accepted > 0 && accepted < n, "{case}: some drafts accepted, not all");
            for (which, counts) in [("first", first), ("second", second)] {
                let chi2 = chi_square(&counts, &p);
                assert!(
                    chi2 < 18.47,
                    "{case}, {which} token: chi-square {chi2} with counts {counts:?}"
                );
            }
        }
    }

    #[test]
    fn draws_follow_the_softmax_distribution() {
        // Chi-square goodness of fit over 20,000 draws; 18.47 is the 0.1% critical value at 4 degrees of freedom.
        let mut s = Sampler::new(params(1.0, None, None, 42));
        let n = 20_000;
        let mut counts = [0usize; 5];
        for _ in 0..n {
            counts[s.sample(&LOGITS) as usize] += 1;
        }
        let z: f64 = LOGITS.iter().map(|&x| (x as f64).exp()).sum();
        let chi2: f64 = LOGITS
            .iter()
            .zip(counts)
            .map(|(&x, c)| {
                let expected = n as f64 * (x as f64).exp() / z;
                (c as f64 - expected).powi(2) / expected
            })
            .sum();
        assert!(chi2 < 18.47, "chi-square {chi2} with counts {counts:?}");
    }
}
