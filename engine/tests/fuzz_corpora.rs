//! The `cargo fuzz` corpora of the engine's loaders (`fuzz/corpus/gguf/`,
//! `fuzz/corpus/model_config/`), replayed on every test run: no input
//! panics or aborts, what once crashed it is refused, and the valid seeds load.

use std::path::PathBuf;

fn replay<T>(target: &str, load: impl Fn(&[u8]) -> Result<T, lorry_engine::models::ModelError>) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    let mut accepted = 0;
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        let input = std::fs::read(&path).unwrap();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| load(&input).is_ok()));
        seen += 1;
        match outcome {
            // What fuzzing once crashed on (`regression-*`) is refused.
            Ok(ok) if path.file_name().unwrap().to_string_lossy().starts_with("regression-") => {
                assert!(!ok, "{} was accepted", path.display())
            }
            Ok(ok) => accepted += usize::from(ok),
            Err(_) => panic!("{} made {target} panic", path.display()),
        }
    }
    assert!(seen > 0 && accepted > 0, "{target}: {accepted} of {seen} accepted");
}

#[test]
fn the_loaders_take_their_corpora_without_panicking() {
    replay("gguf", lorry_engine::fuzzing::gguf);
    replay("model_config", lorry_engine::fuzzing::llama_config);
}
