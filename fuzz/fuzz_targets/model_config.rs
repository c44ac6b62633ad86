//! A checkpoint's `config.json`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = lorry_engine::fuzzing::llama_config(data);
});
