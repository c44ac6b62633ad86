//! Speculative decoding inside continuous, mixed-adapter batches.
//!
//! A proposer guesses a decoding sequence's next few tokens; the target model
//! computes the sequence's last token and the guesses in one chunk of the
//! ordinary batched pass (each row with its own LoRA adapter), and
//! [`crate::runtime::sampling::Sampler::verify`] keeps the longest acceptable run and
//! adds one token of the target's own. Rejected guesses' keys and values are
//! rolled back. Two proposers:
//!
//! - prompt lookup ([`ngram_proposal`]): the tokens that followed the latest
//!   earlier occurrence of the sequence's last few tokens. No model; strong
//!   where output copies input (summaries, extraction, code edits).
//! - a draft model ([`DraftModel`]): a smaller model sharing the tokenizer,
//!   run batched over every speculating sequence with its own paged cache.
//!   It runs without adapters: an adapted row's drafts are the base draft's
//!   guesses, accepted or not by the adapted target, so output stays exact.
//!
//! Whether a step guesses, and how much, is decided per step from what was
//! measured ([`SpecPolicy::Measured`], the default): each sequence's
//! acceptance ([`SpecState`], its own guesses' record over the engine's as a
//! prior, [`Acceptance`]) gives each guess the chance that it is kept, and the
//! engine's measured step cost what the guesses' verification rows cost; the
//! step takes the guesses, likeliest first, that make the most tokens per
//! unit of time ([`choose`]), and none where no guesses beat a plain step. A
//! small batch, whose step is bound by reading the weights, takes nearly any
//! guess; a large one, whose step grows with every row, only guesses that are
//! nearly sure. A sequence left out is tried now and then with a few guesses
//! ([`Probes`]), within a small share of the step's rows, so that a
//! sequence whose output turns repetitive is found. [`SpecPolicy::Always`]
//! guesses in every step (each sequence adapting its draft length to its
//! acceptance and pausing when guesses keep failing) while at most
//! [`SpecConfig::batch_limit`] sequences decode. A draft model's guesses
//! also cost its own passes: it speculates only in the smallest batches.

use std::collections::HashMap;

use crate::models::llama::{Llama, SeqChunk};
use crate::runtime::chat::Decoding;
use crate::runtime::kv::{BlockPool, BlockTable, KvCache};
use crate::runtime::scheduler::SeqId;

/// Which proposer guesses tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proposer {
    /// No speculation.
    Off,
    /// Prompt lookup: n-grams of the sequence itself.
    Ngram,
    /// A draft model.
    Draft,
}

impl Proposer {
    /// The name counters and logs use.
    pub fn as_str(self) -> &'static str {
        match self {
            Proposer::Off => "off",
            Proposer::Ngram => "ngram",
            Proposer::Draft => "draft",
        }
    }
}

/// How a step decides to guess.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpecPolicy {
    /// From measured acceptance and step cost, per step ([`choose`]).
    #[default]
    Measured,
    /// In every step while at most [`SpecConfig::batch_limit`] sequences decode.
    Always,
}

impl SpecPolicy {
    /// `measured` or `always`.
    pub fn parse(value: &str) -> Result<Self, String> {
        match value {
            "measured" => Ok(SpecPolicy::Measured),
            "always" => Ok(SpecPolicy::Always),
            _ => Err(format!("{value:?}: expected measured or always")),
        }
    }
}

/// How the engine speculates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecConfig {
    /// The proposer ([`Proposer::Draft`] needs a draft model).
    pub proposer: Proposer,
    /// The most tokens guessed per sequence per step.
    pub max_draft: usize,
    /// Speculate only in steps where at most this many sequences decode;
    /// `None`: the proposer's own limit ([`SpecConfig::batch_limit`]).
    pub max_batch: Option<usize>,
    /// Speculate for sampled requests too. Their output distribution is the
    /// target's either way, but which draws a seed gives then depends on the
    /// steps that speculated, and so on the rest of the batch: off by default,
    /// so that a seeded request gives the same output whatever shares its batch.
    pub sampled: bool,
    /// How a step decides to guess.
    pub policy: SpecPolicy,
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig {
            proposer: Proposer::Ngram,
            max_draft: 6,
            max_batch: None,
            sampled: false,
            policy: SpecPolicy::Measured,
        }
    }
}

