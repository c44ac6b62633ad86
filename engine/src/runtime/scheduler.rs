//! Iteration-level scheduling (Orca, Yu et al., 2022) over the paged KV cache,
//! with chunked pre-fill under a per-step token budget (Sarathi, Agrawal et al.,
//! 2023) and two lanes.
//!
//! Every step the scheduler decides which sequences run and how many of their
//! tokens: sequences join and leave at any step. The real-time lane goes first
//! in everything (admission, decoding, pre-fill) and has reserved capacity:
//! batch work may not take the last `rt_reserved_seqs` sequence slots, nor
//! be admitted into the last `rt_reserved_blocks` KV blocks. When blocks run
//! out, the newest sequence not yet planned for this step is preempted —
//! batch before real time — its blocks freed, to be recomputed from its tokens
//! when it is admitted again.
//!
//! While real-time work is present the engine hands the scheduler a [`Pace`]
//! (its measured step cost): batch work then rides along in every step, but
//! only as many batch tokens as keep the step within `1 + slack` times what
//! its real-time work alone would cost, batch sequences taking turns (the
//! least recently run first) when not all of them fit. A chat user's tokens
//! so come at nearly an idle engine's pace whatever the model's size, and the
//! batch lane keeps most of the engine. On a model whose steps are too cheap
//! to be worth pacing, batch sequences instead sit out (keeping their
//! blocks) the steps the engine says they owe — a time in proportion to
//! what they took of the last step they shared ([`Share::Timed`]); before
//! the engine has a measure of its steps, for up to `rt_hold_steps` steps in
//! a row, then share one step ([`Share::Counted`]). Whatever
//! the lanes, batch work keeps a step within the tokens the engine allows it
//! (its step-time bound; batch decodes take turns, each whole, the least
//! recently run first): a real-time request that arrives while none runs
//! waits for the step in flight, and that step is never a long one.
//!
//! Prefix caching: a sequence arrives with the hashes of its prompt's full
//! blocks ([`crate::runtime::kv::prefix`]); when it is admitted, every leading block
//! already cached is shared into its table and only the rest is pre-filled
//! (the last prompt token is always computed, for its logits). Blocks become
//! shareable once their keys and values are computed and their tokens final:
//! after the step that computed them ([`Scheduler::step_done`]) or when their
//! sequence ends. A cached block nobody holds counts as free, so the
//! real-time reservation is never held by the cache.
//!
//! Speculative decoding: the engine may [`Scheduler::propose`] draft tokens for
//! a decoding sequence; its next chunk then computes its last token and the
//! drafts in one pass, and after verification the engine
//! [`Scheduler::rollback`]s the rejected drafts' keys and values.
//!
//! Accounts: when batch sequences of several accounts wait, the next slot
//! goes to the account with the fewest batch sequences running for its
//! share. An account's backlog is what it has running, waiting, and what its
//! latest request said is held elsewhere (e.g. in the dispatcher); the
//! largest backlog's share is 1, a smaller one's the ratio of the largest to
//! it, at least 2 and at most [`MAX_SHARE`] (among equals, the smaller
//! backlog, then arrival order, as within an account). A worker holding many
//! of one account's requests so gives another account's few most of the
//! slots as they free, instead of starting them after all of those: a batch a
//! hundredth of another's takes 16 slots for its one; two backlogs of about
//! the same size take two for one, the smaller first. The largest backlog
//! keeps a slot in 17, and any account with none running takes the next
//! slot before one with some: no account waiting is starved. With one
//! account waiting, admission is arrival order.
//!
//! This is a pure state machine: it holds no tokens and runs no model, so it is
//! tested directly. The engine thread owns it.

use std::collections::{HashMap, VecDeque};

use crate::runtime::kv::{BlockHash, BlockPool, BlockTable, PrefixStats};
use crate::runtime::pace::Share;
use crate::Lane;

/// The most slots a smaller backlog takes for each of the largest's one
/// (see the module's doc on accounts).
pub(crate) const MAX_SHARE: usize = 16;

/// A sequence's handle in the scheduler.
pub(crate) type SeqId = u64;

/// Whose share of batch admission a sequence counts against (a digest of its account).
pub(crate) type AccountKey = u64;

/// How sequences are admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Admit whenever there is room: sequences join and leave at every step.
    Continuous,
    /// Form a batch, run it until its last sequence ends, then form the next (static batching; for comparison).
    Static,
}

/// Limits of the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SchedulerConfig {
    /// Sequences running at once.
    pub max_seqs: usize,
    /// Tokens computed per step, decoding and pre-fill together.
    pub token_budget: usize,
    /// Sequence slots batch work may not take.
    pub rt_reserved_seqs: usize,
    /// KV blocks batch admission must leave free.
    pub rt_reserved_blocks: usize,
    /// Steps in a row batch work sits out while real-time sequences run (0: never).
    pub rt_hold_steps: usize,
    /// Admission policy.
    pub policy: Policy,
}

/// One sequence's work in a step: compute its tokens `start..start + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// Which sequence.
    pub id: SeqId,
    /// Its first token to compute (tokens before it are cached).
    pub start: usize,
    /// Tokens to compute.
    pub len: usize,
    /// Whether this computes the sequence's last known token, so a new one is sampled.
    pub samples: bool,
    /// Proposed tokens after the last known one, computed for verification
    /// (the chunk's last `draft` tokens).
    pub draft: usize,
}

/// A step's plan.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    /// What runs, real time first.
    pub chunks: Vec<Chunk>,
    /// Sequences that lost their KV blocks this step and wait to be recomputed.
    pub preempted: Vec<SeqId>,
}

#[derive(Debug)]
struct Seq {
    lane: Lane,
    account: AccountKey,
    /// Tokens known (prompt and generated).
    tokens: usize,
    /// Tokens whose keys and values are cached.
    computed: usize,
    table: BlockTable,
    /// Arrival order, which decides who is newest.
    order: u64,
    running: bool,
    /// Tokens sampled so far.
    generated: usize,
    /// Hashes of the full blocks of its known tokens (empty: not cached).
    hashes: Vec<BlockHash>,
    /// Leading blocks of `table` that are in the prefix cache.
    cached: usize,
    /// Draft tokens proposed for its next step.
    draft: usize,
    /// When it last ran, as a count of chunks planned: batch sequences take
    /// turns in this order when not all fit in a step.
    turn: u64,
}

/// The scheduler's state.
#[derive(Debug)]
pub(crate) struct Scheduler {
    config: SchedulerConfig,
    pool: BlockPool,
    seqs: HashMap<SeqId, Seq>,
    waiting_rt: VecDeque<SeqId>,
    waiting_batch: VecDeque<SeqId>,
    /// Batch sequences waiting, by account.
    waiting_accounts: HashMap<AccountKey, usize>,
    /// Batch sequences held elsewhere, by account ([`Scheduler::held_elsewhere`]).
    elsewhere: HashMap<AccountKey, usize>,
    /// Running sequences in arrival order.
    running: Vec<SeqId>,
    arrivals: u64,
    preemptions: u64,
    /// Steps in a row batch work has sat out.
    held: usize,
    /// Chunks planned so far.
    turns: u64,
}

