//! `GET /metrics`: what the API counts (HTTP requests by route and status,
//! real-time requests with their time to first token and total latency), the
//! lanes' queues (requests waiting, and how long the oldest has waited) and
//! batches by status, in Prometheus's text format.
//!
//! The route takes no token, so it says nothing of any account: no account,
//! adapter or request id is a label, and every label value is one the code
//! chose (a route template, never the path a client sent). The figures read
//! from PostgreSQL and RabbitMQ are read at most once per
//! [`SHARED_FIGURES_TTL`], however often `/metrics` is asked for.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use lorry_metrics::{Counter, Family, Histogram, Text};
use tracing::Instrument as _;

use crate::AppState;

/// How long the figures read from PostgreSQL and RabbitMQ are reused.
pub const SHARED_FIGURES_TTL: Duration = Duration::from_secs(1);

/// Writes more families into the API's exposition: a process that is also
/// a worker adds the worker's.
pub type MoreMetrics = Arc<dyn Fn(&mut Text) + Send + Sync>;

/// What the API counts; one per process.
pub struct ApiMetrics {
    http_requests: Family<Counter, 3>,
    http_duration: Family<Histogram, 2>,
    realtime_requests: Family<Counter, 2>,
    first_token: Family<Histogram, 1>,
    realtime_duration: Family<Histogram, 1>,
    waiting: Family<WaitQueue, 1>,
    shared: tokio::sync::Mutex<Option<(Instant, String)>>,
}

impl Default for ApiMetrics {
    fn default() -> Self {
        ApiMetrics {
            http_requests: Family::counters(["method", "route", "status"]),
            http_duration: Family::seconds(["method", "route"]),
            realtime_requests: Family::counters(["model", "outcome"]),
            first_token: Family::seconds(["model"]),
            realtime_duration: Family::seconds(["model"]),
            waiting: Family::new(["model"], WaitQueue::default),
            shared: tokio::sync::Mutex::new(None),
        }
    }
}

impl std::fmt::Debug for ApiMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiMetrics").finish_non_exhaustive()
    }
}

/// The real-time requests of one model waiting for their first reply, by
/// when they were published.
#[derive(Default)]
struct WaitQueue {
    next: AtomicU64,
    waiting: Mutex<BTreeMap<u64, Instant>>,
}

impl WaitQueue {
    fn oldest(&self) -> Option<Duration> {
        let waiting = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        waiting.values().next().map(Instant::elapsed)
    }
}

/// One real-time call, counted from publication to its last reply: its
/// first reply is its time to first token; it ends succeeded, errored,
/// timed out, or (dropped before its last reply) cancelled.
pub struct RealtimeTally {
    metrics: Arc<ApiMetrics>,
    model: String,
    started: Instant,
    waiting: Option<(Arc<WaitQueue>, u64)>,
    ended: bool,
}

impl RealtimeTally {
    /// A call to `model` published now.
    pub fn start(metrics: &Arc<ApiMetrics>, model: &str) -> Self {
        let queue = metrics.waiting.with([model]);
        let id = queue.next.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        queue.waiting.lock().unwrap_or_else(|p| p.into_inner()).insert(id, now);
        RealtimeTally {
            metrics: Arc::clone(metrics),
            model: model.to_string(),
            started: now,
            waiting: Some((queue, id)),
            ended: false,
        }
    }

    /// A reply arrived.
    pub fn reply(&mut self, reply: &lorry_batcher::realtime::Reply) {
        use lorry_batcher::realtime::Reply;
        let answered = matches!(reply, Reply::Token { .. } | Reply::Done { .. });
        if self.stop_waiting() && answered {
            self.metrics
                .first_token
                .with([self.model.as_str()])
                .observe_duration(self.started.elapsed());
        }
        match reply {
            Reply::Done { .. } => self.end("succeeded"),
            Reply::Error { .. } => self.end("errored"),
            Reply::Token { .. } => {}
        }
    }

    /// No answer came in time.
    pub fn timed_out(&mut self) {
        self.end("timed_out");
    }

    /// Whether the call was still waiting for its first reply.
    fn stop_waiting(&mut self) -> bool {
        match self.waiting.take() {
            Some((queue, id)) => {
                queue.waiting.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
                true
            }
            None => false,
        }
    }

    fn end(&mut self, outcome: &str) {
        self.stop_waiting();
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        self.metrics
            .realtime_requests
            .with([self.model.as_str(), outcome])
            .inc();
        self.metrics
            .realtime_duration
            .with([self.model.as_str()])
            .observe_duration(self.started.elapsed());
    }
}

impl Drop for RealtimeTally {
    fn drop(&mut self) {
        self.end("cancelled");
    }
}

/// Count every HTTP request by method, route template and status, and
/// serve it in a span of its own: a child of the client's `traceparent`
/// where it sends one.
pub async fn track(State(metrics): State<Arc<ApiMetrics>>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    // A client's method or path is never a label value: only those the routes name.
    let method = match *request.method() {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::PATCH => "PATCH",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        _ => "other",
    };
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let span = tracing::info_span!(
        "http.request",
        otel.name = %format!("{method} {route}"),
        otel.kind = "server",
        http.request.method = method,
        http.route = %route,
        http.response.status_code = tracing::field::Empty,
        http.request_id = tracing::field::Empty,
    );
    if let Some(id) = request.headers().get(crate::REQUEST_ID).and_then(|v| v.to_str().ok()) {
        span.record("http.request_id", id);
    }
    let traceparent = request
        .headers()
        .get(lorry_batcher::trace::TRACEPARENT)
        .and_then(|v| v.to_str().ok());
    lorry_batcher::trace::follow(&span, traceparent);
    let response = next.run(request).instrument(span.clone()).await;
    span.record("http.response.status_code", response.status().as_u16());
    let status = response.status().as_u16().to_string();
    metrics.http_requests.with([method, &route, &status]).inc();
    metrics
        .http_duration
        .with([method, &route])
        .observe_duration(started.elapsed());
    response
}

