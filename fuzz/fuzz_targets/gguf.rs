//! A GGUF file's header, metadata and tensor directory, and its model configuration.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = lorry_engine::fuzzing::gguf(data);
});
