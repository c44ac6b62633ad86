//! `POST …/ai/run/{model}`: a queued batch, a poll or a real-time request;
//! the first byte picks the model.
#![no_main]
use libfuzzer_sys::fuzz_target;
use lorry_api::fuzzing::{refused_with_4xx, Routes, MODELS};

fuzz_target!(|data: &[u8]| {
    thread_local!(static ROUTES: Routes = Routes::new());
    let Some((&pick, body)) = data.split_first() else { return };
    let model = MODELS[usize::from(pick) % MODELS.len()];
    ROUTES.with(|routes| refused_with_4xx(routes.workers_ai(model, body)));
});
