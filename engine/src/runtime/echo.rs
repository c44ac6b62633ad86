//! `@lorry/echo`: the pipeline's deterministic test and benchmark model.
//!
//! It answers `{"response": <input>}` where the input is the request's
//! `prompt`, the last message's `content`, or `text`. Usage counts
//! whitespace-separated words. Like a real engine it runs on its own OS thread
//! behind a cheap `Clone` handle, serves the real-time lane before the batch
//! lane, and can be slowed down (`delay` per request) so that tests and
//! benchmarks can watch a batch in flight.

use std::time::Duration;

use crate::input::{Prompt, ValidRequest};
use crate::runtime::serial::SerialQueue;
use crate::{Backend, Content, EngineError, Event, EventStream, Events, Output, Request, Usage, ECHO_MODEL};

/// How the echo engine behaves.
#[derive(Debug, Clone, Copy, Default)]
pub struct EchoConfig {
    /// Time spent on each request, serially, to emulate a model's throughput.
    pub delay: Duration,
}

/// A handle to the running echo engine; the engine thread stops when the last handle drops.
#[derive(Clone)]
pub struct EchoEngine {
    queue: SerialQueue,
}

impl EchoEngine {
    /// Start the engine thread and wait until it is ready.
    pub fn start(config: EchoConfig) -> Self {
        let queue = SerialQueue::start("lorry-echo", move |request, events| {
            if !config.delay.is_zero() {
                std::thread::sleep(config.delay);
            }
            serve(request, events);
        });
        EchoEngine { queue }
    }
}

fn serve(request: ValidRequest, events: &Events) {
    let text = echo_text(&request);
    let prompt_tokens = words(&request.prompt_text());
    if request.stream {
        for word in text.split_inclusive(' ') {
            if events.unread() >= crate::MAX_UNREAD_EVENTS {
                events.send(Event::Failed(EngineError::Overrun));
                return;
            }
            if !events.send(Event::Token {
                text: word.to_string(),
                logprobs: Vec::new(),
                choice: 0,
            }) {
                return;
            }
        }
    }
    let output = Output {
        usage: Usage {
            prompt_tokens,
            completion_tokens: words(&text),
        },
        content: Content::Text(text),
        completion: None,
        logprobs: None,
        choices: Vec::new(),
        tool_calls: Vec::new(),
    };
    events.send(Event::Finished(output));
}

fn echo_text(request: &ValidRequest) -> String {
    match &request.prompt {
        Prompt::Text(t) | Prompt::Plain(t) => t.clone(),
        Prompt::Messages(m) => m.last().map(|m| m.content.clone()).unwrap_or_default(),
        Prompt::Inputs(texts) => texts.join("\n"),
        Prompt::Tokens(ids) => ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" "),
    }
}

fn words(text: &str) -> u32 {
    text.split_whitespace().count() as u32
}

impl Backend for EchoEngine {
    fn model(&self) -> &str {
        ECHO_MODEL
    }

    fn submit(&self, request: Request) -> Result<EventStream, EngineError> {
        request.without_adapter(self.model())?;
        self.queue.submit(request.input, request.lane)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::{collect, Lane, Task};

    fn request(body: serde_json::Value) -> ValidRequest {
        ValidRequest::parse(Task::Echo, &body).unwrap()
    }

    #[tokio::test]
    async fn echo_returns_the_last_message() {
        let engine = EchoEngine::start(EchoConfig::default());
        let body =
            json!({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "hello there"}]});
        let out = collect(engine.submit(Request::new(request(body), Lane::Batch)).unwrap())
            .await
            .unwrap();
        assert_eq!(out.content, Content::Text("hello there".into()));
        assert_eq!(
            out.usage,
            Usage {
                prompt_tokens: 3,
                completion_tokens: 2
            }
        );
    }

    #[tokio::test]
    async fn streaming_yields_tokens_before_the_result() {
        let engine = EchoEngine::start(EchoConfig::default());
        let mut events = engine
            .submit(Request::new(
                request(json!({"prompt": "a b c", "stream": true})),
                Lane::RealTime,
            ))
            .unwrap();
        let mut tokens = String::new();
        while let Some(event) = events.recv().await {
            match event {
                Event::Token { text, .. } => tokens.push_str(&text),
                Event::Finished(out) => {
                    assert_eq!(out.content.text(), "a b c");
                    break;
                }
                Event::Failed(e) => panic!("{e}"),
            }
        }
        assert_eq!(tokens, "a b c");
    }

    #[tokio::test]
    async fn a_stream_left_unread_ends_at_the_bound_with_an_overrun() {
        let engine = EchoEngine::start(EchoConfig::default());
        let words = "w ".repeat(crate::MAX_UNREAD_EVENTS + 100);
        let mut unread = engine
            .submit(Request::new(
                request(json!({"prompt": words, "stream": true})),
                Lane::RealTime,
            ))
            .unwrap();
        // One request at a time: once the next is answered, the first was served.
        collect(
            engine
                .submit(Request::new(request(json!({"prompt": "x"})), Lane::RealTime))
                .unwrap(),
        )
        .await
        .unwrap();
        let mut tokens = 0;
        let last = loop {
            match unread.recv().await.unwrap() {
                Event::Token { .. } => tokens += 1,
                other => break other,
            }
        };
        assert_eq!(tokens, crate::MAX_UNREAD_EVENTS);
        assert_eq!(last, Event::Failed(EngineError::Overrun));
        assert!(unread.recv().await.is_none());
    }

    #[tokio::test]
    async fn the_real_time_lane_overtakes_queued_batch_work() {
        let engine = EchoEngine::start(EchoConfig {
            delay: Duration::from_millis(20),
        });
        let batch: Vec<_> = (0..5)
            .map(|i| {
                engine
                    .submit(Request::new(request(json!({"prompt": format!("b{i}")})), Lane::Batch))
                    .unwrap()
            })
            .collect();
        let rt = engine
            .submit(Request::new(request(json!({"prompt": "rt"})), Lane::RealTime))
            .unwrap();
        collect(rt).await.unwrap();
        // The first batch job may already have started; the last cannot have finished.
        let mut last = batch.into_iter().last().unwrap();
        assert!(last.try_recv().is_err());
    }
}
