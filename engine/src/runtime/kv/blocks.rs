//! Blocks, the pool that owns them (and the prefix cache's index of full
//! blocks by contents), and per-sequence block tables.
//!
//! A [`BlockPool`] of fixed-size blocks keeps a free list and reference
//! counts and is the blocks' one owner; a [`BlockTable`] per sequence grows
//! all-or-nothing, starts from shared blocks, truncates, and maps positions
//! to slots. The pool indexes registered full blocks by hash, keeps them
//! when their last holder lets go (idle, counted as free, handed out again by
//! hash) and evicts the longest idle when it needs room, counting hits,
//! misses and evictions.

use std::collections::{BTreeMap, HashMap};

/// A block of KV slots in the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

/// Not enough free blocks; nothing was allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{needed} KV blocks needed, {free} free")]
pub struct OutOfBlocks {
    /// Blocks the operation needed.
    pub needed: usize,
    /// Blocks that were free.
    pub free: usize,
}

/// The identity of a full block's contents: a SHA-256 chained over the
/// parent block's hash, the block's token ids, and the namespace (model and
/// adapter) it was computed under. See [`crate::runtime::kv::prefix`].
pub type BlockHash = [u8; 32];

/// Counters of the prefix cache, in blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Leading prompt blocks found cached at admission.
    pub hits: u64,
    /// Leading prompt blocks looked up and not found.
    pub misses: u64,
    /// Cached blocks nobody held, taken back for new work.
    pub evicted: u64,
}

/// Every block of the cache, with its reference count; the one owner of that state.
///
/// A full block whose contents are known ([`BlockPool::register`]) stays
/// cached when its last holder lets go: it is idle, counts as free, and is
/// handed out again by hash ([`BlockPool::claim`]) until an allocation that
/// finds no never-used block takes the least recently idled one.
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    refcounts: Vec<u32>,
    free: Vec<BlockId>,
    hash_of: Vec<Option<BlockHash>>,
    by_hash: HashMap<BlockHash, BlockId>,
    /// Cached blocks nobody holds, by when they went idle (oldest first).
    idle: BTreeMap<u64, BlockId>,
    idle_since: Vec<u64>,
    ticks: u64,
    stats: PrefixStats,
}

impl BlockPool {
    /// `num_blocks` blocks of `block_size` token slots each.
    pub fn new(num_blocks: u32, block_size: usize) -> Self {
        assert!(block_size > 0, "a block holds at least one token");
        BlockPool {
            block_size,
            refcounts: vec![0; num_blocks as usize],
            // Popped from the end: low ids are handed out first.
            free: (0..num_blocks).rev().map(BlockId).collect(),
            hash_of: vec![None; num_blocks as usize],
            by_hash: HashMap::new(),
            idle: BTreeMap::new(),
            idle_since: vec![0; num_blocks as usize],
            ticks: 0,
            stats: PrefixStats::default(),
        }
    }

    /// Add `n` fresh blocks (their ids follow the existing ones).
    pub(crate) fn grow(&mut self, n: usize) {
        let old = self.refcounts.len() as u32;
        self.refcounts.resize(old as usize + n, 0);
        self.hash_of.resize(old as usize + n, None);
        self.idle_since.resize(old as usize + n, 0);
        let mut fresh: Vec<BlockId> = (old..old + n as u32).rev().map(BlockId).collect();
        // Keep the old free blocks on top so they are handed out first.
        fresh.append(&mut self.free);
        self.free = fresh;
    }

    /// Token slots per block.
    pub(crate) fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks nobody holds: never used, or cached and idle.
    pub(crate) fn free_blocks(&self) -> usize {
        self.free.len() + self.idle.len()
    }

    /// All blocks.
    pub(crate) fn total_blocks(&self) -> usize {
        self.refcounts.len()
    }

    /// How many holders a block has.
    #[cfg(test)]
    pub(crate) fn refcount(&self, block: BlockId) -> u32 {
        self.refcounts[block.0 as usize]
    }

    /// The prefix cache's counters.
    pub fn stats(&self) -> PrefixStats {
        self.stats
    }

