//! An uploaded `adapter_config.json`, checked on its own.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    lorry_api::fuzzing::refused_with_4xx(lorry_api::fuzzing::adapter_config(data));
});
