//! The `cargo fuzz` corpora of the engine's loaders (`fuzz/corpus/gguf/`,
//! `fuzz/corpus/model_config/`), replayed on every test run: no input
//! panics or aborts, and some load; what fuzzing once crashed on
//! (`fuzz/regressions/<target>/`) is refused.

use std::path::{Path, PathBuf};

/// Each input of `dir` through `load`, caught if it panics: (path, whether it loaded).
fn outcomes<T>(
    dir: &Path,
    load: &impl Fn(&[u8]) -> Result<T, lorry_engine::models::ModelError>,
) -> Vec<(PathBuf, std::thread::Result<bool>)> {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    entries
        .filter_map(|entry| {
            let path = entry.unwrap().path();
            // A fuzzer running beside the test replaces files as it goes.
            let input = match std::fs::read(&path) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
                read => read.unwrap(),
            };
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| load(&input).is_ok()));
            Some((path, outcome))
        })
        .collect()
}

fn replay<T>(target: &str, load: impl Fn(&[u8]) -> Result<T, lorry_engine::models::ModelError>) {
    let fuzz = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    let corpus = outcomes(&fuzz.join("corpus").join(target), &load);
    for (path, outcome) in &corpus {
        assert!(outcome.is_ok(), "{} made {target} panic", path.display());
    }
    let accepted = corpus.iter().filter(|(_, o)| matches!(o, Ok(true))).count();
    assert!(accepted > 0, "{target}: none of {} accepted", corpus.len());
    let regressions = fuzz.join("regressions").join(target);
    if regressions.exists() {
        for (path, outcome) in outcomes(&regressions, &load) {
            assert!(matches!(outcome, Ok(false)), "{} was not refused", path.display());
        }
    }
}

#[test]
fn the_loaders_take_their_corpora_without_panicking_and_refuse_what_crashed_them() {
    replay("gguf", lorry_engine::fuzzing::gguf);
    replay("model_config", lorry_engine::fuzzing::llama_config);
}
