//! Lorry's benchmarks, apart from the service's binary: each measures in one
//! run what it compares and prints a table (docs/BENCHMARKS.md quotes them).
//! `lorry bench …` forwards to the `lorry-bench` binary built from this crate.

pub mod bench;
pub mod fairness;
pub mod isolation;
pub mod speedups;
pub mod structured;
