//! The runtime that serves requests on a model: the engine threads behind
//! [`crate::Backend`] (`text_engine`, and `serial` for the echo and embedding
//! engines), the scheduler that plans each continuous-batching step, the
//! paged KV cache with its prefix cache (`kv`), speculation, sampling, constrained decoding
//! (`guide`), one request's decoding state (`chat`: a decoder behind its tokenizer and
//! chat template), a request's several choices (`choices`) and tool calls in the
//! model family's format (`tools`).

pub mod chat;
pub mod choices;
pub mod echo;
pub mod embedding;
pub mod guide;
pub mod kv;
pub(crate) mod pace;
pub mod rng;
pub mod sampling;
pub mod scheduler;
pub(crate) mod serial;
pub mod speculative;
pub mod text_engine;
pub mod tools;
