//! The OpenAI routes' bodies; the first byte picks the route.
#![no_main]
use libfuzzer_sys::fuzz_target;
use lorry_api::fuzzing::{refused_with_4xx, Routes, OPENAI_ROUTES};

fuzz_target!(|data: &[u8]| {
    thread_local!(static ROUTES: Routes = Routes::new());
    let Some((&pick, body)) = data.split_first() else { return };
    let route = OPENAI_ROUTES[usize::from(pick) % OPENAI_ROUTES.len()];
    ROUTES.with(|routes| refused_with_4xx(routes.openai(route, body)));
});