/// Prompt lookup's default [`SpecConfig::batch_limit`] when every step
/// guesses: the largest batch measured (`lorry bench speculative`) where it
/// still paid. Measured steps have no limit of their own.
pub(crate) const NGRAM_BATCH_LIMIT: usize = 32;
/// A draft model's: beyond it, its passes cost more than they save.
pub(crate) const DRAFT_BATCH_LIMIT: usize = 2;

impl SpecConfig {
    /// The most sequences decoding in a step that speculates.
    pub fn batch_limit(&self) -> usize {
        self.max_batch.unwrap_or(match (self.proposer, self.policy) {
            (Proposer::Off, _) => 0,
            (Proposer::Ngram, SpecPolicy::Measured) => usize::MAX,
            (Proposer::Ngram, SpecPolicy::Always) => NGRAM_BATCH_LIMIT,
            (Proposer::Draft, _) => DRAFT_BATCH_LIMIT,
        })
    }
}

/// The longest n-gram prompt lookup matches.
pub(crate) const NGRAM_MAX: usize = 4;
/// The shortest.
pub(crate) const NGRAM_MIN: usize = 2;

/// Prompt lookup (Saxena, 2023): find the latest earlier occurrence of the
/// last `n` tokens (longest `n` first, from [`NGRAM_MAX`] down to
/// [`NGRAM_MIN`]) and propose up to `k` tokens that followed it.
pub(crate) fn ngram_proposal(tokens: &[u32], k: usize) -> Vec<u32> {
    if k == 0 {
        return Vec::new();
    }
    for n in (NGRAM_MIN..=NGRAM_MAX).rev() {
        if tokens.len() <= n {
            continue;
        }
        let suffix = &tokens[tokens.len() - n..];
        // Latest first; the match must be followed by at least one token.
        let found = (0..tokens.len() - n).rev().find(|&at| &tokens[at..at + n] == suffix);
        if let Some(at) = found {
            let from = at + n;
            return tokens[from..(from + k).min(tokens.len())].to_vec();
        }
    }
    Vec::new()
}

/// A record of guesses as the chance that a guess is kept, given that the
/// guesses before it were: guesses run in order and verification stops at
/// the first it rejects, so each round tells of the guesses accepted and, if
/// it stopped early, of one rejected. Older rounds count less, by `decay`
/// a round.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Acceptance {
    accepted: f64,
    rejected: f64,
    decay: f64,
}

impl Acceptance {
    /// A sequence's own record: a round counts a fifth as much five rounds on.
    pub(crate) const OWN: f64 = 0.8;
    /// The engine's, over every sequence: a prior for those with little record.
    pub(crate) const ENGINE: f64 = 0.98;

    pub(crate) fn new(decay: f64) -> Self {
        Acceptance {
            accepted: 0.0,
            rejected: 0.0,
            decay,
        }
    }

    /// `accepted` of `proposed` guesses were kept.
    pub(crate) fn observe(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        self.accepted = self.decay * self.accepted + accepted as f64;
        self.rejected = self.decay * self.rejected + f64::from(u8::from(accepted < proposed));
    }

    /// The chance that a guess is kept, with `weight` rounds' worth of `prior`.
    pub(crate) fn rate(&self, prior: f64, weight: f64) -> f64 {
        (self.accepted + weight * prior) / (self.accepted + self.rejected + weight)
    }

    /// The engine's own rate: an even chance before any round.
    pub(crate) fn engine_rate(&self) -> f64 {
        self.rate(0.5, 2.0)
    }
}

/// Rounds' worth of the engine's acceptance a sequence starts with.
const PRIOR_WEIGHT: f64 = 2.0;

