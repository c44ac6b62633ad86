//! Store tests on a fresh database each: the state machine behind "exactly one
//! result per accepted request".

use std::time::Duration;

use lorry_batcher::ids::{AccountId, BatchId};
use lorry_batcher::model::{BatchStatus, Chunk, RequestStatus, Shape};
use lorry_batcher::store::{
    ClaimedInput, Created, Dispatch, NewBatch, NewRequest, OutboxMessage, Outcome, Room, Store,
};
use lorry_engine::{Task, ValidRequest};
use serde_json::json;
use sqlx::PgPool;

fn prompt(i: usize) -> ValidRequest {
    ValidRequest::parse(Task::Echo, &json!({"prompt": format!("p{i}"), "max_tokens": 3})).unwrap()
}

/// The outbox row of `account`'s chunk of one request at `start` of `batch`, held for fair dispatch on "lane".
fn held_chunk(batch: &BatchId, account: &str, start: i32) -> OutboxMessage {
    OutboxMessage {
        exchange: String::new(),
        routing_key: "lane".into(),
        payload: json!({"batch_id": batch, "account_id": account, "model": "@lorry/echo", "start": start, "end": start + 1}),
        account_id: Some(AccountId(account.into())),
        traceparent: None,
    }
}

/// Room in the lane's queue only, none ahead.
fn queue_room(queue: usize) -> Room {
    Room {
        queue,
        ahead: 0,
        queue_depth: 4,
        one_account: false,
    }
}

