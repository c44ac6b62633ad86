//! Blocks, the pool that owns them, and per-sequence block tables.

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

/// Every block of the cache, with its reference count; the one owner of that state.
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    refcounts: Vec<u32>,
    free: Vec<BlockId>,
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
        }
    }

    /// Add `n` fresh blocks (their ids follow the existing ones).
    pub fn grow(&mut self, n: usize) {
        let old = self.refcounts.len() as u32;
        self.refcounts.resize(old as usize + n, 0);
        let mut fresh: Vec<BlockId> = (old..old + n as u32).rev().map(BlockId).collect();
        // Keep the old free blocks on top so they are handed out first.
        fresh.append(&mut self.free);
        self.free = fresh;
    }

    /// Token slots per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks nobody holds.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// All blocks.
    pub fn total_blocks(&self) -> usize {
        self.refcounts.len()
    }

    /// How many holders a block has.
    pub fn refcount(&self, block: BlockId) -> u32 {
        self.refcounts[block.0 as usize]
    }

    /// Take `n` blocks, or none if fewer are free.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<BlockId>, OutOfBlocks> {
        if n > self.free.len() {
            return Err(OutOfBlocks {
                needed: n,
                free: self.free.len(),
            });
        }
        let taken = self.free.split_off(self.free.len() - n);
        for block in &taken {
            self.refcounts[block.0 as usize] = 1;
        }
        Ok(taken.into_iter().rev().collect())
    }

    /// Add a holder to a block that is in use (sharing without copying).
    pub fn share(&mut self, block: BlockId) {
        let count = &mut self.refcounts[block.0 as usize];
        assert!(*count > 0, "sharing a free block {block:?}");
        *count += 1;
    }

    /// Drop one holder; the block is free again when none is left.
    pub fn release(&mut self, block: BlockId) {
        let count = &mut self.refcounts[block.0 as usize];
        assert!(*count > 0, "releasing a free block {block:?}");
        *count -= 1;
        if *count == 0 {
            self.free.push(block);
        }
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
    pub fn blocks_needed(&self, pool: &BlockPool, extra: usize) -> usize {
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
    use crate::rng::SplitMix;

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
            if rng.next_u64() % 4 == 0 {
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
