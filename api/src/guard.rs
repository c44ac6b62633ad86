//! Checks every request passes before any handler sees it: a URI Lorry can
//! store and name in errors, and a body that keeps arriving.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body::{Body as HttpBody, Frame, SizeHint};
use lorry_protocol::ErrorCode;
use tokio::time::{Instant, Sleep};

use crate::ApiError;

/// The slowest a request body may arrive: within `grace` of the request,
/// plus a second for every `min_bytes_per_sec` bytes it has brought so far.
#[derive(Debug, Clone, Copy)]
pub struct BodyPace {
    /// Time allowed before the pace counts.
    pub grace: Duration,
    /// The rate a body must keep after that, on average, in bytes a second.
    pub min_bytes_per_sec: u64,
}

/// The longest path and query string the API reads, in bytes. Longer ones
/// are answered `414 uri_too_long` here; from 64 KiB the HTTP parser answers
/// 414 itself, before any of Lorry's code sees the request, without a body.
pub const MAX_URI_BYTES: usize = 8 << 10;

/// Refuse a path and query string over [`MAX_URI_BYTES`], or holding U+0000
/// or bytes that are not UTF-8 once percent-decoded, in the API's JSON error shape.
pub async fn uri(request: Request, next: Next) -> Response {
    let uri = request.uri();
    let (path, query) = (uri.path().len(), uri.query().map_or(0, |q| q.len() + 1));
    if path + query > MAX_URI_BYTES {
        let part = if path > MAX_URI_BYTES { "path" } else { "query" };
        let message = format!("the path and query string are over {MAX_URI_BYTES} bytes");
        return ApiError::invalid(ErrorCode::UriTooLong, part, message).into_response();
    }
    for (part, text) in [("path", Some(uri.path())), ("query", uri.query())] {
        let Some(text) = text else { continue };
        let decoded = percent_decode(text);
        let problem = match std::str::from_utf8(&decoded) {
            Err(_) => Some((ErrorCode::InvalidValue, format!("the {part} is not UTF-8 once decoded"))),
            Ok(s) if s.contains('\0') => Some((ErrorCode::NulCharacter, format!("the {part} holds U+0000"))),
            Ok(_) => None,
        };
        if let Some((code, message)) = problem {
            return ApiError::invalid(code, part, message).into_response();
        }
    }
    next.run(request).await
}

/// Wrap the request body so that it fails with [`BodyTimedOut`] once it
/// falls behind `pace`.
pub async fn body_pace(State(pace): State<BodyPace>, request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let body = Body::new(PacedBody::new(body, pace));
    let response = next.run(Request::from_parts(parts, body)).await;
    close_after_timeout(response)
}

/// A body timed out: the client is still sending (slowly), so the answer
/// closes the connection rather than wait for the rest.
fn close_after_timeout(mut response: Response) -> Response {
    if response.status() == axum::http::StatusCode::REQUEST_TIMEOUT {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// A request body that fell behind its pace.
#[derive(Debug, thiserror::Error)]
#[error("the request body arrived too slowly")]
pub struct BodyTimedOut;

/// Whether `error` (or what caused it) is a body that fell behind its pace.
pub fn timed_out(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut current = Some(error);
    while let Some(e) = current {
        if e.is::<BodyTimedOut>() {
            return true;
        }
        current = e.source();
    }
    false
}

/// The API error for a body that could not be read for `error`.
pub fn unreadable(error: &(dyn std::error::Error + 'static), message: String) -> ApiError {
    if timed_out(error) {
        ApiError::new(ErrorCode::BodyTimeout, "the request body arrived too slowly")
    } else {
        ApiError::new(ErrorCode::UnreadableBody, message)
    }
}

struct PacedBody {
    inner: Body,
    pace: BodyPace,
    started: Instant,
    received: u64,
    deadline: Pin<Box<Sleep>>,
}

impl PacedBody {
    fn new(inner: Body, pace: BodyPace) -> Self {
        let started = Instant::now();
        PacedBody {
            inner,
            pace,
            started,
            received: 0,
            deadline: Box::pin(tokio::time::sleep_until(started + pace.grace)),
        }
    }

    fn extend(&mut self, bytes: usize) {
        self.received += bytes as u64;
        let earned = Duration::from_secs_f64(self.received as f64 / self.pace.min_bytes_per_sec.max(1) as f64);
        self.deadline.as_mut().reset(self.started + self.pace.grace + earned);
    }
}

impl HttpBody for PacedBody {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.extend(data.len());
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(other) => Poll::Ready(other.map(|r| r.map_err(Into::into))),
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(BodyTimedOut)))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// `%XX` sequences decoded; anything else kept as it is.
fn percent_decode(text: &str) -> Vec<u8> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(hi), Some(lo)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push((hi * 16 + lo) as u8);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_decoding_keeps_what_is_not_an_escape() {
        assert_eq!(percent_decode("a%00b"), b"a\0b");
        assert_eq!(percent_decode("%e2%82%AC"), "€".as_bytes());
        assert_eq!(percent_decode("100%"), b"100%");
        assert_eq!(percent_decode("%zz%4"), b"%zz%4");
        assert_eq!(percent_decode("%ff"), [0xff]);
    }
}
