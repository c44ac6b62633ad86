//! What a cached block is: the identity of a full block's keys and values.
//!
//! A block's keys and values depend on every token before it, on the model,
//! and on the LoRA adapter its rows ran with. Its identity is therefore a
//! SHA-256 chained block by block: the first block hashes the namespace (model,
//! adapter and cache partition) with its tokens, every later one hashes its
//! parent's hash with its tokens. Equal hashes mean the same model, the same
//! adapter, the same partition and the same tokens from the start of the
//! sequence; a collision-resistant hash keeps one tenant from forging
//! another's block on a shared worker, and the partition (the account, by
//! default) keeps one tenant from timing a hit on another's prompt.

use sha2::{Digest, Sha256};

use super::BlockHash;

/// The namespace of blocks computed by `model` with `adapter` (its content
/// key), or without one, for requests of cache partition `partition`.
pub fn namespace(model: &str, adapter: Option<&[u8; 32]>, partition: Option<&str>) -> BlockHash {
    let mut h = Sha256::new();
    h.update(b"lorry.kv.v2\0");
    h.update((model.len() as u64).to_le_bytes());
    h.update(model.as_bytes());
    match adapter {
        Some(key) => {
            h.update([1]);
            h.update(key);
        }
        None => h.update([0]),
    }
    match partition {
        Some(partition) => {
            h.update([1]);
            h.update((partition.len() as u64).to_le_bytes());
            h.update(partition.as_bytes());
        }
        None => h.update([0]),
    }
    h.finalize().into()
}

/// The hash of a block holding `tokens` after the block (or namespace) `parent`.
pub fn chain(parent: &BlockHash, tokens: &[u32]) -> BlockHash {
    let mut h = Sha256::new();
    h.update(parent);
    for token in tokens {
        h.update(token.to_le_bytes());
    }
    h.finalize().into()
}

/// The hashes of one sequence's full blocks, extended as its tokens become known.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    namespace: BlockHash,
    block_size: usize,
    hashes: Vec<BlockHash>,
}

impl BlockHasher {
    /// No block hashed yet.
    pub fn new(namespace: BlockHash, block_size: usize) -> Self {
        BlockHasher {
            namespace,
            block_size,
            hashes: Vec::new(),
        }
    }

    /// Hash every full block of `tokens` (the whole sequence so far) not hashed
    /// yet; returns the new hashes.
    pub fn update(&mut self, tokens: &[u32]) -> &[BlockHash] {
        let before = self.hashes.len();
        for block in tokens.chunks_exact(self.block_size).skip(before) {
            let parent = self.hashes.last().unwrap_or(&self.namespace);
            let next = chain(parent, block);
            self.hashes.push(next);
        }
        &self.hashes[before..]
    }

    /// Every hash so far.
    #[cfg(test)]
    pub(crate) fn hashes(&self) -> &[BlockHash] {
        &self.hashes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_hash_depends_on_everything_before_it_and_on_the_namespace() {
        let base = namespace("m", None, None);
        let adapted = namespace("m", Some(&[7; 32]), None);
        assert_ne!(base, adapted);
        assert_ne!(base, namespace("n", None, None));
        let tenant = namespace("m", None, Some("acct-a"));
        assert_ne!(base, tenant, "a partition is a namespace of its own");
        assert_ne!(tenant, namespace("m", None, Some("acct-b")));
        assert_ne!(namespace("m", Some(&[7; 32]), Some("a")), adapted);
        let tokens: Vec<u32> = (0..10).collect();
        let mut a = BlockHasher::new(base, 4);
        assert_eq!(a.update(&tokens[..3]).len(), 0);
        assert_eq!(a.update(&tokens).len(), 2, "two full blocks of four");
        let mut b = BlockHasher::new(base, 4);
        let mut other = tokens.clone();
        other[0] = 99;
        b.update(&other);
        assert_eq!(a.hashes()[0], chain(&base, &tokens[..4]));
        assert_ne!(
            a.hashes()[1],
            b.hashes()[1],
            "the second block differs through its parent"
        );
        let mut c = BlockHasher::new(adapted, 4);
        c.update(&tokens);
        assert_ne!(a.hashes()[0], c.hashes()[0], "another adapter, another block");
    }
}