/// One sequence's speculation: its record of guesses, and (for
/// [`SpecPolicy::Always`]) its draft length and pauses.
#[derive(Debug, Clone)]
pub(crate) struct SpecState {
    k: usize,
    max: usize,
    /// Moving average of the share of guesses accepted.
    rate: f64,
    rounds: u32,
    /// Steps left without speculating, and the next pause's length.
    paused: u32,
    pause: u32,
    /// Its guesses' record, for [`SpecPolicy::Measured`].
    acceptance: Acceptance,
    /// Steps since it last guessed.
    idle: u32,
}

impl SpecState {
    /// Start with a short draft.
    pub fn new(max: usize) -> Self {
        SpecState {
            k: max.min(3),
            max,
            rate: 0.5,
            rounds: 0,
            paused: 0,
            pause: 8,
            acceptance: Acceptance::new(Acceptance::OWN),
            idle: 0,
        }
    }

    /// The most tokens it guesses in a step.
    pub(crate) fn max(&self) -> usize {
        self.max
    }

    /// The chance that its next guess is kept, the engine's rate as prior.
    pub(crate) fn acceptance(&self, engine: f64) -> f64 {
        self.acceptance.rate(engine, PRIOR_WEIGHT)
    }

    /// Count a step it decoded in: whether it guessed.
    pub(crate) fn stepped(&mut self, guessed: bool) {
        self.idle = if guessed { 0 } else { self.idle.saturating_add(1) };
    }

    /// Steps since it last guessed.
    pub(crate) fn idle(&self) -> u32 {
        self.idle
    }

    /// How many tokens to guess this step (0: not now). Call once per step.
    pub(crate) fn next_k(&mut self) -> usize {
        if self.paused > 0 {
            self.paused -= 1;
            return 0;
        }
        self.k
    }

    /// The last guesses: `accepted` of `proposed`.
    pub(crate) fn observe(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        self.acceptance.observe(proposed, accepted);
        self.rounds += 1;
        self.rate = 0.7 * self.rate + 0.3 * accepted as f64 / proposed as f64;
        self.k = if accepted == proposed {
            (self.k + 1).min(self.max)
        } else {
            (accepted + 1).clamp(1, self.max)
        };
        // Guessing that keeps failing costs verification rows: pause it, for
        // longer each time, and try again with a single guess.
        if self.rounds >= 4 && self.rate < 0.25 {
            self.paused = self.pause;
            self.pause = (self.pause * 2).min(256);
            self.rate = 0.5;
            self.rounds = 0;
            self.k = 1;
        } else if self.rate > 0.5 {
            self.pause = 8;
        }
    }
}

/// A decoding sequence a step may guess for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Candidate {
    /// The most guesses it can take this step.
    pub available: usize,
    /// The chance that a guess is kept given the ones before it were.
    pub acceptance: f64,
}

/// The gain over a plain step that guesses must promise: the step cost is a
/// prediction from recent steps and a sequence's acceptance an estimate
/// from a few rounds.
const MARGIN: f64 = 0.05;

/// How many guesses each candidate takes this step, where `decoding`
/// sequences decode and `cost(tokens)` predicts a step's time. A
/// candidate's `j`-th guess is kept with chance `acceptanceʲ`; taking the `m`
/// likeliest guesses of all makes `decoding + Σ chance` tokens in
/// `cost(decoding + m)`. The `m` with the most tokens per unit of time is
/// taken, if it beats `m = 0` by [`MARGIN`]; none without a prediction.
/// The engine predicts with what steps of decodes alone cost (each row
/// computes logits, as a verification row does; a pre-fill token does not).
pub(crate) fn choose(decoding: usize, candidates: &[Candidate], cost: impl Fn(usize) -> Option<f64>) -> Vec<usize> {
    let mut taken = vec![0; candidates.len()];
    let Some(plain) = cost(decoding).filter(|&t| t > 0.0) else {
        return taken;
    };
    let mut guesses: Vec<(f64, usize)> = Vec::new();
    for (i, c) in candidates.iter().enumerate() {
        let a = c.acceptance.clamp(0.0, 1.0);
        let mut chance = 1.0;
        for _ in 0..c.available {
            chance *= a;
            if chance < 1e-3 {
                break;
            }
            guesses.push((chance, i));
        }
    }
    // Likeliest first; a candidate's guesses stay in their order (their chances fall).
    guesses.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let base = decoding as f64 / plain;
    let (mut best, mut best_rate, mut expected) = (0, base * (1.0 + MARGIN), decoding as f64);
    for (m, &(chance, _)) in guesses.iter().enumerate() {
        expected += chance;
        let Some(time) = cost(decoding + m + 1).filter(|&t| t > 0.0) else {
            break;
        };
        if expected / time > best_rate {
            (best, best_rate) = (m + 1, expected / time);
        }
    }
    for &(_, i) in &guesses[..best] {
        taken[i] += 1;
    }
    taken
}

