//! An uploaded `adapter_model.safetensors`, checked against a base model.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    lorry_api::fuzzing::refused_with_4xx(lorry_api::fuzzing::adapter_weights(data));
});