impl Scheduler {
    /// A scheduler handing out `pool`'s blocks.
    pub fn new(config: SchedulerConfig, pool: BlockPool) -> Self {
        assert!(
            config.token_budget >= config.max_seqs,
            "every running sequence must be able to decode in one step"
        );
        Scheduler {
            config,
            pool,
            seqs: HashMap::new(),
            waiting_rt: VecDeque::new(),
            waiting_batch: VecDeque::new(),
            waiting_accounts: HashMap::new(),
            elsewhere: HashMap::new(),
            running: Vec::new(),
            arrivals: 0,
            preemptions: 0,
            held: 0,
            turns: 0,
        }
    }

    /// Tokens computed per step at most.
    pub(crate) fn token_budget(&self) -> usize {
        self.config.token_budget
    }

    /// The most tokens one sequence can ever hold.
    pub(crate) fn capacity_tokens(&self) -> usize {
        self.pool.total_blocks() * self.pool.block_size()
    }

    /// `account` has `backlog` batch sequences held elsewhere, not yet here
    /// (the latest figure stands): counted in its backlog beside those
    /// running and waiting here, until none of its sequences waits.
    pub fn held_elsewhere(&mut self, account: AccountKey, backlog: usize) {
        if backlog == 0 {
            self.elsewhere.remove(&account);
        } else {
            self.elsewhere.insert(account, backlog);
        }
    }

    /// Queue a new sequence of `account`'s, of `tokens` prompt tokens, with the
    /// hashes of the prompt's full blocks (none: the prefix cache is not used for it).
    pub fn add(&mut self, id: SeqId, lane: Lane, account: AccountKey, tokens: usize, hashes: Vec<BlockHash>) {
        self.arrivals += 1;
        let seq = Seq {
            lane,
            account,
            tokens,
            computed: 0,
            table: BlockTable::default(),
            order: self.arrivals,
            running: false,
            generated: 0,
            hashes,
            cached: 0,
            draft: 0,
            turn: 0,
        };
        self.seqs.insert(id, seq);
        match lane {
            Lane::RealTime => self.waiting_rt.push_back(id),
            Lane::Batch => {
                self.waiting_batch.push_back(id);
                *self.waiting_accounts.entry(account).or_default() += 1;
            }
        }
    }

    /// A token was sampled for `id`: it has one more token to compute.
    #[cfg(test)]
    pub(crate) fn append_token(&mut self, id: SeqId) {
        self.append_tokens(id, 1, &[]);
    }