/// Steps a sequence left out sits before it may be tried again.
const PROBE_AFTER: u32 = 8;
/// Guesses a try takes.
const PROBE_GUESSES: usize = 3;
/// The share of a step's decoding rows that tries may add, over time.
const PROBE_SHARE: f64 = 0.01;

/// Tries of sequences that [`choose`] left out: their own record may be
/// short or old, and the engine's rate is a mean. Each step earns
/// [`PROBE_SHARE`] of its decoding rows in credit; a try spends its
/// guesses, so tries add at most that share of rows, however they fare.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Probes {
    credit: f64,
}

impl Probes {
    /// The candidate (by index) to try this step, and how many guesses:
    /// the one left out longest, once it sat out [`PROBE_AFTER`] steps and
    /// the credit covers its guesses.
    pub(crate) fn pick(&mut self, decoding: usize, left_out: &[(usize, u32, usize)]) -> Option<(usize, usize)> {
        self.credit = (self.credit + PROBE_SHARE * decoding as f64).min(4.0 * PROBE_GUESSES as f64);
        let &(i, _, available) = left_out
            .iter()
            .filter(|c| c.1 >= PROBE_AFTER && c.2 > 0)
            .max_by_key(|c| (c.1, std::cmp::Reverse(c.0)))?;
        let k = available.min(PROBE_GUESSES);
        if self.credit < k as f64 {
            return None;
        }
        self.credit -= k as f64;
        Some((i, k))
    }
}

/// What a proposer guessed for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Guess {
    /// The guessed tokens.
    pub tokens: Vec<u32>,
    /// The draft's distribution for each (sampled requests of a draft model).
    pub q: Option<Vec<Vec<(u32, f64)>>>,
    /// Who guessed.
    pub proposer: Proposer,
}

#[derive(Debug, Default)]
struct DraftSeq {
    table: BlockTable,
    /// The tokens whose keys and values the draft's cache holds, in order.
    fed: Vec<u32>,
}

/// A draft model with its own paged cache, run batched over the speculating
/// sequences.
#[derive(Debug)]
pub(crate) struct DraftModel {
    model: Llama,
    kv: KvCache,
    pool: BlockPool,
    seqs: HashMap<SeqId, DraftSeq>,
}

const DRAFT_BLOCK: usize = 16;

impl DraftModel {
    /// Serve `model` as a draft.
    pub fn new(model: Llama) -> Self {
        DraftModel {
            kv: KvCache::new(model.kv_layout(DRAFT_BLOCK), 0),
            pool: BlockPool::new(0, DRAFT_BLOCK),
            seqs: HashMap::new(),
            model,
        }
    }

    /// Forget a sequence and free its blocks.
    pub fn forget(&mut self, id: SeqId) {
        if let Some(mut seq) = self.seqs.remove(&id) {
            seq.table.release(&mut self.pool);
        }
    }

    /// Room for `extra` more tokens in `id`'s table, growing the cache by at least half.
    fn reserve(&mut self, id: SeqId, extra: usize) {
        let seq = self.seqs.entry(id).or_default();
        let short = seq.table.blocks_needed(&self.pool, extra);
        if short > self.pool.free_blocks() {
            let grow = (short - self.pool.free_blocks()).max(self.pool.total_blocks() / 2);
            self.pool.grow(grow);
            self.kv.grow(self.pool.total_blocks());
        }
        seq.table
            .append(&mut self.pool, extra)
            .expect("the pool was grown to fit");
    }