    /// Take `n` blocks, or none if fewer are free: never-used blocks first,
    /// then the cached blocks that have been idle longest, forgotten.
    pub(crate) fn allocate(&mut self, n: usize) -> Result<Vec<BlockId>, OutOfBlocks> {
        if n > self.free_blocks() {
            return Err(OutOfBlocks {
                needed: n,
                free: self.free_blocks(),
            });
        }
        let fresh = n.min(self.free.len());
        let mut taken: Vec<BlockId> = self.free.split_off(self.free.len() - fresh);
        taken.reverse();
        while taken.len() < n {
            let (_, block) = self.idle.pop_first().expect("counted above");
            if let Some(hash) = self.hash_of[block.0 as usize].take() {
                self.by_hash.remove(&hash);
            }
            self.stats.evicted += 1;
            taken.push(block);
        }
        for block in &taken {
            self.refcounts[block.0 as usize] = 1;
        }
        Ok(taken)
    }

    /// Add a holder to a block that is in use (sharing without copying).
    pub fn share(&mut self, block: BlockId) {
        let count = &mut self.refcounts[block.0 as usize];
        assert!(*count > 0, "sharing a free block {block:?}");
        *count += 1;
    }

    /// Drop one holder; the block is free again when none is left (idle, if cached).
    pub fn release(&mut self, block: BlockId) {
        let count = &mut self.refcounts[block.0 as usize];
        assert!(*count > 0, "releasing a free block {block:?}");
        *count -= 1;
        if *count == 0 {
            if self.hash_of[block.0 as usize].is_some() {
                self.ticks += 1;
                self.idle.insert(self.ticks, block);
                self.idle_since[block.0 as usize] = self.ticks;
            } else {
                self.free.push(block);
            }
        }
    }

    /// Record that `block`, which is held and full, holds the contents `hash`
    /// names, so later sequences may share it. A block already cached, or
    /// contents already cached in another block, are left as they are.
    pub fn register(&mut self, block: BlockId, hash: BlockHash) {
        let at = block.0 as usize;
        debug_assert!(self.refcounts[at] > 0, "registering a free block {block:?}");
        if self.hash_of[at].is_some() || self.by_hash.contains_key(&hash) {
            return;
        }
        self.hash_of[at] = Some(hash);
        self.by_hash.insert(hash, block);
    }

    /// How many of `hashes`, from the first, are cached, and how many of those are idle.
    pub fn cached_prefix(&self, hashes: &[BlockHash]) -> (usize, usize) {
        let mut idle = 0;
        let found = hashes
            .iter()
            .map_while(|h| self.by_hash.get(h))
            .inspect(|b| idle += usize::from(self.refcounts[b.0 as usize] == 0))
            .count();
        (found, idle)
    }

    /// Hold the cached blocks of the leading `hashes` (as many as are cached),
    /// counting hits and misses over all of `hashes`.
    pub fn claim(&mut self, hashes: &[BlockHash]) -> Vec<BlockId> {
        let blocks: Vec<BlockId> = hashes.iter().map_while(|h| self.by_hash.get(h).copied()).collect();
        for &block in &blocks {
            let at = block.0 as usize;
            if self.refcounts[at] == 0 {
                self.idle.remove(&self.idle_since[at]);
            }
            self.refcounts[at] += 1;
        }
        self.stats.hits += blocks.len() as u64;
        self.stats.misses += (hashes.len() - blocks.len()) as u64;
        blocks
    }
}

/// Which blocks hold one sequence's tokens, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<BlockId>,
    tokens: usize,
}

impl BlockTable {
    /// Tokens held.
    pub fn len(&self) -> usize {
        self.tokens
    }

    /// Whether no token is held.
    pub fn is_empty(&self) -> bool {
        self.tokens == 0
    }

    /// The blocks, in token order.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Blocks that appending `extra` tokens would take from the pool.
    pub(crate) fn blocks_needed(&self, pool: &BlockPool, extra: usize) -> usize {
        (self.tokens + extra)
            .div_ceil(pool.block_size())
            .saturating_sub(self.blocks.len())
    }

