//! Completion webhooks, signed per Standard Webhooks and retried with
//! exponential backoff and jitter. A delivery keeps its `webhook-id` across
//! retries; each attempt is recorded. Deliveries live in Postgres, so a
//! restart loses none; senders lease due deliveries so several can run.

use std::net::IpAddr;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio_util::sync::CancellationToken;
use url::{Host, Url};

use crate::store::{DueDelivery, Store};
use crate::BatcherError;

/// How webhooks are sent.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    /// Delay before the first retry.
    pub min_backoff: Duration,
    /// Longest delay between retries.
    pub max_backoff: Duration,
    /// Attempts before a delivery is given up.
    pub max_attempts: u32,
    /// Per-attempt timeout.
    pub timeout: Duration,
    /// Allow targets on loopback and private networks.
    pub allow_private: bool,
}

/// Why a webhook URL was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlProblem {
    /// Not an absolute http(s) URL.
    #[error("webhook.url must be an absolute http or https URL")]
    Invalid,
    /// It points at a loopback, private or link-local address.
    #[error("webhook.url points at a private or loopback address")]
    Private,
}

/// Check a webhook target at submission.
pub fn check_url(raw: &str, allow_private: bool) -> Result<Url, UrlProblem> {
    let url = Url::parse(raw).map_err(|_| UrlProblem::Invalid)?;
    if !matches!(url.scheme(), "http" | "https") || url.username() != "" || url.password().is_some() {
        return Err(UrlProblem::Invalid);
    }
    let private = match url.host() {
        None => return Err(UrlProblem::Invalid),
        Some(Host::Domain(d)) => d.eq_ignore_ascii_case("localhost") || d.ends_with(".localhost"),
        Some(Host::Ipv4(ip)) => is_private(IpAddr::V4(ip)),
        Some(Host::Ipv6(ip)) => is_private(IpAddr::V6(ip)),
    };
    if private && !allow_private {
        return Err(UrlProblem::Private);
    }
    Ok(url)
}

fn is_private(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.octets()[0] == 100 && (64..128).contains(&v4.octets()[1])
        }
        IpAddr::V6(v6) => {
            let first = v6.segments()[0];
            v6.is_loopback()
                || v6.is_unspecified()
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80
                || v6.to_ipv4_mapped().is_some_and(|v4| is_private(IpAddr::V4(v4)))
        }
    }
}

/// The Standard Webhooks signature header value: `v1,<base64 HMAC-SHA256>` over
/// `"{id}.{timestamp}.{body}"`, keyed with the base64 part of `whsec_…`.
pub fn sign(secret: &str, id: &str, timestamp: i64, body: &[u8]) -> Result<String, base64::DecodeError> {
    let key = BASE64.decode(secret.strip_prefix("whsec_").unwrap_or(secret))?;
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).expect("HMAC takes keys of any length");
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(body);
    Ok(format!("v1,{}", BASE64.encode(mac.finalize().into_bytes())))
}

/// Sends due webhook deliveries; cheap to clone.
#[derive(Clone, Debug)]
pub struct WebhookSender {
    store: Store,
    http: reqwest::Client,
    config: WebhookConfig,
}

enum Attempt {
    Delivered(u16),
    Failed {
        status: Option<u16>,
        error: String,
        permanent: bool,
    },
}

impl WebhookSender {
    /// A sender with its own HTTP client (no redirects: a redirect could lead anywhere).
    pub fn new(store: Store, config: WebhookConfig) -> Self {
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(config.timeout)
            .user_agent(concat!("lorry/", env!("CARGO_PKG_VERSION")))
            .build()
            .expect("building the webhook HTTP client");
        WebhookSender { store, http, config }
    }

    /// The delay before retry number `attempt` (1-based), or `None` once attempts are spent.
    pub fn retry_delay(&self, attempt: u32) -> Option<Duration> {
        if attempt >= self.config.max_attempts {
            return None;
        }
        ExponentialBuilder::default()
            .with_min_delay(self.config.min_backoff)
            .with_max_delay(self.config.max_backoff)
            .with_factor(2.0)
            .with_jitter()
            .with_max_times(self.config.max_attempts as usize)
            .build()
            .nth(attempt.saturating_sub(1) as usize)
    }