    /// `n` tokens were sampled (or accepted) for `id`, completing the blocks `hashes` names.
    pub(crate) fn append_tokens(&mut self, id: SeqId, n: usize, hashes: &[BlockHash]) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.tokens += n;
            seq.generated += n;
            seq.hashes.extend_from_slice(hashes);
        }
    }

    /// Compute `draft` proposed tokens with `id`'s next decoding step.
    pub(crate) fn propose(&mut self, id: SeqId, draft: usize) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.draft = draft;
        }
    }

    /// Only `id`'s first `computed` tokens have valid keys and values (the rest
    /// were rejected drafts): give back the blocks past them.
    pub fn rollback(&mut self, id: SeqId, computed: usize) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            if computed < seq.computed {
                seq.computed = computed;
                seq.table.truncate(&mut self.pool, computed);
                seq.cached = seq.cached.min(seq.table.blocks().len());
            }
        }
    }

    /// The step planned as `plan` ran: the blocks it filled with final tokens can be shared.
    pub(crate) fn step_done(&mut self, plan: &Plan) {
        for chunk in &plan.chunks {
            if let Some(seq) = self.seqs.get_mut(&chunk.id) {
                cache_blocks(seq, &mut self.pool);
            }
        }
    }

    /// `id` is done (finished or cancelled): forget it and free its blocks,
    /// keeping the full ones with final tokens in the prefix cache.
    pub fn remove(&mut self, id: SeqId) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            cache_blocks(seq, &mut self.pool);
        }
        self.discard(id);
    }

    /// `id` failed: forget it and free its blocks, caching none of what its last step wrote.
    pub(crate) fn discard(&mut self, id: SeqId) {
        if let Some(mut seq) = self.seqs.remove(&id) {
            seq.table.release(&mut self.pool);
            self.running.retain(|&r| r != id);
            self.waiting_rt.retain(|&r| r != id);
            if let Some(at) = self.waiting_batch.iter().position(|&r| r == id) {
                self.waiting_batch.remove(at);
                self.left_waiting(seq.account);
            }
        }
    }

    /// The prefix cache's counters.
    pub(crate) fn prefix_stats(&self) -> PrefixStats {
        self.pool.stats()
    }

    /// Ids of the running sequences that decode next: one known token to
    /// compute, and at least one generated (a pre-fill whose last chunk is
    /// one token is not decoding: guesses riding on it would make the
    /// request's first tokens depend on how its pre-fill was cut).
    pub fn decoding(&self) -> Vec<SeqId> {
        self.running
            .iter()
            .copied()
            .filter(|id| {
                let s = &self.seqs[id];
                s.computed + 1 == s.tokens && s.generated > 0
            })
            .collect()
    }

    /// The blocks of a sequence, in token order.
    pub fn blocks(&self, id: SeqId) -> &[crate::runtime::kv::BlockId] {
        self.seqs.get(&id).map_or(&[], |s| s.table.blocks())
    }

    /// Whether real-time work is running or waiting.
    pub(crate) fn has_real_time(&self) -> bool {
        !self.waiting_rt.is_empty() || self.running.iter().any(|id| self.seqs[id].lane == Lane::RealTime)
    }

    /// Whether nothing is queued or running.
    pub(crate) fn is_idle(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Sequences running and waiting.
    pub(crate) fn counts(&self) -> (usize, usize) {
        (self.running.len(), self.waiting_rt.len() + self.waiting_batch.len())
    }

    /// Preemptions so far.
    #[cfg(test)]
    pub(crate) fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// Free KV blocks.
    pub(crate) fn free_blocks(&self) -> usize {
        self.pool.free_blocks()
    }

    /// KV blocks in all.
    pub(crate) fn total_blocks(&self) -> usize {
        self.pool.total_blocks()
    }

    /// Decide the next step; `share` says how batch work shares it with
    /// real-time work, and batch pre-fill never takes a step past
    /// `max_tokens` (batch decodes take turns within it, each whole; the
    /// first in turn always runs).
    pub fn schedule(&mut self, share: Share, max_tokens: usize) -> Plan {
        let mut plan = Plan::default();
        self.admit_real_time(&mut plan);
        let mut budget = self.config.token_budget;
        let decoding = |s: &Seq| s.computed + 1 == s.tokens && s.computed > 0;
        let by_lane_and_age = |lane: Lane, decode: bool, this: &Self| -> Vec<SeqId> {
            this.running
                .iter()
                .copied()
                .filter(|id| {
                    let s = &this.seqs[id];
                    s.lane == lane && decoding(s) == decode
                })
                .collect()
        };
        let real_time = self.running.iter().any(|id| self.seqs[id].lane == Lane::RealTime);
        let (hold, pace) = match share {
            Share::Counted => (real_time && self.held < self.config.rt_hold_steps, None),
            Share::Paced(pace) => (false, Some(pace)),
            Share::Timed { sits_out } => (real_time && sits_out, None),
        };
        self.held = if hold { self.held + 1 } else { 0 };
        let batch_decodes = if hold {
            0
        } else {
            by_lane_and_age(Lane::Batch, true, self).len()
        };
        for id in by_lane_and_age(Lane::RealTime, true, self) {
            self.plan_one(id, &mut budget, 0, &mut plan);
        }
        // A real-time pre-fill leaves room for the batch decodes the pace allows.
        let rt_decode_tokens = self.config.token_budget - budget;
        let reserve = pace.map_or(batch_decodes, |p| {
            batch_decodes.min(p.batch_tokens(rt_decode_tokens, self.config.token_budget))
        });
        for id in by_lane_and_age(Lane::RealTime, false, self) {
            self.plan_one(id, &mut budget, reserve, &mut plan);
        }
        if hold {
            return plan;
        }
        if let Some(pace) = pace {
            let rt_tokens = self.config.token_budget - budget;
            budget = budget.min(pace.batch_tokens(rt_tokens, budget));
        }
        // Least recently run first: when the budget or the step's bound
        // cannot take every batch decode, the ones left out go first next step.
        let mut batch = by_lane_and_age(Lane::Batch, true, self);
        batch.sort_by_key(|id| self.seqs[id].turn);
        let planned: usize = plan.chunks.iter().map(|c| c.len).sum();
        let clock_room = max_tokens.saturating_sub(planned);
        let mut room = budget.min(clock_room);
        // Where the clock bounds the step (the pace, or the step's bound), a
        // decode runs whole or waits its turn: cutting its guesses short
        // would make its tokens depend on the clock. The first in turn
        // always runs, so none waits forever. The token budget alone cuts
        // guesses, as the rules say.
        let by_clock = pace.is_some() || clock_room < budget;
        let mut first = true;
        for id in batch {
            let seq = &self.seqs[&id];
            let need = (seq.tokens + seq.draft).saturating_sub(seq.computed);
            if by_clock && need > room {
                if !first {
                    continue;
                }
                room = need;
            }
            first = false;
            let before = room;
            self.plan_one(id, &mut room, 0, &mut plan);
            budget = budget.saturating_sub(before - room);
        }
        // Pre-fill and admission within the step's bound, a token at least
        // so that new work always starts.
        let planned: usize = plan.chunks.iter().map(|c| c.len).sum();
        budget = budget.min(max_tokens.saturating_sub(planned).max(1));
        for id in by_lane_and_age(Lane::Batch, false, self) {
            self.plan_one(id, &mut budget, 0, &mut plan);
        }
        self.admit_batch(&mut budget, &mut plan);
        plan
    }

    /// Real-time sequences join at once while there is a slot, taking batch slots if need be.
    fn admit_real_time(&mut self, plan: &mut Plan) {
        while let Some(&id) = self.waiting_rt.front() {
            if self.running.len() >= self.config.max_seqs {
                match self.victim(plan, Some(Lane::Batch), id) {
                    Some(victim) => self.preempt(victim, plan),
                    None => break,
                }
                continue;
            }
            self.waiting_rt.pop_front();
            self.start(id);
        }
    }

    /// Batch sequences join while slots, blocks above the reserve, and budget remain.
    fn admit_batch(&mut self, budget: &mut usize, plan: &mut Plan) {
        let batch_running = |this: &Self| {
            this.running
                .iter()
                .filter(|id| this.seqs[id].lane == Lane::Batch)
                .count()
        };
        // A static batch is formed before it decodes (its prompts may take
        // several steps to pre-fill) and then runs to its end.
        let decoding = self
            .running
            .iter()
            .any(|id| self.seqs[id].lane == Lane::Batch && self.seqs[id].generated > 0);
        if self.config.policy == Policy::Static && decoding {
            return;
        }
        let batch_slots = self.config.max_seqs - self.config.rt_reserved_seqs.min(self.config.max_seqs);
        while let Some((at, id)) = self.next_batch() {
            if *budget == 0 || self.running.len() >= self.config.max_seqs || batch_running(self) >= batch_slots {
                return;
            }
            let seq = &self.seqs[&id];
            let (cached, claimed_idle) = self.pool.cached_prefix(reusable(seq, self.pool.block_size()));
            let computed = seq.computed.max(cached * self.pool.block_size());
            let take = (seq.tokens - computed).min(*budget);
            let needed = (computed + take)
                .div_ceil(self.pool.block_size())
                .saturating_sub(seq.table.blocks().len().max(cached))
                + claimed_idle;
            // Alone, a sequence may use every block: the reserve must not stall the engine.
            let reserve = if self.running.is_empty() {
                0
            } else {
                self.config.rt_reserved_blocks
            };
            if self.pool.free_blocks() < needed + reserve {
                return;
            }
            let account = seq.account;
            self.waiting_batch.remove(at);
            self.left_waiting(account);
            self.start(id);
            self.plan_one(id, budget, 0, plan);
        }
    }

    /// The waiting batch sequence admitted next, and its place in the queue:
    /// the first of the account with the fewest batch sequences running for
    /// its share of the slots (see the module's doc; among equals, the one
    /// with the smaller backlog, then the earliest).
    fn next_batch(&self) -> Option<(usize, SeqId)> {
        if self.waiting_accounts.len() <= 1 {
            return self.waiting_batch.front().map(|&id| (0, id));
        }
        let mut running: HashMap<AccountKey, usize> = HashMap::new();
        for id in &self.running {
            let seq = &self.seqs[id];
            if seq.lane == Lane::Batch {
                *running.entry(seq.account).or_default() += 1;
            }
        }
        let running_of = |account: &AccountKey| running.get(account).copied().unwrap_or(0) as u128;
        // Each waiting account's first sequence, in queue order, with its
        // running sequences and its backlog (at least its one waiting).
        let mut firsts: Vec<(usize, SeqId, AccountKey, u128, u128)> = Vec::with_capacity(self.waiting_accounts.len());
        for (at, &id) in self.waiting_batch.iter().enumerate() {
            let account = self.seqs[&id].account;
            if firsts.iter().all(|&(_, _, a, ..)| a != account) {
                let running = running_of(&account);
                let held = running
                    + self.waiting_accounts[&account] as u128
                    + self.elsewhere.get(&account).copied().unwrap_or(0) as u128;
                firsts.push((at, id, account, running, held));
                if firsts.len() == self.waiting_accounts.len() {
                    break;
                }
            }
        }
        let most = firsts.iter().map(|&(.., held)| held).max().unwrap_or(0);
        // Running sequences per share, `running / (share / held)` with
        // `share = clamp(most, 2 held, MAX_SHARE held)` (the largest's `held`):
        // compared as fractions, exactly.
        firsts
            .into_iter()
            .map(|(at, id, _, running, held)| {
                let share = if held >= most {
                    held
                } else {
                    most.clamp(2 * held, MAX_SHARE as u128 * held)
                };
                (at, id, held, running * held, share)
            })
            .min_by(
                |&(at_x, _, held_x, run_x, share_x), &(at_y, _, held_y, run_y, share_y)| {
                    (run_x * share_y)
                        .cmp(&(run_y * share_x))
                        .then(held_x.cmp(&held_y))
                        .then(at_x.cmp(&at_y))
                },
            )
            .map(|(at, id, ..)| (at, id))
    }

    /// One of `account`'s batch sequences left the queue.
    fn left_waiting(&mut self, account: AccountKey) {
        if let Some(count) = self.waiting_accounts.get_mut(&account) {
            *count -= 1;
            if *count == 0 {
                self.waiting_accounts.remove(&account);
                self.elsewhere.remove(&account);
            }
        }
    }

    fn start(&mut self, id: SeqId) {
        let seq = self.seqs.get_mut(&id).expect("queued sequences are known");
        if seq.table.is_empty() {
            let blocks = self.pool.claim(reusable(seq, self.pool.block_size()));
            seq.cached = blocks.len();
            seq.table = BlockTable::shared(&self.pool, blocks);
            seq.computed = seq.table.len();
        }
        seq.running = true;
        let order = seq.order;
        let at = self.running.partition_point(|r| self.seqs[r].order < order);
        self.running.insert(at, id);
    }

    /// Plan `id`'s next chunk, leaving `hold_back` tokens of budget for later
    /// decodes, and preempting newer sequences if its blocks do not fit.
    fn plan_one(&mut self, id: SeqId, budget: &mut usize, hold_back: usize, plan: &mut Plan) {
        let seq = &self.seqs[&id];
        if !seq.running {
            return; // preempted earlier in this step
        }
        // Guesses ride along with a decoding step only; a sequence planned
        // already this step (computed up to or past its known tokens) gets nothing more.
        let draft = if seq.computed + 1 == seq.tokens { seq.draft } else { 0 };
        let mut take = (seq.tokens + draft)
            .saturating_sub(seq.computed)
            .min(budget.saturating_sub(hold_back));
        if take == 0 {
            return;
        }
        // Guesses never cost another sequence its blocks.
        if take > 1 && draft > 0 && seq.table.blocks_needed(&self.pool, take) > self.pool.free_blocks() {
            take = 1;
        }
        loop {
            let seq = &self.seqs[&id];
            if seq.table.blocks_needed(&self.pool, take) <= self.pool.free_blocks() {
                break;
            }
            match self.victim(plan, None, id) {
                Some(victim) => self.preempt(victim, plan),
                None => {
                    self.preempt(id, plan);
                    return;
                }
            }
        }
        let seq = self.seqs.get_mut(&id).expect("planned sequences are known");
        seq.table
            .append(&mut self.pool, take)
            .expect("blocks were checked above");
        plan.chunks.push(Chunk {
            id,
            start: seq.computed,
            len: take,
            samples: seq.computed + take >= seq.tokens,
            draft: (seq.computed + take).saturating_sub(seq.tokens),
        });
        seq.computed += take;
        seq.draft = 0;
        self.turns += 1;
        seq.turn = self.turns;
        *budget -= take;
    }

    /// The newest running sequence, batch before real time (or of `lane` only),
    /// that is not `except` and has nothing planned this step.
    fn victim(&self, plan: &Plan, lane: Option<Lane>, except: SeqId) -> Option<SeqId> {
        let candidates = |want: Lane| {
            self.running
                .iter()
                .rev()
                .copied()
                .find(|&r| r != except && self.seqs[&r].lane == want && plan.chunks.iter().all(|c| c.id != r))
        };
        match lane {
            Some(lane) => candidates(lane),
            None => candidates(Lane::Batch).or_else(|| candidates(Lane::RealTime)),
        }
    }

    /// Free a running sequence's blocks and queue it, first in its lane, to be recomputed.
    fn preempt(&mut self, id: SeqId, plan: &mut Plan) {
        let seq = self.seqs.get_mut(&id).expect("running sequences are known");
        // Its computed blocks stay findable until their room is needed.
        cache_blocks(seq, &mut self.pool);
        seq.table.release(&mut self.pool);
        seq.computed = 0;
        seq.cached = 0;
        seq.draft = 0;
        seq.running = false;
        self.running.retain(|&r| r != id);
        let queue = match seq.lane {
            Lane::RealTime => &mut self.waiting_rt,
            Lane::Batch => {
                *self.waiting_accounts.entry(seq.account).or_default() += 1;
                &mut self.waiting_batch
            }
        };
        let order = seq.order;
        let at = queue.partition_point(|q| self.seqs[q].order < order);
        queue.insert(at, id);
        plan.preempted.push(id);
        self.preemptions += 1;
    }
}