    /// Guess up to `k` tokens for each `(sequence, its decoding, k)`: catch the
    /// draft's cache up with each sequence's tokens, then run `k` batched
    /// single-token passes (fewer for sequences that want fewer).
    pub(crate) fn propose(&mut self, wants: &mut [(SeqId, &mut Decoding, usize)]) -> Result<Vec<Guess>, String> {
        let limit = self.model.config().max_position_embeddings;
        let mut guesses: Vec<Guess> = wants
            .iter()
            .map(|_| Guess {
                tokens: Vec::new(),
                q: None,
                proposer: Proposer::Draft,
            })
            .collect();
        // Catch up: keep the cached tokens the sequence still starts with, feed the rest.
        let mut feeds: Vec<(usize, usize, Vec<u32>)> = Vec::new();
        for (i, (id, decoding, k)) in wants.iter().enumerate() {
            let tokens = &decoding.tokens;
            if *k == 0 || tokens.len() + *k > limit {
                continue;
            }
            let seq = self.seqs.entry(*id).or_default();
            let common = seq.fed.iter().zip(tokens.iter()).take_while(|(a, b)| a == b).count();
            // The last token is fed again when nothing else is: its logits are needed.
            let keep = common.min(tokens.len() - 1);
            seq.table.truncate(&mut self.pool, keep);
            seq.fed.truncate(keep);
            feeds.push((i, keep, tokens[keep..].to_vec()));
        }
        if feeds.is_empty() {
            return Ok(guesses);
        }
        for (i, _, feed) in &feeds {
            self.reserve(wants[*i].0, feed.len());
        }
        let chunks: Vec<SeqChunk<'_>> = feeds
            .iter()
            .map(|(i, start, feed)| SeqChunk {
                tokens: feed,
                start: *start,
                blocks: self.seqs[&wants[*i].0].table.blocks(),
                logits: 1,
                adapter: None,
            })
            .collect();
        let rows = pass(&self.model, &mut self.kv, &chunks)?;
        for ((i, _, feed), row) in feeds.iter().zip(&rows) {
            self.seqs.get_mut(&wants[*i].0).expect("reserved").fed.extend(feed);
            pick(&mut guesses[*i], wants[*i].1, row);
        }
        // One batched pass per further guess.
        let mut round = 1;
        loop {
            let going: Vec<usize> = feeds.iter().map(|f| f.0).filter(|&i| wants[i].2 > round).collect();
            if going.is_empty() {
                break;
            }
            let inputs: Vec<[u32; 1]> = going.iter().map(|&i| [guesses[i].tokens[round - 1]]).collect();
            for &i in &going {
                self.reserve(wants[i].0, 1);
            }
            let chunks: Vec<SeqChunk<'_>> = going
                .iter()
                .zip(&inputs)
                .map(|(&i, input)| {
                    let seq = &self.seqs[&wants[i].0];
                    SeqChunk {
                        tokens: input,
                        start: seq.fed.len(),
                        blocks: seq.table.blocks(),
                        logits: 1,
                        adapter: None,
                    }
                })
                .collect();
            let rows = pass(&self.model, &mut self.kv, &chunks)?;
            for ((&i, input), row) in going.iter().zip(&inputs).zip(&rows) {
                self.seqs.get_mut(&wants[i].0).expect("reserved").fed.push(input[0]);
                pick(&mut guesses[i], wants[i].1, row);
            }
            round += 1;
        }
        Ok(guesses)
    }
}