/// The metrics of this API process (and of its worker, where it has one), in Prometheus's text format.
#[utoipa::path(get, path = "/metrics", tag = crate::openapi::SERVICE,
    responses(
        (status = 200, description = "Prometheus's text exposition format, version 0.0.4",
         content_type = "text/plain", body = String),
    ))]
pub async fn metrics(State(state): State<AppState>) -> Response {
    let metrics = &state.metrics;
    let mut text = Text::new();
    text.counters(
        "lorry_http_requests_total",
        "HTTP requests answered, by method, route and status.",
        &metrics.http_requests,
    );
    text.histograms(
        "lorry_http_request_duration_seconds",
        "How long HTTP requests took to answer (a stream: until its headers), by method and route.",
        &metrics.http_duration,
    );
    text.counters(
        "lorry_realtime_requests_total",
        "Real-time requests ended, by model and outcome (succeeded, errored, timed_out, cancelled).",
        &metrics.realtime_requests,
    );
    text.histograms(
        "lorry_realtime_time_to_first_token_seconds",
        "From a real-time request's publication to its first token.",
        &metrics.first_token,
    );
    text.histograms(
        "lorry_realtime_request_duration_seconds",
        "From a real-time request's publication to its last reply.",
        &metrics.realtime_duration,
    );
    let mut body = text.finish();
    body.push_str(&shared_figures(&state).await);
    if let Some(more) = &state.more_metrics {
        let mut text = Text::new();
        more(&mut text);
        body.push_str(&text.finish());
    }
    ([(header::CONTENT_TYPE, lorry_metrics::CONTENT_TYPE)], body).into_response()
}

/// The queues and batches, read from PostgreSQL and RabbitMQ at most once per
/// [`SHARED_FIGURES_TTL`]; a backing service that does not answer leaves its
/// families out (and says so in the log).
async fn shared_figures(state: &AppState) -> String {
    let mut cached = state.metrics.shared.lock().await;
    if let Some((at, text)) = cached.as_ref() {
        if at.elapsed() < SHARED_FIGURES_TTL {
            return text.clone();
        }
    }
    let within = Duration::from_secs(3);
    let (queues, batches, depths) = tokio::join!(
        tokio::time::timeout(within, state.store.queued_requests()),
        tokio::time::timeout(within, state.store.batches_by_status()),
        tokio::time::timeout(within, state.realtime.lane_depths()),
    );
    let mut text = Text::new();
    let models = state.catalog.names();
    let mut depth = text.gauge(
        "lorry_queue_depth",
        "Requests waiting to start, by lane and model (batch: queued in PostgreSQL; real time: in the broker).",
    );
    match &queues {
        Ok(Ok(queues)) => {
            for model in &models {
                let queued = queues.iter().find(|q| &q.model == model).map_or(0, |q| q.queued);
                depth.sample(&[("lane", "batch"), ("model", model)], queued as f64);
            }
        }
        Ok(Err(e)) => tracing::warn!(error = %e, "metrics: the batch queues could not be read"),
        Err(_) => tracing::warn!("metrics: the batch queues could not be read in time"),
    }
    match &depths {
        Ok(Ok(depths)) => {
            for (model, n) in depths {
                depth.sample(&[("lane", "real_time"), ("model", model)], f64::from(*n));
            }
        }
        Ok(Err(e)) => tracing::warn!(error = %e, "metrics: the real-time queues could not be read"),
        Err(_) => tracing::warn!("metrics: the real-time queues could not be read in time"),
    }
    let mut age = text.gauge(
        "lorry_queue_oldest_age_seconds",
        "How long the oldest waiting request has waited, by lane and model \
         (batch: since its batch was accepted; real time: since this API published it, until its first reply).",
    );
    if let Ok(Ok(queues)) = &queues {
        for model in &models {
            let oldest = queues
                .iter()
                .find(|q| &q.model == model)
                .map_or(0.0, |q| q.oldest_seconds);
            age.sample(&[("lane", "batch"), ("model", model)], oldest);
        }
    }
    for model in &models {
        let oldest = state
            .metrics
            .waiting
            .with([model])
            .oldest()
            .map_or(0.0, |d| d.as_secs_f64());
        age.sample(&[("lane", "real_time"), ("model", model)], oldest);
    }
    if let Ok(Ok(batches)) = &batches {
        let mut samples = text.gauge("lorry_batches", "Batches, by status.");
        for status in lorry_batcher::model::BatchStatus::ALL {
            let n = batches
                .iter()
                .find(|(s, _)| s == status.as_str())
                .map_or(0, |(_, n)| *n);
            samples.sample(&[("status", status.as_str())], n as f64);
        }
    } else {
        tracing::warn!("metrics: the batches could not be counted");
    }
    let text = text.finish();
    *cached = Some((Instant::now(), text.clone()));
    text
}
