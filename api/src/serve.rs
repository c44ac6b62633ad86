//! The listener: HTTP/1.1 connections, each bounded in number and in time.
//!
//! A client that holds a connection open without finishing its request
//! costs a file descriptor and a task; without bounds, enough of them
//! exhaust the process (`accept: Too many open files`) and every other
//! client, `/healthz` included, waits. So:
//!
//! - at most [`ServeLimits::max_connections`] connections are served at
//!   once, below the process's descriptor limit with room for Postgres,
//!   RabbitMQ, S3 and the model files; a connection over the cap is answered
//!   `503 service_unavailable` with `Retry-After` and closed (load shed, not
//!   left hanging), by a bounded number of shedding tasks;
//! - a request's head must arrive within [`ServeLimits::header_timeout`]
//!   (hyper's `header_read_timeout`; it also closes a kept-alive connection
//!   that sends nothing), and its body keeps a minimum pace
//!   ([`crate::guard`]).
//!
//! Only HTTP/1.1 is served: what every SDK speaks over plain TCP, and the
//! protocol whose slow clients these bounds are written for.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// How many connections, and for how long each may dawdle.
#[derive(Debug, Clone, Copy)]
pub struct ServeLimits {
    /// Connections served at once; more are answered 503 and closed.
    pub max_connections: usize,
    /// Time for a request's head (and for a kept-alive connection's next one).
    pub header_timeout: Duration,
    /// How long a draining shutdown waits for requests in flight.
    pub drain_timeout: Duration,
}

/// Connections being answered 503 at once; past this, they are closed unanswered.
const MAX_SHEDDING: usize = 256;

/// How long a shed connection is given to read its answer and close: a
/// client that sent its request reads the 503 at once; one that holds the
/// connection without reading frees its shedding slot after this.
const SHED_LINGER: Duration = Duration::from_millis(250);

/// What an over-the-cap connection is told: the API's own 503, written raw.
fn shed_response() -> Arc<[u8]> {
    let error = crate::ApiError::new(
        lorry_protocol::ErrorCode::ServiceUnavailable,
        "the server is at its connection limit; retry shortly",
    );
    let body = error.body().to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    [head.as_bytes(), body.as_bytes()].concat().into()
}

/// Serve `router` on `listener` until `stop` resolves, then drain.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ServeLimits,
    stop: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let shedding = Arc::new(Semaphore::new(MAX_SHEDDING));
    let answer = shed_response();
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
    tokio::pin!(stop);
    loop {
        let (stream, _peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of descriptors, or a connection reset before it was taken:
                    // pause rather than spin; the connections in flight free some.
                    tracing::warn!(%error, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            shed(stream, &shedding, &answer);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let connection = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, "connection ended with an error");
            }
            drop(permit);
        });
    }
    drop(listener);
    if tokio::time::timeout(limits.drain_timeout, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("requests still in flight at the end of the drain were dropped");
    }
    Ok(())
}

/// Answer an over-the-cap connection 503 and close it; the request it sent
/// is read and dropped first (closing on unread bytes would reset the
/// connection and lose the answer).
fn shed(mut stream: TcpStream, shedding: &Arc<Semaphore>, answer: &Arc<[u8]>) {
    let Ok(permit) = shedding.clone().try_acquire_owned() else {
        return;
    };
    tracing::debug!("connection over the cap shed");
    let answer = answer.clone();
    tokio::spawn(async move {
        let answer = async {
            stream.write_all(&answer).await?;
            stream.shutdown().await?;
            let mut sink = [0u8; 4096];
            while stream.read(&mut sink).await? > 0 {}
            std::io::Result::Ok(())
        };
        let _ = tokio::time::timeout(SHED_LINGER, answer).await;
        drop(permit);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shed_answer_is_well_formed_json_of_the_stated_length() {
        let answer = shed_response();
        let text = std::str::from_utf8(&answer).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(body.len(), length);
        let value: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(value["error"]["code"], "service_unavailable");
    }
}
