//! The paged KV cache: fixed-size blocks, a free list, reference counts, one
//! block table per sequence, and storage read through those tables (after
//! vLLM's PagedAttention, Kwon et al., 2023). Shared blocks are what prefix
//! caching will hand out.

mod blocks;
mod cache;

pub use blocks::{BlockId, BlockPool, BlockTable, OutOfBlocks};
pub use cache::{AttentionSeq, KvCache, KvLayout};
