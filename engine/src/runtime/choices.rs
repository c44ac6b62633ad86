//! `n` > 1: one request's choices, each a sequence of its own in the same
//! continuous batch, with its own seed stream, answered as one result.
//!
//! The first choice is submitted at once, streaming (so its first piece
//! shows when its prompt has been computed); the others follow that first
//! piece, when the prompt's full blocks are in the prefix cache, and so
//! share them instead of pre-filling the prompt again (where prefix caching
//! is on). Their events come back on one stream, each piece tagged with its
//! choice; the result is the first choice's output with the others in
//! [`Output::choices`], its usage the prompt once and every choice's tokens.
//! A choice that fails fails the request; a reader that goes away cancels
//! every choice.

use tokio::sync::mpsc;

use crate::runtime::rng::SplitMix;
use crate::runtime::text_engine::TextEngine;
use crate::{
    event_channel, Choice, EngineError, Event, EventStream, Events, Output, Request, Usage, MAX_UNREAD_EVENTS,
};

/// The seed of choice `index` of a request seeded `seed`: the seed itself
/// for the first (so `n: 1` is the plain request), then the values of the
/// seed's own SplitMix64 stream.
pub fn choice_seed(seed: u64, index: usize) -> u64 {
    if index == 0 {
        return seed;
    }
    let mut stream = SplitMix::new(seed);
    (0..index).map(|_| stream.next_u64()).last().unwrap_or(seed)
}

/// Choice `index` of `request`: one choice, its own seed; the first always streams.
fn choice(request: &Request, index: usize) -> Request {
    let mut one = request.clone();
    let sampling = &mut one.input.sampling;
    sampling.n = None;
    sampling.seed = Some(choice_seed(sampling.seed.unwrap_or(0), index));
    if index == 0 {
        one.input.stream = true;
    }
    one
}

/// Serve a request with `n` > 1 on `engine` (see the module's documentation).
pub(crate) fn fan_out(engine: &TextEngine, request: Request) -> Result<EventStream, EngineError> {
    let n = request.input.sampling.choices() as usize;
    let runtime = tokio::runtime::Handle::try_current()
        .map_err(|_| EngineError::Model("several choices are served on a tokio runtime; none is running".into()))?;
    // The first is submitted here, so that a request the engine refuses is refused at once.
    let first = engine.submit_one(choice(&request, 0))?;
    let (events, stream) = event_channel();
    let engine = engine.clone();
    runtime.spawn(async move {
        let outcome = gather(&engine, &request, n, first, &events).await;
        match outcome {
            Ok(Some(output)) => {
                events.send(Event::Finished(output));
            }
            Ok(None) => {}
            Err(error) => {
                events.send(Event::Failed(error));
            }
        }
    });
    Ok(stream)
}

/// Relay the choices' pieces and gather their outputs; `Ok(None)` when the reader has gone.
async fn gather(
    engine: &TextEngine,
    request: &Request,
    n: usize,
    first: EventStream,
    out: &Events,
) -> Result<Option<Output>, EngineError> {
    let (merged, mut inbox) = mpsc::unbounded_channel();
    relay(0, first, merged.clone());
    let mut waiting = true;
    let mut outputs: Vec<Option<Output>> = vec![None; n];
    let mut done = 0;
    while done < n {
        let (index, event) = tokio::select! {
            () = out.closed() => return Ok(None),
            next = inbox.recv() => next.expect("a sender is held here"),
        };
        let Some(event) = event else {
            return Err(EngineError::Stopped);
        };
        if index == 0 && waiting && matches!(event, Event::Token { .. } | Event::Finished(_)) {
            // The first choice's prompt is computed: the others join, sharing its blocks.
            waiting = false;
            for i in 1..n {
                relay(i, engine.submit_one(choice(request, i))?, merged.clone());
            }
        }
        match event {
            Event::Token { text, logprobs, .. } => {
                if request.input.stream {
                    if out.unread() >= MAX_UNREAD_EVENTS {
                        return Err(EngineError::Overrun);
                    }
                    out.send(Event::Token {
                        text,
                        logprobs,
                        choice: index as u32,
                    });
                }
            }
            Event::Finished(output) => {
                outputs[index] = Some(output);
                done += 1;
            }
            Event::Failed(error) => return Err(error),
        }
    }
    let mut outputs = outputs.into_iter().map(|o| o.expect("every choice finished"));
    let mut first = outputs.next().expect("n > 1");
    for output in outputs {
        first.usage = Usage {
            prompt_tokens: first.usage.prompt_tokens,
            completion_tokens: first.usage.completion_tokens + output.usage.completion_tokens,
        };
        let completion = output
            .completion
            .ok_or_else(|| EngineError::Model("a choice ended without its tokens".into()))?;
        first.choices.push(Choice {
            text: output.content.text().to_string(),
            completion,
            logprobs: output.logprobs,
            tool_calls: output.tool_calls,
        });
    }
    Ok(Some(first))
}

/// Forward choice `index`'s events into `merged` (`None` once its stream
/// ends), until the gatherer goes: then its stream is dropped, which
/// cancels the choice in the engine.
fn relay(index: usize, mut events: EventStream, merged: mpsc::UnboundedSender<(usize, Option<Event>)>) {
    tokio::spawn(async move {
        loop {
            let event = tokio::select! {
                () = merged.closed() => return,
                event = events.recv() => event,
            };
            let last = !matches!(event, Some(Event::Token { .. }));
            if merged.send((index, event)).is_err() || last {
                return;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_choice_keeps_the_seed_and_the_others_differ() {
        assert_eq!(choice_seed(42, 0), 42);
        let seeds: Vec<u64> = (0..16).map(|i| choice_seed(42, i)).collect();
        let mut distinct = seeds.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), 16);
        assert_eq!(choice_seed(42, 3), choice_seed(42, 3));
        assert_ne!(choice_seed(42, 1), choice_seed(43, 1));
    }
}
