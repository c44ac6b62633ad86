//! Logs and traces.
//!
//! Logs go to stderr, filtered by `LORRY_LOG` (`tracing`'s syntax; `info`
//! by default), as text or, with `LORRY_LOG_FORMAT=json`, one JSON object a
//! line. With `LORRY_OTLP_ENDPOINT` set (an OTLP/HTTP collector's base URL,
//! such as `http://localhost:4318`), spans are also exported as OpenTelemetry
//! traces (protobuf, to `{endpoint}/v1/traces`, in batches from a thread of
//! their own), and W3C `traceparent` is read from HTTP requests and written
//! into outbox rows and RabbitMQ messages: one trace runs from a client's
//! request through the outbox, the broker and the worker to each engine step
//! its sequence took part in. The SDK's `OTEL_BSP_*` variables tune the
//! batching.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer};

/// The target of events that go to traces only (each engine step of a
/// traced sequence), never to the log.
const TRACE_ONLY: &str = "lorry::trace";

/// Keep until the process ends: dropping it sends the spans not yet sent.
#[must_use = "dropping the guard stops exporting traces"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether spans are exported.
    pub fn exports_traces(&self) -> bool {
        self.provider.is_some()
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            if let Err(error) = provider.shutdown() {
                eprintln!("lorry: the last traces could not be sent: {error}");
            }
        }
    }
}

/// Install the log (and, with `LORRY_OTLP_ENDPOINT`, the trace) subscriber
/// for a process that names itself `service` in its traces.
pub fn init(service: &str) -> Telemetry {
    let directives = std::env::var("LORRY_LOG").unwrap_or_else(|_| "info".into());
    let filter = |extra: &str| {
        EnvFilter::try_new(format!("{directives},{extra}")).unwrap_or_else(|error| {
            eprintln!("lorry: LORRY_LOG is not a filter ({error}); logging at info");
            EnvFilter::new(format!("info,{extra}"))
        })
    };
    let json = std::env::var("LORRY_LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("json"));
    let logs: Box<dyn Layer<_> + Send + Sync> = if json {
        Box::new(
            tracing_subscriber::fmt::layer()
                .json()
                .with_current_span(true)
                .with_writer(std::io::stderr),
        )
    } else {
        Box::new(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
    };
    let logs = logs.with_filter(filter(&format!("{TRACE_ONLY}=off")));
    let endpoint = std::env::var("LORRY_OTLP_ENDPOINT")
        .ok()
        .filter(|e| !e.trim().is_empty());
    let provider = endpoint.and_then(|endpoint| match tracer_provider(&endpoint, service) {
        Ok(provider) => Some(provider),
        Err(error) => {
            eprintln!("lorry: not exporting traces to {endpoint}: {error}");
            None
        }
    });
    let traces = provider.as_ref().map(|provider| {
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("lorry"))
            .with_filter(filter(&format!("{TRACE_ONLY}=info")))
    });
    tracing_subscriber::registry().with(logs).with(traces).init();
    Telemetry { provider }
}

fn tracer_provider(endpoint: &str, service: &str) -> anyhow::Result<SdkTracerProvider> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(format!("{}/v1/traces", endpoint.trim_end_matches('/')))
        .build()?;
    let resource = Resource::builder().with_service_name(service.to_string()).build();
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build())
}
