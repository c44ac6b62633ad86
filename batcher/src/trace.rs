//! Trace context across processes, in W3C Trace Context's `traceparent`:
//! read from an HTTP request or a RabbitMQ message into a span, written from
//! a span into an outbox row or a message's headers. So one trace runs from
//! the HTTP request through the outbox and the broker to the worker and the
//! engine's steps.
//!
//! Only a process exporting traces (`LORRY_OTLP_ENDPOINT`) installs the
//! propagator; elsewhere these read and write nothing.

use std::collections::HashMap;

use lapin::types::{AMQPValue, ShortString};
use lapin::BasicProperties;
use opentelemetry::trace::TraceContextExt as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// The header (and message header) name.
pub const TRACEPARENT: &str = "traceparent";

/// The longest `traceparent` kept (version 00 is 55 bytes; later versions may add fields).
const MAX_LEN: usize = 256;

/// `span`'s trace context as a `traceparent` value, if it is part of a trace.
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    let context = span.context();
    if !context.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = HashMap::new();
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&context, &mut carrier));
    carrier.remove(TRACEPARENT)
}

/// Make `span` a child of the remote span `traceparent` names; a missing or
/// malformed value leaves it where it is.
pub fn follow(span: &tracing::Span, traceparent: Option<&str>) {
    let Some(value) = traceparent.filter(|v| v.len() <= MAX_LEN) else {
        return;
    };
    let carrier = HashMap::from([(TRACEPARENT.to_string(), value.to_string())]);
    let context = opentelemetry::global::get_text_map_propagator(|p| p.extract(&carrier));
    if context.span().span_context().is_valid() {
        let _ = span.set_parent(context);
    }
}

/// The `traceparent` a message carries in its headers.
pub fn from_message(properties: &BasicProperties) -> Option<String> {
    let headers = properties.headers().as_ref()?;
    match headers.inner().get(TRACEPARENT)? {
        AMQPValue::LongString(value) => Some(String::from_utf8_lossy(value.as_bytes()).into_owned()),
        AMQPValue::ShortString(value) => Some(value.as_str().to_string()),
        _ => None,
    }
}

/// `properties` with `traceparent` among their headers (unchanged without one).
pub fn with_traceparent(properties: BasicProperties, traceparent: Option<&str>) -> BasicProperties {
    let Some(value) = traceparent else {
        return properties;
    };
    let mut headers = properties.headers().clone().unwrap_or_default();
    headers.insert(ShortString::from(TRACEPARENT), AMQPValue::LongString(value.into()));
    properties.with_headers(headers)
}
