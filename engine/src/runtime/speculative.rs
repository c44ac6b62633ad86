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
//! Each sequence adapts its draft length to its acceptance ([`SpecState`]) and
//! stops speculating for a while when guesses keep failing; a step speculates
//! only while at most [`SpecConfig::batch_limit`] sequences decode, because a
//! large batch already keeps the cores busy and verifying guesses there costs
//! more than the steps it saves. The limit depends on the proposer: prompt
//! lookup's guesses cost only their verification rows, a draft model's also
//! its own passes.

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
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig {
            proposer: Proposer::Ngram,
            max_draft: 6,
            max_batch: None,
            sampled: false,
        }
    }
}

/// Prompt lookup's default [`SpecConfig::batch_limit`]: the largest batch
/// measured (`lorry bench speculative`), where it still paid.
pub(crate) const NGRAM_BATCH_LIMIT: usize = 32;
/// A draft model's: beyond it, its passes cost more than they save.
pub(crate) const DRAFT_BATCH_LIMIT: usize = 2;

impl SpecConfig {
    /// The most sequences decoding in a step that speculates.
    pub fn batch_limit(&self) -> usize {
        self.max_batch.unwrap_or(match self.proposer {
            Proposer::Off => 0,
            Proposer::Ngram => NGRAM_BATCH_LIMIT,
            Proposer::Draft => DRAFT_BATCH_LIMIT,
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

/// One sequence's speculation: its draft length and recent acceptance.
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
        }
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
    fn each_proposer_speculates_up_to_its_own_batch_limit_unless_one_is_set() {
        let config = |proposer, max_batch| SpecConfig {
            proposer,
            max_batch,
            ..SpecConfig::default()
        };
        assert_eq!(config(Proposer::Ngram, None).batch_limit(), NGRAM_BATCH_LIMIT);
        assert_eq!(config(Proposer::Draft, None).batch_limit(), DRAFT_BATCH_LIMIT);
        assert_eq!(config(Proposer::Off, None).batch_limit(), 0);
        assert_eq!(config(Proposer::Draft, Some(12)).batch_limit(), 12);
        assert_eq!(config(Proposer::Ngram, Some(0)).batch_limit(), 0);
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
