//! The `cargo fuzz` corpora (`fuzz/corpus/<target>/`), replayed through the
//! same entry points on every test run: no input panics, every refusal is a
//! 4xx, and each target's corpus reaches the parser's success path too.

use std::path::PathBuf;

use lorry_api::fuzzing::{self, refused_with_4xx, Routes, MODELS, OPENAI_ROUTES};

fn corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    let mut inputs: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|entry| {
            let path = entry.unwrap().path();
            // A fuzzer running beside the test replaces files as it goes.
            match std::fs::read(&path) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                read => Some((path.display().to_string(), read.unwrap())),
            }
        })
        .collect();
    inputs.sort();
    assert!(!inputs.is_empty(), "{} is empty", dir.display());
    inputs
}

/// Runs `check` on every input of `target`'s corpus; returns how many were accepted.
fn replay<T>(target: &str, check: impl Fn(&[u8]) -> Result<T, lorry_api::ApiError>) -> usize {
    let mut accepted = 0;
    for (name, input) in corpus(target) {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let outcome = check(&input);
            let ok = outcome.is_ok();
            refused_with_4xx(outcome);
            ok
        }));
        match outcome {
            Ok(ok) => accepted += usize::from(ok),
            Err(_) => panic!("{name} made {target} panic"),
        }
    }
    assert!(accepted > 0, "nothing in {target}'s corpus was accepted");
    accepted
}

#[test]
fn every_api_parser_refuses_its_corpus_with_4xx_and_never_panics() {
    let routes = Routes::new();
    replay("json_body", fuzzing::json_body);
    replay("native_batch", |b| routes.native_batch(b));
    replay("workers_ai", |b| match b.split_first() {
        Some((&pick, body)) => routes.workers_ai(MODELS[usize::from(pick) % MODELS.len()], body),
        None => Ok(()),
    });
    replay("openai", |b| match b.split_first() {
        Some((&pick, body)) => routes.openai(OPENAI_ROUTES[usize::from(pick) % OPENAI_ROUTES.len()], body),
        None => Ok(()),
    });
    replay("batch_file", |b| routes.batch_file(b));
    replay("adapter_config", fuzzing::adapter_config);
    replay("adapter_weights", fuzzing::adapter_weights);
}