fn new_batch(id: &BatchId, n: usize, window: Duration, priority: i16) -> NewBatch {
    NewBatch {
        id: id.clone(),
        account_id: AccountId("acct".into()),
        model: "@lorry/echo".into(),
        shape: Shape::Native,
        openai: None,
        completion_window: "1h".into(),
        window,
        metadata: None,
        webhook_url: None,
        idempotency_key: None,
        request_hash: "h".into(),
        priority,
        requests: (0..n)
            .map(|i| NewRequest {
                custom_id: None,
                request: prompt(i),
            })
            .collect(),
    }
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn an_accounts_higher_priority_batch_goes_out_first_and_accounts_take_turns(pool: PgPool) {
    let store = Store::from_pool(pool);
    store.ensure_account("acct", "token").await.unwrap();
    store.ensure_account("other", "other-token").await.unwrap();
    let held = |batch: &BatchId, account: &str, start: i32| OutboxMessage {
        traceparent: Some(format!("00-{:032x}-{:016x}-01", start + 1, 7)),
        ..held_chunk(batch, account, start)
    };
    // acct: a batch of priority 0, then one of priority 5; other: one batch, last.
    let (low, high, theirs) = (BatchId::generate(), BatchId::generate(), BatchId::generate());
    for (id, priority) in [(&low, 0), (&high, 5)] {
        let outbox = (0..2).map(|i| held(id, "acct", i)).collect();
        store
            .create_batch(new_batch(id, 2, Duration::from_secs(3600), priority), outbox)
            .await
            .unwrap();
    }
    let mut other = new_batch(&theirs, 2, Duration::from_secs(3600), 0);
    other.account_id = AccountId("other".into());
    let outbox = (0..2).map(|i| held(&theirs, "other", i)).collect();
    store.create_batch(other, outbox).await.unwrap();

    let published = std::sync::Mutex::new(Vec::new());
    let mut order = Vec::new();
    for _ in 0..6 {
        let sent = store
            .dispatch_fair("lane", queue_room(1), |messages| async {
                published.lock().unwrap().extend(messages);
                Ok(())
            })
            .await
            .unwrap();
        assert_eq!(sent, Dispatch::Sent(1));
        let message = published.lock().unwrap().pop().unwrap();
        // The trace context written with the message goes out with it.
        let start = message.payload["start"].as_i64().unwrap();
        assert_eq!(
            message.traceparent,
            Some(format!("00-{:032x}-{:016x}-01", start + 1, 7))
        );
        order.push((
            message.payload["account_id"].as_str().unwrap().to_string(),
            message.payload["batch_id"].as_str().unwrap().to_string(),
        ));
    }
    let expect = |account: &str, id: &BatchId| (account.to_string(), id.to_string());
    // Neither account has had a turn: by name, acct first; its priority-5
    // batch before its older one; then the two accounts alternate.
    assert_eq!(
        order,
        vec![
            expect("acct", &high),
            expect("other", &theirs),
            expect("acct", &high),
            expect("other", &theirs),
            expect("acct", &low),
            expect("acct", &low),
        ]
    );
    assert_eq!(
        store.held_lanes().await.unwrap(),
        Vec::<(String, i64)>::new(),
        "nothing left held"
    );
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn the_account_with_fewest_chunks_in_flight_is_published_first(pool: PgPool) {
    let store = Store::from_pool(pool);
    store.ensure_account("acct", "token").await.unwrap();
    store.ensure_account("other", "other-token").await.unwrap();
    let held = held_chunk;
    let chunk = |batch: &BatchId, account: &str, start: i32| Chunk {
        batch_id: batch.clone(),
        account_id: AccountId(account.into()),
        model: "@lorry/echo".into(),
        start,
        end: start + 1,
        behind: 0,
    };
    let dispatch = |room: usize| {
        let store = store.clone();
        async move {
            let published = std::sync::Mutex::new(Vec::new());
            store
                .dispatch_fair("lane", queue_room(room), |messages| async {
                    published.lock().unwrap().extend(messages);
                    Ok(())
                })
                .await
                .unwrap();
            published
                .into_inner()
                .unwrap()
                .iter()
                .map(|m| {
                    (
                        m.payload["account_id"].as_str().unwrap().to_string(),
                        m.payload["start"].as_i64().unwrap(),
                        m.payload["behind"].as_i64().unwrap(),
                    )
                })
                .collect::<Vec<_>>()
        }
    };
    // (account, chunk, the account's chunks still held behind it).
    let expect = |v: &[(&str, i64, i64)]| v.iter().map(|(a, i, b)| (a.to_string(), *i, *b)).collect::<Vec<_>>();
    // acct's large batch: three chunks go out while it is alone.
    let large = BatchId::generate();
    store
        .create_batch(
            new_batch(&large, 6, Duration::from_secs(3600), 0),
            (0..6).map(|i| held(&large, "acct", i)).collect(),
        )
        .await
        .unwrap();
    assert_eq!(
        dispatch(3).await,
        expect(&[("acct", 0, 5), ("acct", 1, 4), ("acct", 2, 3)])
    );
    // other arrives behind it: with none in flight against acct's three, it
    // takes the next places.
    let small = BatchId::generate();
    let mut theirs = new_batch(&small, 3, Duration::from_secs(3600), 0);
    theirs.account_id = AccountId("other".into());
    store
        .create_batch(theirs, (0..3).map(|i| held(&small, "other", i)).collect())
        .await
        .unwrap();
    // A round sized while acct alone held chunks (the queue ahead not looked
    // at) finds other's too: it publishes nothing, so that the relay sizes it
    // again rather than route other's chunks as if acct were alone.
    let stale = store
        .dispatch_fair(
            "lane",
            Room {
                one_account: true,
                ..queue_room(3)
            },
            |_| async { panic!("nothing is published") },
        )
        .await
        .unwrap();
    assert_eq!(stale, Dispatch::Stale);
    // While another relay's round holds the lane, nothing goes out here.
    let mut other_round = store.pool().begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('lorry-dispatch:' || 'lane'))")
        .execute(&mut *other_round)
        .await
        .unwrap();
    let busy = store
        .dispatch_fair("lane", queue_room(3), |_| async { panic!("nothing is published") })
        .await
        .unwrap();
    assert_eq!(busy, Dispatch::Busy);
    other_round.rollback().await.unwrap();
    // Two accounts hold chunks on the lane now: the relay looks at its queue ahead.
    assert_eq!(store.held_lanes().await.unwrap(), vec![("lane".to_string(), 2)]);
    assert_eq!(dispatch(1).await, expect(&[("other", 0, 2)]));
    assert_eq!(dispatch(1).await, expect(&[("other", 1, 1)]));
    // acct's three are served (one reported twice, as a redelivered chunk
    // would be): acct now has none in flight against other's two.
    for start in [0, 1, 2, 2] {
        store.chunk_done(&chunk(&large, "acct", start)).await.unwrap();
    }
    assert_eq!(dispatch(2).await, expect(&[("acct", 3, 2), ("acct", 4, 1)]));
    // Two each: other's turn is older.
    assert_eq!(dispatch(1).await, expect(&[("other", 2, 0)]));
    assert_eq!(dispatch(5).await, expect(&[("acct", 5, 0)]));
    assert!(dispatch(1).await.is_empty());
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn a_cancelled_batchs_chunks_still_held_are_dropped(pool: PgPool) {
    let store = Store::from_pool(pool);
    store.ensure_account("acct", "token").await.unwrap();
    let id = BatchId::generate();
    let outbox = (0..3)
        .map(|i| OutboxMessage {
            exchange: String::new(),
            routing_key: "lane".into(),
            payload: json!({"batch_id": id, "account_id": "acct", "model": "@lorry/echo", "start": i, "end": i + 1}),
            account_id: Some(AccountId("acct".into())),
            traceparent: None,
        })
        .collect();
    store
        .create_batch(new_batch(&id, 3, Duration::from_secs(3600), 0), outbox)
        .await
        .unwrap();
    assert_eq!(store.held_lanes().await.unwrap(), vec![("lane".to_string(), 1)]);
    store
        .cancel_batch(&AccountId("acct".into()), &id)
        .await
        .unwrap()
        .unwrap();
    assert!(store.held_lanes().await.unwrap().is_empty(), "nothing left to dispatch");
}

async fn store_with_batch(pool: PgPool, n: usize, window: Duration) -> (Store, BatchId) {
    let store = Store::from_pool(pool);
    store.ensure_account("acct", "token").await.unwrap();
    let id = BatchId::generate();
    assert!(matches!(
        store.create_batch(new_batch(&id, n, window, 0), vec![]).await.unwrap(),
        Created::New(_)
    ));
    (store, id)
}

fn chunk(id: &BatchId, start: i32, end: i32) -> Chunk {
    Chunk {
        batch_id: id.clone(),
        account_id: AccountId("acct".into()),
        model: "@lorry/echo".into(),
        start,
        end,
        behind: 0,
    }
}

fn ok(index: i32) -> Outcome {
    Outcome {
        index,
        result: Ok(json!({"response": index})),
        prompt_tokens: 1,
        completion_tokens: 1,
        finish_reason: Some("stop"),
    }
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn a_result_is_committed_once_however_often_it_is_delivered(pool: PgPool) {
    let (store, id) = store_with_batch(pool, 4, Duration::from_secs(3600)).await;
    let first = store.claim(&chunk(&id, 0, 4)).await.unwrap();
    assert_eq!(first.iter().map(|c| c.index).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    // A redelivered chunk takes back what its earlier holder left running.
    let again = store.claim(&chunk(&id, 0, 4)).await.unwrap();
    assert!(again.iter().all(|c| c.attempts == 2));

    let outcomes: Vec<Outcome> = (0..4).map(ok).collect();
    let written = store.commit(&id, &outcomes).await.unwrap();
    assert_eq!(
        (written.rows, written.succeeded, written.errored, written.prompt_tokens),
        (4, 4, 0, 4),
        "the commit says what it wrote"
    );
    assert_eq!(
        store.commit(&id, &outcomes).await.unwrap(),
        lorry_batcher::store::Committed::default(),
        "a second commit writes nothing"
    );
    assert!(
        store.claim(&chunk(&id, 0, 4)).await.unwrap().is_empty(),
        "finished requests are not claimed"
    );
    let tally = store.tally(&id).await.unwrap();
    assert_eq!(tally.count(RequestStatus::Succeeded), 4);
    assert_eq!(tally.prompt_tokens, 4);
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn an_output_holding_u0000_is_stored_and_read_back_as_generated(pool: PgPool) {
    // Byte-fallback tokens produce U+0000 readily; the chunk's commit must
    // not fail for it (nor for the innocent results committed beside it).
    let (store, id) = store_with_batch(pool, 2, Duration::from_secs(3600)).await;
    store.claim(&chunk(&id, 0, 2)).await.unwrap();
    let generated = "a\u{0}b \\u0000 \u{1}\u{7f}\u{fffd}";
    let outcomes = vec![
        Outcome {
            result: Ok(json!({"response": generated})),
            ..ok(0)
        },
        ok(1),
    ];
    assert_eq!(store.commit(&id, &outcomes).await.unwrap().rows, 2);
    let finished = store.finished_requests(&id).await.unwrap();
    assert_eq!(finished[0].response, Some(json!({"response": generated})));
    assert_eq!(finished[1].response, Some(json!({"response": 1})));
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn a_request_is_claimed_as_the_typed_request_it_was_stored_as(pool: PgPool) {
    let (store, id) = store_with_batch(pool.clone(), 2, Duration::from_secs(3600)).await;
    // A row written before requests were stored typed holds the client's body only.
    sqlx::query("UPDATE requests SET request = NULL, body = $2 WHERE batch_id = $1 AND idx = 1")
        .bind(id.as_str())
        .bind(json!({"prompt": "legacy"}))
        .execute(&pool)
        .await
        .unwrap();
    let claimed = store.claim(&chunk(&id, 0, 2)).await.unwrap();
    match &claimed[0].input {
        ClaimedInput::Valid(request) => assert_eq!(request, &prompt(0)),
        other => panic!("stored typed, claimed as {other:?}"),
    }
    match &claimed[1].input {
        ClaimedInput::Legacy(body) => assert_eq!(body, &json!({"prompt": "legacy"})),
        other => panic!("stored as a body, claimed as {other:?}"),
    }
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn only_one_finaliser_wins_and_only_once_every_request_ended(pool: PgPool) {
    let (store, id) = store_with_batch(pool, 2, Duration::from_secs(3600)).await;
    store.claim(&chunk(&id, 0, 2)).await.unwrap();
    store.commit(&id, &[ok(0)]).await.unwrap();
    assert!(
        store.begin_finalizing(&id).await.unwrap().is_none(),
        "a request is still running"
    );
    store.commit(&id, &[ok(1)]).await.unwrap();
    let batch = store.begin_finalizing(&id).await.unwrap().expect("ready");
    assert_eq!(batch.status, BatchStatus::Finalizing);
    assert!(
        store.begin_finalizing(&id).await.unwrap().is_none(),
        "a second finaliser gets nothing"
    );
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn a_failed_finalisation_is_handed_back_to_the_sweepers_after_its_delay_not_the_stale_period(pool: PgPool) {
    let stale = Duration::from_secs(3600);
    let (store, id) = store_with_batch(pool, 1, stale).await;
    store.claim(&chunk(&id, 0, 1)).await.unwrap();
    store.commit(&id, &[ok(0)]).await.unwrap();
    store.begin_finalizing(&id).await.unwrap().expect("ready");
    assert!(
        store.reclaim_stale_finalizing(stale).await.unwrap().is_empty(),
        "a live finaliser's claim is not taken"
    );
    // Its finaliser failed: retried in an hour less a moment, not yet due.
    assert!(store
        .retry_finalizing_after(&id, stale, Duration::from_secs(60))
        .await
        .unwrap());
    assert!(store.reclaim_stale_finalizing(stale).await.unwrap().is_empty());
    // Due now: one sweeper takes it (and its claim is fresh again).
    assert!(store.retry_finalizing_after(&id, stale, Duration::ZERO).await.unwrap());
    let taken = store.reclaim_stale_finalizing(stale).await.unwrap();
    assert_eq!(taken.len(), 1);
    assert_eq!(taken[0].id, id);
    assert!(store.reclaim_stale_finalizing(stale).await.unwrap().is_empty());
}

#[test]
fn a_failed_finalisation_waits_one_second_doubling_up_to_the_stale_period() {
    use lorry_batcher::finaliser::finalize_retry_delay;
    let stale = Duration::from_secs(60);
    let delays: Vec<u64> = (1..=8).map(|n| finalize_retry_delay(n, stale).as_secs()).collect();
    assert_eq!(delays, [1, 2, 4, 8, 16, 32, 60, 60]);
    assert_eq!(finalize_retry_delay(u32::MAX, stale), stale);
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn cancelling_ends_pending_requests_and_leaves_running_ones(pool: PgPool) {
    let (store, id) = store_with_batch(pool, 3, Duration::from_secs(3600)).await;
    store.claim(&chunk(&id, 0, 1)).await.unwrap();
    let account = AccountId("acct".into());
    let batch = store.cancel_batch(&account, &id).await.unwrap().unwrap();
    assert_eq!(batch.status, BatchStatus::Cancelling);
    let tally = store.tally(&id).await.unwrap();
    assert_eq!(
        (
            tally.count(RequestStatus::Running),
            tally.count(RequestStatus::Canceled)
        ),
        (1, 2)
    );
    assert!(
        store.claim(&chunk(&id, 1, 3)).await.unwrap().is_empty(),
        "cancelled requests never start"
    );
    store.commit(&id, &[ok(0)]).await.unwrap();
    assert_eq!(
        store
            .begin_finalizing(&id)
            .await
            .unwrap()
            .unwrap()
            .end_reason
            .as_deref(),
        Some("cancelled")
    );
    let other = AccountId("someone".into());
    assert!(store.cancel_batch(&other, &id).await.unwrap().is_none());
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn a_batch_past_its_window_expires_only_its_unstarted_requests(pool: PgPool) {
    let (store, id) = store_with_batch(pool, 3, Duration::ZERO).await;
    store.claim(&chunk(&id, 0, 1)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(store.expire_due().await.unwrap(), vec![id.clone()]);
    assert!(store.expire_due().await.unwrap().is_empty(), "expiry happens once");
    let tally = store.tally(&id).await.unwrap();
    assert_eq!(
        (tally.count(RequestStatus::Running), tally.count(RequestStatus::Expired)),
        (1, 2)
    );
    let finished = store.finished_requests(&id).await.unwrap();
    assert_eq!(finished[0].error.as_ref().unwrap().code, "batch_expired");
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn a_dead_lettered_chunk_ends_its_unfinished_requests_as_errors(pool: PgPool) {
    let (store, id) = store_with_batch(pool, 3, Duration::from_secs(3600)).await;
    store.claim(&chunk(&id, 0, 3)).await.unwrap();
    store.commit(&id, &[ok(0)]).await.unwrap();
    let error = lorry_batcher::model::RequestError {
        kind: "errored".into(),
        code: "delivery_limit_exceeded".into(),
        message: "dead".into(),
        retryable: false,
    };
    assert_eq!(store.fail_chunk(&chunk(&id, 0, 3), &error).await.unwrap(), 2);
    let tally = store.tally(&id).await.unwrap();
    assert_eq!(
        (
            tally.count(RequestStatus::Succeeded),
            tally.count(RequestStatus::Errored)
        ),
        (1, 2)
    );
}

/// The rows the scans of an `EXPLAIN (ANALYZE, FORMAT JSON)` plan read, all
/// loops: those they returned and those their filters removed (a bitmap's
/// by its index scan, the entries it found).
fn rows_read(node: &serde_json::Value) -> f64 {
    let count = |key: &str| node[key].as_f64().unwrap_or(0.0);
    let own = match node["Node Type"].as_str() {
        Some("Seq Scan" | "Index Scan" | "Index Only Scan" | "Bitmap Index Scan") => {
            (count("Actual Rows") + count("Rows Removed by Filter")) * node["Actual Loops"].as_f64().unwrap_or(1.0)
        }
        _ => 0.0,
    };
    own + node["Plans"]
        .as_array()
        .map_or(0.0, |children| children.iter().map(rows_read).sum())
}

/// `statement` (with `types`) prepared, planned once for all parameters as a
/// pooled connection's prepared statement may be, run on `arguments` and
/// rolled back: the rows its scans read.
async fn generic_plan_reads(pool: &PgPool, statement: &str, types: &str, arguments: &str) -> f64 {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL plan_cache_mode = force_generic_plan")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::raw_sql(&format!("PREPARE probe({types}) AS {statement}"))
        .execute(&mut *tx)
        .await
        .unwrap();
    let plan: serde_json::Value =
        sqlx::query_scalar(&format!("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE probe({arguments})"))
            .fetch_one(&mut *tx)
            .await
            .unwrap();
    // A prepared statement outlives the transaction (a rollback keeps it),
    // and the pool may hand this connection to the next call.
    sqlx::query("DEALLOCATE probe").execute(&mut *tx).await.unwrap();
    tx.rollback().await.unwrap();
    rows_read(&plan[0]["Plan"])
}

#[sqlx::test(migrator = "lorry_batcher::MIGRATOR")]
async fn a_chunks_claim_and_commit_read_its_own_rows_not_every_open_request_of_the_batch(pool: PgPool) {
    // A large batch's requests are mostly open while it drains. A statement
    // that read them all for each chunk would cost each chunk of a
    // 50,000-request batch as much as the whole batch. The table's
    // statistics, as in a deployment that has served batches before, say
    // that open requests are rare: they were taken with every request ended.
    let (store, ended) = store_with_batch(pool.clone(), 5_000, Duration::from_secs(3600)).await;
    store
        .cancel_batch(&AccountId("acct".into()), &ended)
        .await
        .unwrap()
        .unwrap();
    sqlx::query("ANALYZE requests").execute(&pool).await.unwrap();
    let (store, id) = store_with_batch(pool.clone(), 5_000, Duration::from_secs(3600)).await;
    store.claim(&chunk(&id, 64, 128)).await.unwrap();
    let batch = format!("'{}'", id.as_str());
    let claim = generic_plan_reads(
        &pool,
        lorry_batcher::store::CLAIM_SQL,
        "text, int, int",
        &format!("{batch}, 128, 192"),
    )
    .await;
    assert!(claim <= 64.0, "a claim of 64 requests read {claim} rows");
    let list = |item: &dyn Fn(i32) -> String| (64..96).map(item).collect::<Vec<_>>().join(",");
    let arguments = format!(
        "{batch}, ARRAY[{}], ARRAY[{}], ARRAY[{}], ARRAY[{}]::jsonb[], ARRAY[{}], ARRAY[{}], ARRAY[{}], 64, 95",
        list(&|i| i.to_string()),
        list(&|_| "'succeeded'".into()),
        list(&|i| format!("'{{\"response\": {i}}}'")),
        list(&|_| "NULL".into()),
        list(&|_| "1".into()),
        list(&|_| "1".into()),
        list(&|_| "'stop'".into()),
    );
    let commit = generic_plan_reads(
        &pool,
        lorry_batcher::store::COMMIT_SQL,
        "text, int[], text[], text[], jsonb[], int[], int[], text[], int, int",
        &arguments,
    )
    .await;
    assert!(commit <= 64.0, "a commit of 32 results read {commit} rows");
}