    /// Make room for `extra` more tokens: all of it, or nothing.
    pub fn append(&mut self, pool: &mut BlockPool, extra: usize) -> Result<(), OutOfBlocks> {
        let new = pool.allocate(self.blocks_needed(pool, extra))?;
        self.blocks.extend(new);
        self.tokens += extra;
        Ok(())
    }

    /// Where token `position` lives: its block and the slot inside it.
    pub fn slot(&self, pool: &BlockPool, position: usize) -> Option<(BlockId, usize)> {
        (position < self.tokens).then(|| (self.blocks[position / pool.block_size()], position % pool.block_size()))
    }

    /// A table that starts with `blocks`, already held and full (a cached prefix).
    pub fn shared(pool: &BlockPool, blocks: Vec<BlockId>) -> Self {
        BlockTable {
            tokens: blocks.len() * pool.block_size(),
            blocks,
        }
    }

    /// Keep the first `len` tokens and give back the blocks past them.
    pub fn truncate(&mut self, pool: &mut BlockPool, len: usize) {
        if len >= self.tokens {
            return;
        }
        for block in self.blocks.drain(len.div_ceil(pool.block_size())..) {
            pool.release(block);
        }
        self.tokens = len;
    }

    /// Give every block back (a finished or preempted sequence).
    pub fn release(&mut self, pool: &mut BlockPool) {
        for block in self.blocks.drain(..) {
            pool.release(block);
        }
        self.tokens = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::rng::SplitMix;

    #[test]
    fn tables_grow_block_by_block_and_map_positions_to_slots() {
        let mut pool = BlockPool::new(8, 16);
        let mut table = BlockTable::default();
        table.append(&mut pool, 17).unwrap();
        assert_eq!((table.len(), table.blocks().len(), pool.free_blocks()), (17, 2, 6));
        assert_eq!(table.slot(&pool, 16), Some((BlockId(1), 0)));
        assert_eq!(table.slot(&pool, 17), None);
        assert_eq!(table.blocks_needed(&pool, 15), 0, "the second block still has room");
        table.append(&mut pool, 15).unwrap();
        assert_eq!(pool.free_blocks(), 6);
        table.append(&mut pool, 1).unwrap();
        assert_eq!(pool.free_blocks(), 5);
    }

    #[test]
    fn an_append_that_does_not_fit_takes_nothing() {
        let mut pool = BlockPool::new(3, 4);
        let mut table = BlockTable::default();
        table.append(&mut pool, 8).unwrap();
        let err = table.append(&mut pool, 9).unwrap_err();
        assert_eq!(err, OutOfBlocks { needed: 3, free: 1 });
        assert_eq!((table.len(), pool.free_blocks()), (8, 1));
        table.release(&mut pool);
        assert_eq!((table.len(), pool.free_blocks()), (0, 3));
    }

    #[test]
    fn a_shared_block_is_free_only_after_its_last_holder_lets_go() {
        let mut pool = BlockPool::new(2, 4);
        let block = pool.allocate(1).unwrap()[0];
        pool.share(block);
        assert_eq!(pool.refcount(block), 2);
        pool.release(block);
        assert_eq!(pool.free_blocks(), 1);
        pool.release(block);
        assert_eq!(pool.free_blocks(), 2);
    }

    #[test]
    fn random_traffic_never_loses_or_double_frees_a_block() {
        let mut pool = BlockPool::new(64, 16);
        let mut tables: Vec<BlockTable> = vec![BlockTable::default(); 10];
        let mut rng = SplitMix::new(3);
        for _ in 0..5_000 {
            let t = (rng.next_u64() % 10) as usize;
            if rng.next_u64().is_multiple_of(4) {
                tables[t].release(&mut pool);
            } else {
                let _ = tables[t].append(&mut pool, (rng.next_u64() % 40) as usize);
            }
            let held: usize = tables.iter().map(|t| t.blocks().len()).sum();
            assert_eq!(held + pool.free_blocks(), pool.total_blocks());
            for table in &tables {
                assert_eq!(table.blocks().len(), table.len().div_ceil(pool.block_size()));
            }
        }
    }
}