/// The hashes of the prompt blocks a sequence may take from the cache: full
/// blocks before its last known token, which is computed for its logits.
fn reusable(seq: &Seq, block_size: usize) -> &[BlockHash] {
    if !seq.table.is_empty() {
        return &[];
    }
    let usable = seq.tokens.saturating_sub(1) / block_size;
    &seq.hashes[..usable.min(seq.hashes.len())]
}

/// Put a sequence's full, computed blocks of final tokens into the prefix cache.
fn cache_blocks(seq: &mut Seq, pool: &mut BlockPool) {
    let full = (seq.computed / pool.block_size())
        .min(seq.hashes.len())
        .min(seq.table.blocks().len());
    for i in seq.cached..full {
        pool.register(seq.table.blocks()[i], seq.hashes[i]);
    }
    seq.cached = seq.cached.max(full);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::pace::{Pace, StepCost};
    use crate::runtime::rng::SplitMix;

    fn config(max_seqs: usize, token_budget: usize) -> SchedulerConfig {
        SchedulerConfig {
            max_seqs,
            token_budget,
            rt_reserved_seqs: 0,
            rt_reserved_blocks: 0,
            rt_hold_steps: 0,
            policy: Policy::Continuous,
        }
    }

    /// Run a plan as the engine would: every sampling chunk yields a token.
    fn run(s: &mut Scheduler, plan: &Plan) {
        for c in &plan.chunks {
            if c.samples {
                s.append_token(c.id);
            }
        }
    }

    #[test]
    fn a_long_prompt_is_prefilled_in_chunks_while_others_decode() {
        let mut s = Scheduler::new(config(4, 8), BlockPool::new(64, 4));
        s.add(1, Lane::Batch, 0, 3, vec![]);
        let plan = s.schedule(Share::Counted, usize::MAX);
        assert_eq!(
            plan.chunks,
            vec![Chunk {
                id: 1,
                start: 0,
                len: 3,
                samples: true,
                draft: 0
            }]
        );
        run(&mut s, &plan);
        s.add(2, Lane::Batch, 0, 20, vec![]);
        let plan = s.schedule(Share::Counted, usize::MAX);
        // Sequence 1 decodes its one token; sequence 2 gets the other seven.
        assert_eq!(
            plan.chunks,
            vec![
                Chunk {
                    id: 1,
                    start: 3,
                    len: 1,
                    samples: true,
                    draft: 0
                },
                Chunk {
                    id: 2,
                    start: 0,
                    len: 7,
                    samples: false,
                    draft: 0
                },
            ]
        );
        run(&mut s, &plan);
        let plan = s.schedule(Share::Counted, usize::MAX);
        assert_eq!(
            plan.chunks[1],
            Chunk {
                id: 2,
                start: 7,
                len: 7,
                samples: false,
                draft: 0
            }
        );
    }

    #[test]
    fn real_time_work_is_admitted_first_and_into_reserved_room() {
        let mut c = config(4, 64);
        c.rt_reserved_seqs = 1;
        let mut s = Scheduler::new(c, BlockPool::new(64, 4));
        for id in 0..5 {
            s.add(id, Lane::Batch, 0, 4, vec![]);
        }
        let plan = s.schedule(Share::Counted, usize::MAX);
        assert_eq!(plan.chunks.len(), 3, "the last slot is kept for real time");
        run(&mut s, &plan);
        s.add(10, Lane::RealTime, 0, 4, vec![]);
        let plan = s.schedule(Share::Counted, usize::MAX);
        assert_eq!(plan.chunks.iter().filter(|c| c.id == 10).count(), 1);
        assert_eq!(plan.chunks.len(), 4);
    }

    #[test]
    fn batch_work_sits_out_while_real_time_runs_for_a_bounded_number_of_steps() {
        let mut c = config(8, 64);
        c.rt_hold_steps = 3;
        let mut s = Scheduler::new(c, BlockPool::new(64, 4));
        s.add(1, Lane::Batch, 0, 4, vec![]);
        s.add(2, Lane::Batch, 0, 4, vec![]);
        let plan = s.schedule(Share::Counted, usize::MAX);
        run(&mut s, &plan);
        assert_eq!(plan.chunks.len(), 2);
        s.add(10, Lane::RealTime, 0, 4, vec![]);
        s.add(3, Lane::Batch, 0, 4, vec![]);
        let ids = |plan: &Plan| plan.chunks.iter().map(|c| c.id).collect::<Vec<_>>();
        for _ in 0..3 {
            let plan = s.schedule(Share::Counted, usize::MAX);
            assert_eq!(ids(&plan), vec![10], "batch work waits while real time runs");
            run(&mut s, &plan);
        }
        // Then one step for everything, batch admission included, and the hold again.
        let plan = s.schedule(Share::Counted, usize::MAX);
        assert_eq!(ids(&plan), vec![10, 1, 2, 3]);
        run(&mut s, &plan);
        let plan = s.schedule(Share::Counted, usize::MAX);
        assert_eq!(ids(&plan), vec![10]);
        run(&mut s, &plan);
        // Once real time has ended, batch work runs every step.
        s.remove(10);
        for _ in 0..2 {
            let plan = s.schedule(Share::Counted, usize::MAX);
            assert_eq!(ids(&plan), vec![1, 2, 3]);
            run(&mut s, &plan);
        }
    }

    #[test]
    fn a_hold_in_time_lets_batch_work_sit_out_only_while_real_time_runs() {
        let mut c = config(8, 64);
        c.rt_hold_steps = 1000; // the engine's time decides, not the count
        let mut s = Scheduler::new(c, BlockPool::new(64, 4));
        s.add(1, Lane::Batch, 0, 4, vec![]);
        let ids = |plan: &Plan| plan.chunks.iter().map(|c| c.id).collect::<Vec<_>>();
        let held = Share::Timed { sits_out: true };
        let plan = s.schedule(held, usize::MAX);
        assert_eq!(ids(&plan), vec![1], "nothing to sit out for without real time");
        run(&mut s, &plan);
        s.add(10, Lane::RealTime, 0, 4, vec![]);
        s.add(2, Lane::Batch, 0, 4, vec![]);
        for _ in 0..3 {
            let plan = s.schedule(held, usize::MAX);
            assert_eq!(ids(&plan), vec![10], "batch work and its admission wait");
            run(&mut s, &plan);
        }
        let plan = s.schedule(Share::Timed { sits_out: false }, usize::MAX);
        assert_eq!(ids(&plan), vec![10, 1, 2], "owed nothing: a shared step");
        run(&mut s, &plan);
    }

    #[test]
    fn with_a_pace_batch_work_rides_along_within_its_bound_and_takes_turns() {
        let mut c = config(8, 64);
        c.rt_hold_steps = 3; // the pace replaces the hold
        let mut s = Scheduler::new(c, BlockPool::new(256, 4));
        for id in 1..=6 {
            s.add(id, Lane::Batch, 0, 4, vec![]);
        }
        let plan = s.schedule(Share::Counted, usize::MAX);
        run(&mut s, &plan);
        s.add(10, Lane::RealTime, 0, 4, vec![]);
        // A step costs 10 ms and 1 ms a token; half again over the real-time work's own cost.
        let pace = Pace {
            cost: StepCost::linear(10.0, 1.0),
            slack: 0.5,
        };
        let batch_tokens = |plan: &Plan| -> usize { plan.chunks.iter().filter(|c| c.id != 10).map(|c| c.len).sum() };
        // The real-time pre-fill (4 tokens: 14 ms alone) leaves room for 7 batch tokens.
        let plan = s.schedule(Share::Paced(pace), usize::MAX);
        assert_eq!(plan.chunks[0].id, 10, "real time first");
        assert_eq!(batch_tokens(&plan), 6, "all six batch decodes fit within 7 tokens");
        run(&mut s, &plan);
        // Decoding, real time costs 11 ms alone: 5 batch tokens ride along,
        // and the batch decodes take turns, none waiting two steps in a row.
        let mut ran: HashMap<SeqId, usize> = HashMap::new();
        let mut last: Vec<SeqId> = (1..=6).collect();
        for _ in 0..6 {
            let plan = s.schedule(Share::Paced(pace), usize::MAX);
            assert_eq!(plan.chunks[0].id, 10);
            assert_eq!(batch_tokens(&plan), 5);
            let now: Vec<SeqId> = plan.chunks.iter().map(|c| c.id).filter(|&id| id != 10).collect();
            for id in 1..=6 {
                assert!(
                    now.contains(&id) || last.contains(&id),
                    "batch sequence {id} sat out twice"
                );
            }
            for &id in &now {
                *ran.entry(id).or_default() += 1;
            }
            last = now;
            run(&mut s, &plan);
        }
        assert!(ran.values().all(|&n| n == 5), "equal turns: {ran:?}");
        // Without real time and without a pace, every batch sequence decodes each step.
        s.remove(10);
        let plan = s.schedule(Share::Counted, usize::MAX);
        assert_eq!(batch_tokens(&plan), 6);
    }

    #[test]
    fn a_step_keeps_within_its_bound_with_decodes_taking_turns_each_whole() {
        let mut s = Scheduler::new(config(8, 64), BlockPool::new(256, 4));
        for id in 1..=3 {
            s.add(id, Lane::Batch, 0, 2, vec![]);
        }
        let plan = s.schedule(Share::Counted, usize::MAX);
        run(&mut s, &plan);
        s.add(4, Lane::Batch, 0, 100, vec![]);
        // Three decodes and 7 tokens of the long prompt make 10.
        let plan = s.schedule(Share::Counted, 10);
        let decodes: Vec<usize> = plan.chunks.iter().filter(|c| c.id != 4).map(|c| c.len).collect();
        assert_eq!(decodes, vec![1, 1, 1]);
        let prompt = plan.chunks.iter().find(|c| c.id == 4).expect("the prompt starts");
        assert_eq!(prompt.len, 7);
        run(&mut s, &plan);
        // A bound under the decodes: they take turns, each whole, and a
        // token of pre-fill still gets in.
        let plan = s.schedule(Share::Counted, 2);
        let decodes: Vec<SeqId> = plan.chunks.iter().filter(|c| c.id != 4).map(|c| c.id).collect();
        assert_eq!(decodes, vec![1, 2]);
        assert_eq!(plan.chunks.iter().find(|c| c.id == 4).map(|c| c.len), Some(1));
        run(&mut s, &plan);
        let plan = s.schedule(Share::Counted, 2);
        let decodes: Vec<SeqId> = plan.chunks.iter().filter(|c| c.id != 4).map(|c| c.id).collect();
        assert_eq!(decodes, vec![3, 1], "the one left out goes first");
    }

    #[test]
    fn beside_real_time_work_batch_decodes_take_turns_within_the_step_bound() {
        let mut s = Scheduler::new(config(8, 64), BlockPool::new(256, 4));
        for id in 1..=4 {
            s.add(id, Lane::Batch, 0, 2, vec![]);
        }
        s.add(10, Lane::RealTime, 0, 2, vec![]);
        let plan = s.schedule(Share::Timed { sits_out: false }, usize::MAX);
        run(&mut s, &plan);
        let ids = |plan: &Plan| plan.chunks.iter().map(|c| c.id).collect::<Vec<_>>();
        let shared = Share::Timed { sits_out: false };
        // A bound of 3 tokens: the real-time decode and two batch decodes,
        // then the other two; each batch decode runs whole.
        let plan = s.schedule(shared, 3);
        assert_eq!(ids(&plan), vec![10, 1, 2]);
        assert!(plan.chunks.iter().all(|c| c.len == 1));
        run(&mut s, &plan);
        let plan = s.schedule(shared, 3);
        assert_eq!(ids(&plan), vec![10, 3, 4]);
        run(&mut s, &plan);
        // A bound the real-time work fills alone still moves the batch lane.
        let plan = s.schedule(shared, 1);
        assert_eq!(ids(&plan), vec![10, 1]);
        run(&mut s, &plan);
        // Without real-time work, and within the bound, every decode runs.
        s.remove(10);
        let plan = s.schedule(shared, usize::MAX);
        let mut all = ids(&plan);
        all.sort_unstable();
        assert_eq!(all, vec![1, 2, 3, 4]);
    }

    #[test]
    fn a_real_time_request_arriving_during_a_long_batch_pre_fill_decodes_before_that_pre_fill_ends() {
        for share in [
            Share::Counted,
            Share::Paced(Pace {
                cost: StepCost::linear(10.0, 0.5),
                slack: 0.5,
            }),
            Share::Timed { sits_out: false },
            Share::Timed { sits_out: true },
        ] {
            let mut s = Scheduler::new(config(4, 64), BlockPool::new(512, 4));
            s.add(1, Lane::Batch, 0, 1000, vec![]);
            let plan = s.schedule(share, usize::MAX);
            run(&mut s, &plan);
            s.add(10, Lane::RealTime, 0, 8, vec![]);
            let mut decoded = 0;
            let mut prefilled = 0;
            while decoded < 3 {
                let plan = s.schedule(share, usize::MAX);
                for c in &plan.chunks {
                    match c.id {
                        10 if c.samples => decoded += 1,
                        1 => prefilled = c.start + c.len,
                        _ => {}
                    }
                }
                run(&mut s, &plan);
            }
            assert!(prefilled < 1000, "{share:?}: the batch pre-fill ended first");
        }
    }

    #[test]
    fn batch_admission_leaves_the_reserved_blocks_free() {
        let mut c = config(8, 64);
        c.rt_reserved_blocks = 5;
        let mut s = Scheduler::new(c, BlockPool::new(8, 4));
        s.add(1, Lane::Batch, 0, 8, vec![]);
        s.add(2, Lane::Batch, 0, 8, vec![]);
        let plan = s.schedule(Share::Counted, usize::MAX);
        assert_eq!(plan.chunks.len(), 1, "a second batch sequence would eat the reserve");
        assert_eq!(s.free_blocks(), 6);
        s.add(3, Lane::RealTime, 0, 16, vec![]);
        let plan = s.schedule(Share::Counted, usize::MAX);
        assert!(plan.chunks.iter().any(|c| c.id == 3 && c.len == 16));
    }

    #[test]
    fn running_out_of_blocks_preempts_the_newest_batch_sequence() {
        let mut s = Scheduler::new(config(4, 64), BlockPool::new(4, 4));
        s.add(1, Lane::Batch, 0, 4, vec![]);
        s.add(2, Lane::Batch, 0, 4, vec![]);
        s.add(3, Lane::Batch, 0, 4, vec![]);
        s.add(4, Lane::Batch, 0, 4, vec![]);
        let plan = s.schedule(Share::Counted, usize::MAX);
        run(&mut s, &plan);
        assert_eq!((plan.chunks.len(), s.free_blocks()), (4, 0));
        // Every sequence now needs a second block: the newest give theirs up.
        let plan = s.schedule(Share::Counted, usize::MAX);
        assert_eq!(plan.preempted, vec![4, 3]);
        assert_eq!(plan.chunks.iter().map(|c| c.id).collect::<Vec<_>>(), vec![1, 2]);
        run(&mut s, &plan);
        // Sequence 4 lost its cache and will recompute all five of its tokens.
        s.remove(1);
        s.remove(2);
        let plan = s.schedule(Share::Counted, usize::MAX);
        assert_eq!(
            plan.chunks,
            vec![
                Chunk {
                    id: 3,
                    start: 0,
                    len: 5,
                    samples: true,
                    draft: 0
                },
                Chunk {
                    id: 4,
                    start: 0,
                    len: 5,
                    samples: true,
                    draft: 0
                },
            ]
        );
    }

    fn hashes(n: usize, salt: u8) -> Vec<BlockHash> {
        (0..n).map(|i| [salt.wrapping_add(i as u8); 32]).collect()
    }

    #[test]
    fn a_cached_prefix_is_shared_at_admission_and_only_the_rest_is_computed() {
        let mut s = Scheduler::new(config(4, 64), BlockPool::new(16, 4));
        // 10 tokens: two full blocks and a partial one.
        s.add(1, Lane::Batch, 0, 10, hashes(2, 0));
        let plan = s.schedule(Share::Counted, usize::MAX);
        assert_eq!((plan.chunks[0].start, plan.chunks[0].len), (0, 10));
        s.step_done(&plan);
        s.append_token(1);
        // The same two blocks, then more: only the tail is planned, on shared blocks.
        s.add(2, Lane::Batch, 0, 12, hashes(2, 0));
        let plan = s.schedule(Share::Counted, usize::MAX);
        let chunk = plan.chunks.iter().find(|c| c.id == 2).unwrap();
        assert_eq!((chunk.start, chunk.len), (8, 4));
        assert_eq!(&s.blocks(2)[..2], &s.blocks(1)[..2], "shared, not copied");
        // A prompt that is exactly its cached blocks still computes its last token.
        s.add(3, Lane::Batch, 0, 8, hashes(2, 0));
        let plan = s.schedule(Share::Counted, usize::MAX);
        let chunk = plan.chunks.iter().find(|c| c.id == 3).unwrap();
        assert_eq!((chunk.start, chunk.len), (4, 4));
        assert_eq!(s.prefix_stats().hits, 3);
        // Ended sequences leave their blocks cached and idle: they count as free.
        for id in [1, 2, 3] {
            s.remove(id);
        }
        assert_eq!(s.free_blocks(), 16);
        s.add(4, Lane::Batch, 0, 9, hashes(2, 0));
        let plan = s.schedule(Share::Counted, usize::MAX);
        assert_eq!(plan.chunks[0].start, 8, "found after its holders ended");
        // Other contents take the idle blocks when nothing else is free.
        s.remove(4);
        s.add(5, Lane::Batch, 0, 64, hashes(16, 100));
        s.schedule(Share::Counted, usize::MAX);
        assert!(s.prefix_stats().evicted > 0);
    }

    #[test]
    fn guesses_ride_with_a_decode_and_rejected_ones_are_rolled_back() {
        let mut s = Scheduler::new(config(4, 64), BlockPool::new(4, 4));
        s.add(1, Lane::Batch, 0, 4, vec![]);
        let plan = s.schedule(Share::Counted, usize::MAX);
        run(&mut s, &plan);
        s.propose(1, 3);
        let plan = s.schedule(Share::Counted, usize::MAX);
        assert_eq!(
            plan.chunks,
            vec![Chunk {
                id: 1,
                start: 4,
                len: 4,
                samples: true,
                draft: 3
            }]
        );
        assert_eq!(s.free_blocks(), 2);
        // One guess accepted, plus the target's own token: 6 known, 5 computed.
        s.rollback(1, 6);
        s.append_tokens(1, 2, &[]);
        assert_eq!(s.decoding(), vec![1]);
        // Guesses that do not fit are dropped rather than preempting anyone.
        s.add(2, Lane::Batch, 0, 7, vec![]);
        let plan = s.schedule(Share::Counted, usize::MAX);
        run(&mut s, &plan);
        assert_eq!(s.free_blocks(), 0);
        s.propose(1, 4);
        let plan = s.schedule(Share::Counted, usize::MAX);
        assert!(plan.preempted.is_empty());
        assert_eq!(plan.chunks[0].len, 1);
        assert_eq!(plan.chunks[0].draft, 0);
    }

    #[test]
    fn static_batching_waits_for_the_whole_batch() {
        let mut c = config(2, 64);
        c.policy = Policy::Static;
        let mut s = Scheduler::new(c, BlockPool::new(64, 4));
        for id in 0..3 {
            s.add(id, Lane::Batch, 0, 2, vec![]);
        }
        let plan = s.schedule(Share::Counted, usize::MAX);
        assert_eq!(plan.chunks.len(), 2, "the batch fills before it decodes");
        run(&mut s, &plan);
        s.remove(0);
        let plan = s.schedule(Share::Counted, usize::MAX);
        assert_eq!(plan.chunks.iter().map(|c| c.id).collect::<Vec<_>>(), vec![1]);
        s.remove(1);
        let plan = s.schedule(Share::Counted, usize::MAX);
        assert_eq!(plan.chunks.iter().map(|c| c.id).collect::<Vec<_>>(), vec![2]);
    }

    #[test]
    fn random_traffic_finishes_every_sequence_and_frees_every_block() {
        let mut s = Scheduler::new(
            SchedulerConfig {
                max_seqs: 6,
                token_budget: 24,
                rt_reserved_seqs: 1,
                rt_reserved_blocks: 2,
                rt_hold_steps: 3,
                policy: Policy::Continuous,
            },
            BlockPool::new(24, 4),
        );
        let mut rng = SplitMix::new(11);
        let mut remaining: HashMap<SeqId, usize> = HashMap::new();
        let mut next = 0;
        for step in 0..200_000 {
            if step >= 2_000 && s.is_idle() {
                break;
            }
            if step < 2_000 && rng.next_u64().is_multiple_of(3) {
                let lane = if rng.next_u64().is_multiple_of(4) {
                    Lane::RealTime
                } else {
                    Lane::Batch
                };
                let account = rng.next_u64() % 3;
                s.add(next, lane, account, 1 + (rng.next_u64() % 30) as usize, vec![]);
                remaining.insert(next, 1 + (rng.next_u64() % 40) as usize);
                next += 1;
            }
            let plan = s.schedule(Share::Counted, usize::MAX);
            assert!(plan.chunks.iter().map(|c| c.len).sum::<usize>() <= 24);
            for c in &plan.chunks {
                if c.samples {
                    let left = remaining.get_mut(&c.id).unwrap();
                    *left -= 1;
                    if *left == 0 {
                        s.remove(c.id);
                        remaining.remove(&c.id);
                    } else {
                        s.append_token(c.id);
                    }
                }
            }
        }
        assert!(
            remaining.is_empty(),
            "{} sequences never finished; {:?} running/waiting, {} free, {:?}",
            remaining.len(),
            s.counts(),
            s.free_blocks(),
            s.seqs
                .iter()
                .map(|(id, q)| (id, q.lane, q.tokens, q.computed, q.running))
                .collect::<Vec<_>>()
        );
        assert!(s.is_idle());
        assert!(s.waiting_accounts.is_empty(), "{:?}", s.waiting_accounts);
        assert_eq!(s.free_blocks(), 24);
        assert!(s.preemptions() > 0, "the pool was meant to run short");
    }

    /// The sequences `plan` started (added to `running`).
    fn started(plan: &Plan, running: &mut Vec<SeqId>) -> Vec<SeqId> {
        let new: Vec<SeqId> = plan
            .chunks
            .iter()
            .map(|c| c.id)
            .filter(|id| !running.contains(id))
            .collect();
        running.extend(&new);
        new
    }

    /// Start what `plan` admits after `done` end; which started.
    fn finish(s: &mut Scheduler, running: &mut Vec<SeqId>, done: &[SeqId]) -> Vec<SeqId> {
        for &id in done {
            s.remove(id);
            running.retain(|&r| r != id);
        }
        let plan = s.schedule(Share::Counted, usize::MAX);
        started(&plan, running)
    }

    #[test]
    fn accounts_take_turns_at_admission_the_one_with_fewest_running_first() {
        // Two slots; account 1 queued three sequences before account 2 queued three.
        let mut s = Scheduler::new(config(2, 64), BlockPool::new(64, 4));
        for id in 0..3 {
            s.add(id, Lane::Batch, 1, 4, vec![]);
        }
        for id in 10..13 {
            s.add(id, Lane::Batch, 2, 4, vec![]);
        }
        let mut running = Vec::new();
        // Three each: the earliest first, then the one with none running.
        assert_eq!(finish(&mut s, &mut running, &[]), vec![0, 10]);
        // Account 1's ends: it has none running against account 2's one.
        assert_eq!(finish(&mut s, &mut running, &[0]), vec![1]);
        // Account 2's ends: it has none running.
        assert_eq!(finish(&mut s, &mut running, &[10]), vec![11]);
        assert_eq!(finish(&mut s, &mut running, &[1]), vec![2]);
        // Only account 2 waits now: arrival order.
        assert_eq!(finish(&mut s, &mut running, &[11]), vec![12]);
        assert!(s.waiting_accounts.is_empty());
    }

    /// On `slots` slots, account 1's `many` sequences (ids from 0) start,
    /// then account 2's `few` (ids from 100) are queued behind the rest of
    /// them, and the oldest running sequence ends, step after step: the
    /// order in which they all start.
    fn few_behind_many(slots: usize, many: u64, few: u64) -> Vec<SeqId> {
        behind_held_elsewhere(slots, many, few, 0)
    }

    /// [`few_behind_many`], the first account also holding `elsewhere` sequences elsewhere.
    fn behind_held_elsewhere(slots: usize, many: u64, few: u64, elsewhere: usize) -> Vec<SeqId> {
        let mut s = Scheduler::new(config(slots, 64), BlockPool::new(64, 4));
        s.held_elsewhere(1, elsewhere);
        for id in 0..many {
            s.add(id, Lane::Batch, 1, 4, vec![]);
        }
        let mut running: Vec<SeqId> = Vec::new();
        let mut order = finish(&mut s, &mut running, &[]);
        for id in 100..100 + few {
            s.add(id, Lane::Batch, 2, 4, vec![]);
        }
        while !s.is_idle() {
            let done = running[0];
            order.extend(finish(&mut s, &mut running, &[done]));
        }
        order
    }

    #[test]
    fn a_few_requests_behind_another_accounts_many_share_the_slots_as_they_free() {
        // In arrival order account 2 would start after all eight; on two
        // slots it takes every other one that frees.
        assert_eq!(few_behind_many(2, 8, 3), vec![0, 1, 100, 2, 101, 3, 102, 4, 5, 6, 7]);
    }

    #[test]
    fn the_smaller_backlog_gets_two_slots_for_the_larger_ones_one() {
        // Account 2 has fewer here, so its running sequences count at half;
        // account 1 still gets every third slot.
        assert_eq!(
            few_behind_many(3, 10, 6),
            vec![0, 1, 2, 100, 101, 3, 102, 103, 4, 104, 105, 5, 6, 7, 8, 9]
        );
    }

    #[test]
    fn a_backlog_far_smaller_than_the_largest_takes_most_of_the_slots_as_they_free() {
        // Account 1 also holds 1,000 elsewhere: account 2's eight are under
        // a sixteenth of its backlog and take every slot that frees while
        // account 1 has one running (at two for one, account 1 would get
        // every third); with none running, account 1 takes the next (8), so
        // it is never starved.
        assert_eq!(
            behind_held_elsewhere(8, 16, 8, 1_000),
            vec![0, 1, 2, 3, 4, 5, 6, 7, 100, 101, 102, 103, 104, 105, 106, 8, 107, 9, 10, 11, 12, 13, 14, 15]
        );
    }

    #[test]
    fn what_an_account_holds_elsewhere_counts_in_its_backlog() {
        // As many here from each: neither is the smaller backlog for long,
        // and the first's last sequence starts before the second's third.
        assert_eq!(
            behind_held_elsewhere(3, 6, 6, 0),
            vec![0, 1, 2, 100, 3, 4, 101, 5, 102, 103, 104, 105]
        );
        // The first also holds 100 elsewhere (a large batch still in the
        // dispatcher): the second, whose whole batch is here, is the smaller
        // backlog and gets two slots for the first's one.
        assert_eq!(
            behind_held_elsewhere(3, 6, 6, 100),
            vec![0, 1, 2, 100, 101, 3, 102, 103, 4, 104, 105, 5]
        );
        // A figure of 0 forgets it; so does the account's last waiting sequence leaving.
        let mut s = Scheduler::new(config(2, 64), BlockPool::new(64, 4));
        s.held_elsewhere(1, 100);
        s.held_elsewhere(1, 0);
        assert!(s.elsewhere.is_empty());
        s.held_elsewhere(1, 100);
        s.add(0, Lane::Batch, 1, 4, vec![]);
        let mut running = Vec::new();
        finish(&mut s, &mut running, &[]);
        assert!(s.elsewhere.is_empty());
    }
}
