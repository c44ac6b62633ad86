//! Choosing the next token: greedy, or temperature with top-k and top-p
//! (nucleus) filtering, drawn from a per-request generator so that a seed gives
//! the same output whatever else shares the batch.

use crate::rng::SplitMix;

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
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
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
    pub fn is_greedy(&self) -> bool {
        self.params.temperature <= 0.0 || self.params.top_k == Some(1)
    }

    /// The filtered, renormalised distribution this sampler draws from, as (token, probability).
    pub fn distribution(&self, logits: &[f32]) -> Vec<(u32, f64)> {
        if self.is_greedy() {
            return vec![(argmax(logits), 1.0)];
        }
        let t = self.params.temperature as f64;
        let mut ranked: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, &x)| (i as u32, x as f64 / t))
            .collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if let Some(k) = self.params.top_k.filter(|&k| k > 0) {
            ranked.truncate(k);
        }
        let max = ranked[0].1;
        let mut total = 0.0;
        for entry in ranked.iter_mut() {
            entry.1 = (entry.1 - max).exp();
            total += entry.1;
        }
        for entry in ranked.iter_mut() {
            entry.1 /= total;
        }
        if let Some(p) = self.params.top_p.filter(|&p| p < 1.0) {
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
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.is_greedy() {
            return argmax(logits);
        }
        let distribution = self.distribution(logits);
        let mut u = self.rng.uniform();
        for &(token, p) in &distribution {
            if u < p {
                return token;
            }
            u -= p;
        }
        distribution.last().map_or(0, |e| e.0)
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