    /// Attempt every due delivery once; returns how many were attempted.
    pub async fn send_due(&self) -> Result<usize, BatcherError> {
        let lease = self.config.timeout + Duration::from_secs(5);
        let due = self.store.lease_deliveries(32, lease).await?;
        let attempts = due.iter().map(|d| self.attempt(d));
        let results = futures::future::join_all(attempts).await;
        for (delivery, result) in due.iter().zip(results) {
            let made = delivery.attempts as u32 + 1;
            match result {
                Attempt::Delivered(code) => {
                    self.store
                        .record_attempt(delivery, Some(code), None, true, None)
                        .await?
                }
                Attempt::Failed {
                    status,
                    error,
                    permanent,
                } => {
                    let retry = if permanent { None } else { self.retry_delay(made) };
                    let retry_at = retry.map(|d| chrono::Utc::now() + d);
                    tracing::info!(id = %delivery.id, attempt = made, error, "webhook attempt failed");
                    self.store
                        .record_attempt(delivery, status, Some(&error), false, retry_at)
                        .await?;
                }
            }
        }
        Ok(due.len())
    }

    async fn attempt(&self, delivery: &DueDelivery) -> Attempt {
        if let Err(problem) = self.resolve_allowed(&delivery.url).await {
            return Attempt::Failed {
                status: None,
                error: problem,
                permanent: true,
            };
        }
        let body = match serde_json::to_vec(&delivery.payload) {
            Ok(body) => body,
            Err(e) => {
                return Attempt::Failed {
                    status: None,
                    error: e.to_string(),
                    permanent: true,
                }
            }
        };
        let timestamp = chrono::Utc::now().timestamp();
        let signature = match sign(&delivery.secret, delivery.id.as_str(), timestamp, &body) {
            Ok(s) => s,
            Err(e) => {
                return Attempt::Failed {
                    status: None,
                    error: e.to_string(),
                    permanent: true,
                }
            }
        };
        let sent = self
            .http
            .post(&delivery.url)
            .header("content-type", "application/json")
            .header("webhook-id", delivery.id.as_str())
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", signature)
            .body(body)
            .send()
            .await;
        match sent {
            Ok(response) if response.status().is_success() => Attempt::Delivered(response.status().as_u16()),
            Ok(response) => Attempt::Failed {
                status: Some(response.status().as_u16()),
                error: format!("receiver answered {}", response.status()),
                permanent: false,
            },
            Err(e) => Attempt::Failed {
                status: None,
                error: e.to_string(),
                permanent: false,
            },
        }
    }

    /// Refuse, at send time too, a host that resolves to a private address.
    async fn resolve_allowed(&self, raw: &str) -> Result<(), String> {
        let url = check_url(raw, self.config.allow_private).map_err(|e| e.to_string())?;
        if self.config.allow_private {
            return Ok(());
        }
        let host = url.host_str().unwrap_or_default();
        let port = url.port_or_known_default().unwrap_or(443);
        let addrs = tokio::net::lookup_host((host, port)).await.map_err(|e| e.to_string())?;
        for addr in addrs {
            if is_private(addr.ip()) {
                return Err(format!("{host} resolves to a private address"));
            }
        }
        Ok(())
    }

    /// Send due deliveries every `interval` until `stop`.
    pub async fn run(&self, interval: Duration, stop: CancellationToken) {
        loop {
            let sent = match self.send_due().await {
                Ok(n) => n,
                Err(e) => {
                    tracing::warn!(error = %e, "webhook sender failed");
                    0
                }
            };
            if sent == 0 {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(interval) => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_verify_with_the_standard_webhooks_crate() {
        let secret = crate::store::new_webhook_secret();
        let body = br#"{"type":"batch.completed"}"#;
        let ts = chrono::Utc::now().timestamp();
        let signature = sign(&secret, "msg_1", ts, body).unwrap();
        let verifier = standardwebhooks::Webhook::new(&secret).unwrap();
        let mut headers = http::HeaderMap::new();
        headers.insert("webhook-id", "msg_1".parse().unwrap());
        headers.insert("webhook-timestamp", ts.to_string().parse().unwrap());
        headers.insert("webhook-signature", signature.parse().unwrap());
        verifier.verify(body, &headers).unwrap();
    }

    #[test]
    fn private_targets_are_refused_unless_allowed() {
        assert_eq!(check_url("http://127.0.0.1:9/x", false), Err(UrlProblem::Private));
        assert_eq!(check_url("http://localhost/x", false), Err(UrlProblem::Private));
        assert_eq!(check_url("http://[::1]/x", false), Err(UrlProblem::Private));
        assert_eq!(check_url("http://10.1.2.3/x", false), Err(UrlProblem::Private));
        assert!(check_url("http://127.0.0.1:9/x", true).is_ok());
        assert!(check_url("https://example.com/hook", false).is_ok());
        assert_eq!(check_url("ftp://example.com", true), Err(UrlProblem::Invalid));
        assert_eq!(check_url("not a url", true), Err(UrlProblem::Invalid));
    }
}
