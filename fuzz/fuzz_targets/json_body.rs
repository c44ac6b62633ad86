//! Any body of a JSON route: strict JSON, no U+0000; a refusal is a 400.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    lorry_api::fuzzing::refused_with_4xx(lorry_api::fuzzing::json_body(data));
});
