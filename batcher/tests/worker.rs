//! The worker's batch lane driven step by step: `Worker::process_chunk` and
//! `Worker::process_dead_letter` on a fresh database each, against a scripted
//! engine whose every answer is decided by its prompt, so redelivery,
//! deferral, failures, deleted adapters and dead-lettering are each
//! reproduced exactly, with no timing involved; and the worker's consumers
//! and the API's real-time client on the real broker for what only the
//! broker can do (a real-time request that expires in its queue, a lane's
//! queue deleted under a live link).

mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lorry_batcher::broker::{self, Topology};
use lorry_batcher::finaliser::{Finaliser, FinaliserConfig};
use lorry_batcher::ids::{AccountId, BatchId};
use lorry_batcher::model::{BatchStatus, Chunk, RequestStatus, Shape};
use lorry_batcher::realtime::{RealtimeClient, RtRequest};
use lorry_batcher::store::{Created, NewBatch, NewRequest, Store};
use lorry_batcher::worker::{Worker, WorkerConfig};
use lorry_engine::input::Prompt;
use lorry_engine::{
    Backend, Catalog, Content, EngineError, ErrorCode, Event, EventStream, InputError, ModelSpec, Output, Request,
    Task, Usage, ValidRequest,
};
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

const MODEL: &str = "@test/scripted";

/// An engine that answers by script: `ok:TEXT` finishes with TEXT, `fail`
/// fails in the model, `long` is refused as too long for the context,
/// `busy:N` is refused (the engine has stopped) the first N times it is
/// submitted, then finishes.
#[derive(Default)]
struct Scripted {
    submitted: Mutex<HashMap<String, usize>>,
}

impl Backend for Scripted {
    fn model(&self) -> &str {
        MODEL
    }

    fn submit(&self, request: Request) -> Result<EventStream, EngineError> {
        let Prompt::Text(prompt) = &request.input.prompt else {
            panic!("the script reads text prompts");
        };
        let times = {
            let mut submitted = self.submitted.lock().unwrap();
            let n = submitted.entry(prompt.clone()).or_default();
            *n += 1;
            *n
        };
        let event = match prompt.split_once(':') {
            Some(("ok", text)) => finished(text),
            Some(("busy", n)) if times <= n.parse().unwrap() => return Err(EngineError::Stopped),
            Some(("busy", _)) => finished("after a wait"),
            _ if prompt == "fail" => Event::Failed(EngineError::Model("the script fails".into())),
            _ if prompt == "long" => Event::Failed(EngineError::Input(InputError::new(
                ErrorCode::ContextLengthExceeded,
                "prompt",
                "too long",
            ))),
            _ => panic!("no script for {prompt:?}"),
        };
        let (tx, rx) = lorry_engine::event_channel();
        assert!(tx.send(event));
        Ok(rx)
    }
}

fn finished(text: &str) -> Event {
    Event::Finished(Output {
        content: Content::Text(text.into()),
        usage: Usage {
            prompt_tokens: 1,
            completion_tokens: 1,
        },
        completion: None,
        logprobs: None,
        choices: Vec::new(),
        tool_calls: Vec::new(),
    })
}

