//! Lorry's durable core: everything between an accepted batch and its results.
//!
//! - [`adapters`]: the worker's tiers of LoRA adapter files (host, disk, S3), the engine's adapter source.
//! - [`store`]: Postgres (batches, requests, files, adapters, outbox, webhook deliveries).
//! - [`broker`]: RabbitMQ topology, connections and publishing with confirms.
//! - [`objects`]: the S3 object store for `output.jsonl` and `errors.jsonl`.
//! - [`relay`]: publishes the outbox to RabbitMQ.
//! - [`worker`]: consumes both lanes, runs requests on an engine [`lorry_engine::Backend`],
//!   commits results idempotently, acks only after the commit.
//! - [`finaliser`]: ends batches, writes their output, expires and sweeps.
//! - [`webhooks`]: signed, retried completion webhooks (Standard Webhooks).
//! - [`openai`]: OpenAI's answer objects and batch output lines, built from results.
//! - [`realtime`]: the API side of the real-time lane (publish, await the reply).
//! - [`metrics`]: what a worker exposes at `/metrics`.
//! - [`trace`]: W3C trace context through HTTP, the outbox and the broker.
#![forbid(unsafe_code)]

pub mod adapters;
pub mod admin;
pub mod broker;
pub mod error;
pub mod finaliser;
pub mod ids;
pub mod metrics;
pub mod model;
pub mod objects;
pub mod openai;
pub mod quota;
pub mod realtime;
pub mod relay;
pub mod store;
pub mod trace;
pub mod webhooks;
pub mod worker;

pub use error::BatcherError;

/// The schema migrations, embedded in the binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");
