//! Paged KV-cache bookkeeping: fixed-size blocks, a free list, reference
//! counts, and one block table per sequence (after vLLM's PagedAttention,
//! Kwon et al., 2023). Shared blocks are what prefix caching will hand out.

mod blocks;

pub use blocks::{BlockId, BlockPool, BlockTable, OutOfBlocks};
