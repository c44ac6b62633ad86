//! A batch input file (`POST /v1/files`), every line checked.
#![no_main]
use libfuzzer_sys::fuzz_target;
use lorry_api::fuzzing::{refused_with_4xx, Routes};

fuzz_target!(|data: &[u8]| {
    thread_local!(static ROUTES: Routes = Routes::new());
    ROUTES.with(|routes| refused_with_4xx(routes.batch_file(data)));
});
