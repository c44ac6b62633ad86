//! The paged KV cache: fixed-size blocks, a free list, reference counts, one
//! block table per sequence, and storage read through those tables (after
//! vLLM's PagedAttention, Kwon et al., 2023). Full blocks are cached by
//! contents ([`prefix`]) and shared, copy-free, with later sequences that
//! start with the same tokens under the same model and adapter.

mod blocks;
mod cache;
pub mod prefix;

pub use blocks::{BlockHash, BlockId, BlockPool, BlockTable, OutOfBlocks, PrefixStats};
pub use cache::{AttentionSeq, KvCache, KvLayout};