fn amqp_url() -> String {
    std::env::var("LORRY_AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

struct Setup {
    store: Store,
    topology: Topology,
    worker: Worker,
    engine: Arc<Scripted>,
    batch: BatchId,
    total: i32,
}

/// A batch of `prompts` (each may name an adapter after a `@`), and a worker to run it.
async fn batch_of(pool: PgPool, prompts: &[&str]) -> Setup {
    let store = Store::from_pool(pool);
    store.ensure_account("acct", "token").await.unwrap();
    let objects = support::fresh_bucket("lorry-worker").await;
    let prefix = format!("lorry-test-worker-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let topology = Topology::new(&prefix, 5);
    let finaliser = Finaliser::new(
        store.clone(),
        objects,
        topology.clone(),
        FinaliserConfig {
            stale_after: Duration::from_secs(60),
            progress_every: Duration::from_secs(3600),
            retention: None,
        },
    );
    let engine = Arc::new(Scripted::default());
    let catalog = Catalog::with_models([ModelSpec {
        name: MODEL.into(),
        task: Task::Echo,
        adapters: None,
    }]);
    let worker = Worker::new(
        store.clone(),
        finaliser,
        catalog,
        vec![engine.clone() as Arc<dyn Backend>],
        WorkerConfig {
            amqp_url: amqp_url(),
            topology: topology.clone(),
            batch_prefetch: 1,
            rt_prefetch: 1,
            flush_rows: 2,
            flush_interval: Duration::from_secs(3600),
            share_prefix_cache: false,
        },
    );
    let batch = BatchId::generate();
    let requests = prompts
        .iter()
        .map(|p| {
            let body = match p.split_once('@') {
                Some((prompt, adapter)) => json!({"prompt": prompt, "adapter": adapter}),
                None => json!({"prompt": p}),
            };
            NewRequest {
                custom_id: None,
                request: ValidRequest::parse(Task::Echo, &body).unwrap(),
            }
        })
        .collect();
    let new = NewBatch {
        id: batch.clone(),
        account_id: AccountId("acct".into()),
        model: MODEL.into(),
        shape: Shape::Native,
        openai: None,
        completion_window: "1h".into(),
        window: Duration::from_secs(3600),
        metadata: None,
        webhook_url: None,
        idempotency_key: None,
        request_hash: "h".into(),
        priority: 0,
        requests,
    };
    assert!(matches!(
        store.create_batch(new, vec![]).await.unwrap(),
        Created::New(_)
    ));
    Setup {
        store,
        topology,
        worker,
        engine,
        batch,
        total: prompts.len() as i32,
    }
}

impl Setup {
    fn chunk(&self) -> Chunk {
        Chunk {
            batch_id: self.batch.clone(),
            account_id: AccountId("acct".into()),
            model: MODEL.into(),
            start: 0,
            end: self.total,
            behind: 0,
        }
    }

    async fn status(&self) -> BatchStatus {
        let account = AccountId("acct".into());
        self.store.batch(&account, &self.batch).await.unwrap().unwrap().status
    }

    async fn error_codes(&self) -> Vec<Option<String>> {
        let finished = self.store.finished_requests(&self.batch).await.unwrap();
        finished
            .iter()
            .map(|r| r.error.as_ref().map(|e| e.code.clone()))
            .collect()
    }
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn a_chunk_ends_every_request_once_and_then_its_batch(pool: PgPool) {
    let lane = batch_of(pool, &["ok:a", "fail", "long", "ok:b"]).await;
    let report = lane.worker.process_chunk(&lane.chunk()).await.unwrap();
    assert_eq!((report.claimed, report.committed, report.deferred), (4, 4, 0));
    let tally = lane.store.tally(&lane.batch).await.unwrap();
    assert_eq!(tally.count(RequestStatus::Succeeded), 2);
    assert_eq!(tally.count(RequestStatus::Errored), 2);
    assert_eq!(
        lane.error_codes().await,
        vec![
            None,
            Some("model_error".into()),
            Some("context_length_exceeded".into()),
            None
        ]
    );
    assert_eq!(lane.status().await, BatchStatus::Completed);
    // Delivered again after the commit: nothing left to claim, nothing written twice.
    let again = lane.worker.process_chunk(&lane.chunk()).await.unwrap();
    assert_eq!((again.claimed, again.committed), (0, 0));
    assert_eq!(lane.engine.submitted.lock().unwrap().values().sum::<usize>(), 4);
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn a_refusing_engine_defers_its_requests_to_the_next_delivery(pool: PgPool) {
    let lane = batch_of(pool, &["ok:a", "busy:1", "ok:b"]).await;
    let first = lane.worker.process_chunk(&lane.chunk()).await.unwrap();
    assert_eq!((first.claimed, first.committed, first.deferred), (3, 2, 1));
    assert_eq!(
        lane.status().await,
        BatchStatus::InProgress,
        "a deferred request keeps the batch open"
    );
    // The redelivery takes back only the request left running.
    let second = lane.worker.process_chunk(&lane.chunk()).await.unwrap();
    assert_eq!((second.claimed, second.committed, second.deferred), (1, 1, 0));
    assert_eq!(lane.status().await, BatchStatus::Completed);
    let submitted = lane.engine.submitted.lock().unwrap().clone();
    assert_eq!((submitted["ok:a"], submitted["busy:1"], submitted["ok:b"]), (1, 2, 1));
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn an_adapter_deleted_after_acceptance_ends_its_request_and_no_other(pool: PgPool) {
    let lane = batch_of(pool, &["ok:a@adapter_gone", "ok:b"]).await;
    let report = lane.worker.process_chunk(&lane.chunk()).await.unwrap();
    assert_eq!((report.committed, report.deferred), (2, 0));
    assert_eq!(lane.error_codes().await, vec![Some("adapter_not_found".into()), None]);
    assert!(!lane.engine.submitted.lock().unwrap().contains_key("ok:a"));
    assert_eq!(lane.status().await, BatchStatus::Completed);
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn a_dead_lettered_chunk_ends_what_is_unfinished_once(pool: PgPool) {
    let lane = batch_of(pool, &["ok:a", "busy:9", "busy:9"]).await;
    let first = lane.worker.process_chunk(&lane.chunk()).await.unwrap();
    assert_eq!((first.committed, first.deferred), (1, 2));
    // Delivered the most times allowed: the dead-letter consumer ends the rest.
    assert_eq!(lane.worker.process_dead_letter(&lane.chunk()).await.unwrap(), 2);
    assert_eq!(lane.worker.process_dead_letter(&lane.chunk()).await.unwrap(), 0);
    assert_eq!(
        lane.error_codes().await,
        vec![
            None,
            Some("delivery_limit_exceeded".into()),
            Some("delivery_limit_exceeded".into())
        ]
    );
    assert_eq!(lane.status().await, BatchStatus::Completed);
}

/// Messages ready in `queue`.
async fn depth(channel: &lapin::Channel, queue: &str) -> u32 {
    let options = lapin::options::QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    channel
        .queue_declare(queue, options, Default::default())
        .await
        .unwrap()
        .message_count()
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn a_real_time_request_that_expired_in_its_queue_is_dropped_unserved(pool: PgPool) {
    let lane = batch_of(pool, &["ok:batch"]).await;
    let before = lane.status().await;
    let connection = broker::connect(&amqp_url(), "lorry-test").await.unwrap();
    let publisher = broker::Publisher::open(&connection).await.unwrap();
    let channel = publisher.channel();
    lane.topology.declare(channel, [MODEL]).await.unwrap();
    let request = RtRequest {
        model: MODEL.into(),
        request: ValidRequest::parse(Task::Echo, &json!({"prompt": "ok:expired"})).unwrap(),
        account_id: Some(AccountId("acct".into())),
    };
    // Published with a 1 ms expiry while no worker runs: it expires unserved
    // and is dead-lettered, reply queue and all.
    let properties = broker::json_properties()
        .with_reply_to("nobody".into())
        .with_correlation_id("expired".into())
        .with_expiration("1".into());
    let body = serde_json::to_vec(&request).unwrap();
    publisher
        .publish("", &lane.topology.rt_queue(MODEL), &body, properties)
        .await
        .unwrap();
    let dlq = lane.topology.dead_letter_queue();
    // Each look is a round trip to the broker, which paces the loop; no
    // deadline of its own (nextest's `terminate-after` reports a hang).
    while depth(channel, &dlq).await == 0 {
        tokio::task::yield_now().await;
    }
    // A worker takes it off the dead-letter queue and drops it.
    let stop = CancellationToken::new();
    let running = tokio::spawn({
        let (worker, stop) = (lane.worker.clone(), stop.clone());
        async move { worker.run(stop).await }
    });
    while depth(channel, &dlq).await > 0 {
        tokio::task::yield_now().await;
    }
    // Taken is not yet acked. The dead-letter consumer holds one message at a
    // time: once a second one is taken too, the first was acked (a first
    // requeued instead would come back ahead of it, and the wait never end).
    let properties = broker::json_properties()
        .with_reply_to("nobody".into())
        .with_correlation_id("expired-too".into());
    publisher.publish("", &dlq, &body, properties).await.unwrap();
    while depth(channel, &dlq).await > 0 {
        tokio::task::yield_now().await;
    }
    stop.cancel();
    running.await.unwrap();
    assert!(
        lane.engine.submitted.lock().unwrap().is_empty(),
        "an expired request reached the engine"
    );
    // Nothing of any batch was touched.
    let tally = lane.store.tally(&lane.batch).await.unwrap();
    assert_eq!(tally.count(RequestStatus::Pending), 1);
    assert_eq!(lane.status().await, before);
    // Not before the queues' dead-letter workers have started: on RabbitMQ
    // 3.10 a quorum queue deleted while its worker starts can take down the
    // node's supervisor of them (`dead_letter_workers_started` in
    // tests/e2e/common.rs says how, and waits the same way).
    dead_letter_workers_started().await;
    for queue in [
        lane.topology.rt_queue(MODEL),
        lane.topology.batch_queue(MODEL),
        lane.topology.batch_ahead_queue(MODEL),
        dlq,
    ] {
        let _ = channel.queue_delete(&queue, Default::default()).await;
    }
}

/// Wait until every quorum queue's dead-letter worker has started, before
/// queues are deleted (see `dead_letter_workers_started` in
/// tests/e2e/common.rs).
async fn dead_letter_workers_started() {
    let _ = tokio::process::Command::new("rabbitmqctl")
        .args([
            "-q",
            "eval",
            "[catch sys:get_state(P, 30000) || {_, P, _, _} <- supervisor:which_children(rabbit_fifo_dlx_sup), is_pid(P)], ok.",
        ])
        .output()
        .await;
}

#[tokio::test]
async fn a_real_time_request_finds_its_lane_declared_again_after_its_queue_was_deleted() {
    let prefix = format!("lorry-test-rt-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let topology = Topology::new(&prefix, 5);
    let client = RealtimeClient::new(&amqp_url(), topology.clone(), vec![MODEL.into()], 64);
    let request = RtRequest {
        model: MODEL.into(),
        request: ValidRequest::parse(Task::Echo, &json!({"prompt": "ok:rt"})).unwrap(),
        account_id: Some(AccountId("acct".into())),
    };
    let queue = topology.rt_queue(MODEL);
    // The first request opens the client's link, which declares the lanes.
    client.submit(&request, Duration::from_secs(600)).await.unwrap();
    let connection = broker::connect(&amqp_url(), "lorry-test").await.unwrap();
    let channel = connection.create_channel().await.unwrap();
    assert_eq!(depth(&channel, &queue).await, 1);
    // The queue goes (an operator, an expiry policy) while the link lives:
    // the next request is not lost to a 503 but published on a link that
    // declares the lane again.
    dead_letter_workers_started().await;
    channel.queue_delete(&queue, Default::default()).await.unwrap();
    client
        .submit(&request, Duration::from_secs(600))
        .await
        .expect("published onto the lane declared again");
    assert_eq!(
        depth(&channel, &queue).await,
        1,
        "the second request alone, in the new queue"
    );
    dead_letter_workers_started().await;
    for queue in [
        queue,
        topology.batch_queue(MODEL),
        topology.batch_ahead_queue(MODEL),
        topology.dead_letter_queue(),
    ] {
        let _ = channel.queue_delete(&queue, Default::default()).await;
    }
}
