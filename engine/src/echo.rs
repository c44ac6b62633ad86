//! `@lorry/echo`: the pipeline's deterministic test and benchmark model.
//!
//! It answers `{"response": <input>}` where the input is the request's
//! `prompt`, the last message's `content`, or `text`. Usage counts
//! whitespace-separated words. Like a real engine it runs on its own OS thread
//! behind a cheap `Clone` handle, serves the real-time lane before the batch
//! lane, and can be slowed down (`delay` per request) so that tests and
//! benchmarks can watch a batch in flight.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;

use crate::input::{Prompt, ValidRequest};
use crate::{Backend, EngineError, Event, EventStream, Lane, Output, Usage, ECHO_MODEL};

/// How the echo engine behaves.
#[derive(Debug, Clone, Copy, Default)]
pub struct EchoConfig {
    /// Time spent on each request, serially, to emulate a model's throughput.
    pub delay: Duration,
}

struct Job {
    request: ValidRequest,
    events: mpsc::UnboundedSender<Event>,
}

#[derive(Default)]
struct Queues {
    realtime: VecDeque<Job>,
    batch: VecDeque<Job>,
    stopped: bool,
}

struct Shared {
    queues: Mutex<Queues>,
    ready: Condvar,
}

/// A handle to the running echo engine; the engine thread stops when the last handle drops.
#[derive(Clone)]
pub struct EchoEngine {
    shared: Arc<Shared>,
    _owner: Arc<StopOnDrop>,
}

struct StopOnDrop(Arc<Shared>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        lock(&self.0).stopped = true;
        self.0.ready.notify_all();
    }
}

fn lock(shared: &Shared) -> std::sync::MutexGuard<'_, Queues> {
    // A panic while holding the lock cannot leave the queues inconsistent: every
    // critical section is a single push or pop.
    shared.queues.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl EchoEngine {
    /// Start the engine thread and wait until it is ready.
    pub fn start(config: EchoConfig) -> Self {
        let shared = Arc::new(Shared {
            queues: Mutex::new(Queues::default()),
            ready: Condvar::new(),
        });
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let worker = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("lorry-echo".into())
            .spawn(move || {
                let _ = ready_tx.send(());
                run(&worker, config);
            })
            .expect("spawning the echo engine thread");
        let _ = ready_rx.recv();
        EchoEngine {
            _owner: Arc::new(StopOnDrop(Arc::clone(&shared))),
            shared,
        }
    }
}

fn next_job(shared: &Shared) -> Option<Job> {
    let mut queues = lock(shared);
    loop {
        if queues.stopped {
            return None;
        }
        if let Some(job) = queues.realtime.pop_front().or_else(|| queues.batch.pop_front()) {
            return Some(job);
        }
        queues = shared.ready.wait(queues).unwrap_or_else(|p| p.into_inner());
    }
}

fn run(shared: &Shared, config: EchoConfig) {
    while let Some(job) = next_job(shared) {
        if job.events.is_closed() {
            continue; // cancelled before it started
        }
        if !config.delay.is_zero() {
            std::thread::sleep(config.delay);
        }
        serve(job);
    }
}

fn serve(job: Job) {
    let text = echo_text(&job.request);
    let prompt_tokens = words(&job.request.prompt_text());
    if job.request.stream {
        for word in text.split_inclusive(' ') {
            if job.events.send(Event::Token(word.to_string())).is_err() {
                return;
            }
        }
    }
    let output = Output {
        usage: Usage {
            prompt_tokens,
            completion_tokens: words(&text),
        },
        body: serde_json::json!({ "response": text }),
        completion: None,
    };
    let _ = job.events.send(Event::Finished(output));
}

fn echo_text(request: &ValidRequest) -> String {
    match &request.prompt {
        Prompt::Text(t) | Prompt::Plain(t) => t.clone(),
        Prompt::Messages(m) => m.last().map(|m| m.content.clone()).unwrap_or_default(),
    }
}

fn words(text: &str) -> u32 {
    text.split_whitespace().count() as u32
}

impl Backend for EchoEngine {
    fn model(&self) -> &str {
        ECHO_MODEL
    }

    fn submit(&self, request: ValidRequest, lane: Lane) -> Result<EventStream, EngineError> {
        let (events, stream) = mpsc::unbounded_channel();
        let job = Job { request, events };
        {
            let mut queues = lock(&self.shared);
            if queues.stopped {
                return Err(EngineError::Stopped);
            }
            match lane {
                Lane::RealTime => queues.realtime.push_back(job),
                Lane::Batch => queues.batch.push_back(job),
            }
        }
        self.shared.ready.notify_one();
        Ok(stream)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::{collect, Task};

    fn request(body: serde_json::Value) -> ValidRequest {
        ValidRequest::parse(Task::Echo, &body).unwrap()
    }

    #[tokio::test]
    async fn echo_returns_the_last_message() {
        let engine = EchoEngine::start(EchoConfig::default());
        let body =
            json!({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "hello there"}]});
        let out = collect(engine.submit(request(body), Lane::Batch).unwrap())
            .await
            .unwrap();
        assert_eq!(out.body, json!({"response": "hello there"}));
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
            .submit(request(json!({"prompt": "a b c", "stream": true})), Lane::RealTime)
            .unwrap();
        let mut tokens = String::new();
        while let Some(event) = events.recv().await {
            match event {
                Event::Token(t) => tokens.push_str(&t),
                Event::Finished(out) => {
                    assert_eq!(out.body["response"], "a b c");
                    break;
                }
                Event::Failed(e) => panic!("{e}"),
            }
        }
        assert_eq!(tokens, "a b c");
    }

    #[tokio::test]
    async fn the_real_time_lane_overtakes_queued_batch_work() {
        let engine = EchoEngine::start(EchoConfig {
            delay: Duration::from_millis(20),
        });
        let batch: Vec<_> = (0..5)
            .map(|i| {
                engine
                    .submit(request(json!({"prompt": format!("b{i}")})), Lane::Batch)
                    .unwrap()
            })
            .collect();
        let rt = engine.submit(request(json!({"prompt": "rt"})), Lane::RealTime).unwrap();
        collect(rt).await.unwrap();
        // The first batch job may already have started; the last cannot have finished.
        let mut last = batch.into_iter().last().unwrap();
        assert!(last.try_recv().is_err());
    }
}
