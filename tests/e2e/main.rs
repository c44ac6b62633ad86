//! End-to-end tests: real Lorry processes against real Postgres, RabbitMQ and S3.
//! Each test gets its own database, queue prefix and bucket (see `common`).
#![allow(dead_code)]

mod common;

mod accounts;
mod adapters;
mod batches;
mod choices;
mod durability;
mod fairness;
mod faults;
mod hardening;
mod logprobs;
mod metrics;
mod models;
mod offline;
mod openai;
mod openapi;
mod realtime;
mod retention;
mod sdk;
mod structured;
mod tools;
mod traces;
mod webhooks;
mod workers_ai;