fn pass(model: &Llama, kv: &mut KvCache, chunks: &[SeqChunk<'_>]) -> Result<Vec<Vec<f32>>, String> {
    let logits = model
        .forward_batch(chunks, kv)
        .map_err(|e| format!("draft model: {e}"))?;
    logits.to_vec2::<f32>().map_err(|e| format!("draft model: {e}"))
}

fn pick(guess: &mut Guess, decoding: &mut Decoding, logits: &[f32]) {
    let (token, q) = decoding.draft_pick(logits);
    guess.tokens.push(token);
    if let Some(q) = q {
        guess.q.get_or_insert_with(Vec::new).push(q);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_proposer_and_policy_speculates_up_to_its_own_batch_limit_unless_one_is_set() {
        let config = |proposer, max_batch| SpecConfig {
            proposer,
            max_batch,
            ..SpecConfig::default()
        };
        assert_eq!(
            config(Proposer::Ngram, None).batch_limit(),
            usize::MAX,
            "measured steps decide"
        );
        let always = SpecConfig {
            policy: SpecPolicy::Always,
            ..config(Proposer::Ngram, None)
        };
        assert_eq!(always.batch_limit(), NGRAM_BATCH_LIMIT);
        assert_eq!(config(Proposer::Draft, None).batch_limit(), DRAFT_BATCH_LIMIT);
        assert_eq!(config(Proposer::Off, None).batch_limit(), 0);
        assert_eq!(config(Proposer::Draft, Some(12)).batch_limit(), 12);
        assert_eq!(config(Proposer::Ngram, Some(0)).batch_limit(), 0);
    }

    fn candidates(rates: &[f64], available: usize) -> Vec<Candidate> {
        rates
            .iter()
            .map(|&acceptance| Candidate { available, acceptance })
            .collect()
    }

    #[test]
    fn a_step_bound_by_reading_the_weights_takes_nearly_any_guess() {
        // The same time for any step up to 64 tokens: guesses are free.
        let flat = |t: usize| Some(if t <= 64 { 12.0 } else { 12.0 + (t - 64) as f64 });
        assert_eq!(choose(1, &candidates(&[0.5], 4), flat), vec![4]);
        assert_eq!(
            choose(4, &candidates(&[0.9, 0.2, 0.05, 0.5], 6), flat),
            vec![6, 4, 2, 6]
        );
        // Without a measured step, no guess.
        assert_eq!(choose(4, &candidates(&[0.9; 4], 6), |_| None), vec![0; 4]);
    }

    #[test]
    fn a_step_whose_time_grows_with_its_rows_takes_only_nearly_sure_guesses() {
        // Each row costs what the mean row of a plain step costs: no guess pays.
        let proportional = |t: usize| Some(t as f64);
        assert_eq!(choose(32, &candidates(&[0.95; 32], 6), proportional), vec![0; 32]);
        // A fixed part and a cost per row, as a 32-sequence step on a CPU: a
        // guess costs about four fifths of a plain row.
        let linear = |t: usize| Some(10.0 + t as f64);
        assert_eq!(choose(32, &candidates(&[0.3; 32], 6), linear), vec![0; 32]);
        assert_eq!(choose(32, &candidates(&[0.5; 32], 6), linear), vec![0; 32]);
        let sure = choose(32, &candidates(&[0.97; 32], 6), linear);
        assert!(sure.iter().all(|&k| k > 0), "{sure:?}");
        // Mixed: the repetitive sequences guess, the others do not.
        let mut rates = vec![0.3; 32];
        rates[..16].fill(0.98);
        let mixed = choose(32, &candidates(&rates, 6), linear);
        assert!(mixed[..16].iter().all(|&k| k > 0), "{mixed:?}");
        assert!(mixed[16..].iter().all(|&k| k == 0), "{mixed:?}");
        // The guesses taken are the ones that pay: the rate they promise beats
        // a plain step by the margin and beats taking one guess more or fewer.
        let rate = |taken: &[usize]| {
            let tokens: f64 = 32.0
                + taken
                    .iter()
                    .zip(&rates)
                    .map(|(&k, &a)| (1..=k).map(|j| a.powi(j as i32)).sum::<f64>())
                    .sum::<f64>();
            tokens / linear(32 + taken.iter().sum::<usize>()).unwrap()
        };
        assert!(rate(&mixed) >= (32.0 / linear(32).unwrap()) * (1.0 + MARGIN));
        for i in 0..32 {
            let mut more = mixed.clone();
            more[i] = (more[i] + 1).min(6);
            assert!(rate(&more) <= rate(&mixed) + 1e-12, "one guess more for {i} pays");
        }
    }

    #[test]
    fn tries_of_left_out_sequences_stay_within_their_share_of_rows() {
        let mut probes = Probes::default();
        let (mut rows, mut tried) = (0, 0);
        let mut idle = [0u32; 32];
        for _ in 0..10_000 {
            let left_out: Vec<(usize, u32, usize)> = (0..32).map(|i| (i, idle[i], 6)).collect();
            rows += 32;
            idle.iter_mut().for_each(|d| *d += 1);
            if let Some((i, k)) = probes.pick(32, &left_out) {
                assert!(left_out[i].1 >= PROBE_AFTER, "tried before sitting out");
                assert_eq!(k, PROBE_GUESSES);
                assert_eq!(idle.iter().max(), Some(&(idle[i])), "the longest left out first");
                tried += k;
                idle[i] = 0;
            }
        }
        let share = tried as f64 / rows as f64;
        assert!(share <= PROBE_SHARE && share > 0.9 * PROBE_SHARE, "{share}");
        // Nothing to try: no try, and the credit stays bounded.
        assert_eq!(probes.pick(32, &[(0, 3, 6), (1, 100, 0)]), None);
    }

    #[test]
    fn acceptance_counts_guesses_kept_and_the_first_rejected_with_a_prior() {
        let mut a = Acceptance::new(Acceptance::OWN);
        assert_eq!(a.rate(0.7, 2.0), 0.7, "no record: the prior");
        a.observe(4, 4);
        assert!((a.rate(0.5, 2.0) - 5.0 / 6.0).abs() < 1e-12);
        a.observe(3, 0);
        // 4 × 0.8 kept, 1 rejected.
        assert!((a.rate(0.5, 2.0) - (3.2 + 1.0) / (3.2 + 1.0 + 2.0)).abs() < 1e-12);
        a.observe(0, 0);
        assert!(
            (a.rate(0.5, 2.0) - (3.2 + 1.0) / (3.2 + 1.0 + 2.0)).abs() < 1e-12,
            "no guess, no round"
        );
        let mut failing = Acceptance::new(Acceptance::OWN);
        for _ in 0..50 {
            failing.observe(2, 0);
        }
        assert!(failing.rate(0.5, 2.0) < 0.2);
    }

    #[test]
    fn prompt_lookup_continues_the_latest_match_of_the_longest_suffix() {
        let t = [1, 2, 3, 4, 9, 9, 2, 3, 4, 7, 8, 5, 2, 3, 4];
        // "2 3 4" last occurred before "7 8 5".
        assert_eq!(ngram_proposal(&t, 3), vec![7, 8, 5]);
        assert_eq!(ngram_proposal(&t, 10), vec![7, 8, 5, 2, 3, 4]);
        assert_eq!(
            ngram_proposal(&[1, 2, 3], 4),
            Vec::<u32>::new(),
            "no earlier occurrence"
        );
        assert_eq!(ngram_proposal(&[5, 6, 5, 6], 2), vec![5, 6]);
        assert_eq!(ngram_proposal(&t, 0), Vec::<u32>::new());
    }

    #[test]
    fn the_draft_length_follows_acceptance_and_failing_guesses_pause() {
        let mut s = SpecState::new(6);
        assert_eq!(s.next_k(), 3);
        s.observe(3, 3);
        assert_eq!(s.next_k(), 4);
        s.observe(4, 1);
        assert_eq!(s.next_k(), 2);
        let mut failures = 0;
        loop {
            let k = s.next_k();
            if k == 0 {
                break;
            }
            s.observe(k, 0);
            failures += 1;
            assert!(failures < 10, "failing guesses never paused");
        }
        let paused = 1 + (0..20).take_while(|_| s.next_k() == 0).count();
        assert_eq!(paused, 8, "a first pause of eight steps");
        assert_eq!(s.next_k(), 1, "then a single guess");
    }
}
