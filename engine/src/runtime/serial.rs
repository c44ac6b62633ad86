//! A one-request-at-a-time engine thread with two lanes: the shape of the
//! echo model and of the embedding engine, whose requests are short and need
//! no batching across requests. The real-time lane is always served first.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};

use crate::input::ValidRequest;
use crate::{event_channel, EngineError, EventStream, Events, Lane};

struct Job {
    request: ValidRequest,
    events: Events,
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

/// A handle to the queue's thread; the thread stops when the last handle drops.
#[derive(Clone)]
pub(crate) struct SerialQueue {
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

impl SerialQueue {
    /// Start a thread named `name` that hands each request, real time first, to `serve`.
    pub fn start<F>(name: &str, mut serve: F) -> Self
    where
        F: FnMut(ValidRequest, &Events) + Send + 'static,
    {
        let shared = Arc::new(Shared {
            queues: Mutex::new(Queues::default()),
            ready: Condvar::new(),
        });
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let worker = Arc::clone(&shared);
        std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let _ = ready_tx.send(());
                while let Some(job) = next_job(&worker) {
                    if !job.events.is_closed() {
                        serve(job.request, &job.events);
                    }
                }
            })
            .expect("spawning an engine thread");
        let _ = ready_rx.recv();
        SerialQueue {
            _owner: Arc::new(StopOnDrop(Arc::clone(&shared))),
            shared,
        }
    }

    /// Queue a request on its lane.
    pub fn submit(&self, request: ValidRequest, lane: Lane) -> Result<EventStream, EngineError> {
        let (events, stream) = event_channel();
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
