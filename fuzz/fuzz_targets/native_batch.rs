//! `POST /v1/batches` with inline requests, checked as the route checks it.
#![no_main]
use libfuzzer_sys::fuzz_target;
use lorry_api::fuzzing::{refused_with_4xx, Routes};

fuzz_target!(|data: &[u8]| {
    thread_local!(static ROUTES: Routes = Routes::new());
    ROUTES.with(|routes| refused_with_4xx(routes.native_batch(data)));
});
