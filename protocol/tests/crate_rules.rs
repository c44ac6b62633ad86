//! The workspace's dependency rules, read from each crate's `Cargo.toml`:
//! the API links the protocol, never the engine; the engine and the protocol
//! know nothing of serving; the service's binary holds no benchmark.

use std::path::Path;

/// The names in a manifest's `[dependencies]` table (some).
fn dependencies(crate_dir: &str) -> Vec<String> {
    let names = listed(crate_dir);
    assert!(!names.is_empty(), "{crate_dir} lists no dependencies");
    names
}

/// The names in a manifest's `[dependencies]` table.
fn listed(crate_dir: &str) -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(crate_dir)
        .join("Cargo.toml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut in_dependencies = false;
    let mut names = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            in_dependencies = line == "[dependencies]";
            continue;
        }
        if !in_dependencies || line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name = line.split(['=', '.', ' ']).next().unwrap_or_default();
        names.push(name.trim_matches('"').to_string());
    }
    names
}

fn assert_none_of(crate_dir: &str, forbidden: &[&str]) {
    let deps = dependencies(crate_dir);
    let found: Vec<&&str> = forbidden.iter().filter(|f| deps.iter().any(|d| d == *f)).collect();
    assert!(found.is_empty(), "{crate_dir} must not depend on {found:?}");
}

const SERVING: [&str; 9] = [
    "lorry",
    "lorry-api",
    "lorry-batcher",
    "lorry-bench",
    "axum",
    "sqlx",
    "lapin",
    "aws-sdk-s3",
    "reqwest",
];

#[test]
fn the_api_links_the_protocol_and_never_the_engine() {
    assert_none_of("api", &["lorry-engine", "candle-core", "candle-nn"]);
    assert!(dependencies("api").iter().any(|d| d == "lorry-protocol"));
}

#[test]
fn the_engine_knows_nothing_of_serving() {
    assert_none_of("engine", &SERVING);
}

#[test]
fn the_protocol_is_pure() {
    let mut forbidden = SERVING.to_vec();
    forbidden.extend(["lorry-engine", "candle-core", "candle-nn", "tokio", "tokenizers"]);
    assert_none_of("protocol", &forbidden);
}

#[test]
fn the_service_binary_holds_no_benchmark() {
    assert_none_of(".", &["lorry-bench"]);
    assert!(!Path::new(env!("CARGO_MANIFEST_DIR")).join("../src/bench.rs").exists());
}

#[test]
fn the_dependency_reader_sees_what_is_there() {
    // So that the rules above cannot pass on a reader that finds nothing.
    assert!(dependencies("engine").iter().any(|d| d == "candle-core"));
    assert!(dependencies("batcher").iter().any(|d| d == "lorry-engine"));
}

#[test]
fn the_metrics_crate_needs_only_the_standard_library() {
    assert_eq!(listed("metrics"), Vec::<String>::new());
}
