//! Completion webhooks, signed per Standard Webhooks and retried with
//! exponential backoff and jitter. A delivery keeps its `webhook-id` across
//! retries; each attempt is recorded. Deliveries live in Postgres, so a
//! restart loses none; senders lease due deliveries so several can run.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio_util::sync::CancellationToken;
use url::{Host, Url};

use crate::metrics::WorkerMetrics;
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
    /// Not an absolute http(s) URL with a host and no credentials.
    #[error("webhook.url must be an absolute http or https URL")]
    Invalid,
    /// It names a destination that is not on the public internet.
    #[error("webhook.url must name a public host: not loopback, private, reserved or multicast addresses, single-label names or names ending in a dot")]
    Private,
}

/// Check a webhook target at submission (and again before each attempt).
///
/// Only globally routable unicast destinations pass unless `allow_private`:
/// an address literal is checked here, a name must have at least two labels
/// and no trailing dot (`LOCALHOST.` and `metadata` resolve through search
/// domains and `/etc/hosts` to anything), and the addresses a name resolves
/// to are checked when the sender connects ([`PublicOnly`]), not by a second
/// lookup that DNS could answer differently.
pub fn check_url(raw: &str, allow_private: bool) -> Result<Url, UrlProblem> {
    let url = Url::parse(raw).map_err(|_| UrlProblem::Invalid)?;
    if !matches!(url.scheme(), "http" | "https") || url.username() != "" || url.password().is_some() {
        return Err(UrlProblem::Invalid);
    }
    let public = match url.host() {
        None => return Err(UrlProblem::Invalid),
        Some(Host::Domain(name)) => {
            let lower = name.to_ascii_lowercase();
            let labels: Vec<&str> = lower.split('.').collect();
            labels.len() >= 2
                && labels.iter().all(|l| !l.is_empty())
                && !matches!(
                    *labels.last().unwrap_or(&""),
                    "localhost" | "local" | "internal" | "arpa"
                )
        }
        Some(Host::Ipv4(ip)) => is_public(IpAddr::V4(ip)),
        Some(Host::Ipv6(ip)) => is_public(IpAddr::V6(ip)),
    };
    if !public && !allow_private {
        return Err(UrlProblem::Private);
    }
    Ok(url)
}

/// Whether `ip` is a globally routable unicast address (IANA's special-purpose
/// registries: everything they mark not globally reachable, multicast and
/// the deprecated IPv6 forms that embed an IPv4 address, refused).
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_public_v4(v4),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public_v4(v4);
            }
            let s = v6.segments();
            if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
                // NAT64 (RFC 6052): as public as the IPv4 address it carries.
                let [a, b] = s[6].to_be_bytes();
                let [c, d] = s[7].to_be_bytes();
                return is_public_v4(Ipv4Addr::new(a, b, c, d));
            }
            let global_unicast = (s[0] & 0xe000) == 0x2000; // 2000::/3
            global_unicast
                && !(s[0] == 0x2001 && s[1] < 0x200) // 2001::/23: Teredo, benchmarking, ORCHID, …
                && !(s[0] == 0x2001 && s[1] == 0xdb8) // documentation
                && s[0] != 0x2002 // 6to4
                && !(s[0] == 0x3fff && s[1] < 0x1000) // documentation (RFC 9637)
        }
    }
}

fn is_public_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    !(a == 0
        || a == 10
        || a == 127
        || a >= 224 // multicast, reserved, broadcast
        || (a == 100 && (64..128).contains(&b)) // shared address space
        || (a == 169 && b == 254)
        || (a == 172 && (16..32).contains(&b))
        || (a == 192 && b == 0 && c == 0) // IETF protocol assignments
        || (a == 192 && b == 0 && c == 2) // documentation
        || (a == 192 && b == 88 && c == 99) // 6to4 relay
        || (a == 192 && b == 168)
        || (a == 198 && (18..20).contains(&b)) // benchmarking
        || (a == 198 && b == 51 && c == 100) // documentation
        || (a == 203 && b == 0 && c == 113)) // documentation
}

/// The webhook client's resolver: a name resolving to any address that is
/// not public is refused at connect time, so what was checked is what is
/// connected to (no second lookup for DNS to answer differently).
#[derive(Debug, Clone, Copy)]
pub struct PublicOnly;

/// A name that resolved to an address webhooks may not reach.
#[derive(Debug, thiserror::Error)]
#[error("{0} resolves to an address that is not public")]
pub struct NotPublic(String);

impl reqwest::dns::Resolve for PublicOnly {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        Box::pin(async move {
            let host = name.as_str().to_string();
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            if addrs.iter().any(|a| !is_public(a.ip())) {
                return Err(Box::new(NotPublic(host)) as Box<dyn std::error::Error + Send + Sync>);
            }
            Ok(Box::new(addrs.into_iter()) as reqwest::dns::Addrs)
        })
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

/// The webhook HTTP client: no redirects (a redirect could lead anywhere),
/// no proxy from the environment (it would be resolved instead of the
/// target), and, unless private targets are allowed, [`PublicOnly`] resolution.
pub fn client(config: &WebhookConfig) -> reqwest::Client {
    let builder = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .timeout(config.timeout)
        .user_agent(concat!("lorry/", env!("CARGO_PKG_VERSION")));
    let builder = if config.allow_private {
        builder
    } else {
        builder.dns_resolver(Arc::new(PublicOnly))
    };
    builder.build().expect("building the webhook HTTP client")
}

/// What one attempt's answer (or failure) means: delivered; refused for
/// good (the target is not public); or worth retrying (a status other than
/// 2xx, a DNS failure, a refused or reset connection, a timeout).
fn outcome(sent: Result<reqwest::Response, reqwest::Error>) -> Attempt {
    match sent {
        Ok(response) if response.status().is_success() => Attempt::Delivered(response.status().as_u16()),
        Ok(response) => Attempt::Failed {
            status: Some(response.status().as_u16()),
            error: format!("receiver answered {}", response.status()),
            permanent: false,
        },
        Err(e) => {
            let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
            let mut refused = None;
            while let Some(cause) = source {
                if let Some(not_public) = cause.downcast_ref::<NotPublic>() {
                    refused = Some(not_public.to_string());
                }
                source = cause.source();
            }
            match refused {
                Some(error) => Attempt::Failed {
                    status: None,
                    error,
                    permanent: true,
                },
                None => Attempt::Failed {
                    status: None,
                    error: error_chain(&e),
                    permanent: false,
                },
            }
        }
    }
}

/// An error and its causes, on one line.
fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text = format!("{text}: {cause}");
        source = cause.source();
    }
    text
}

/// Sends due webhook deliveries; cheap to clone.
#[derive(Clone, Debug)]
pub struct WebhookSender {
    store: Store,
    http: reqwest::Client,
    config: WebhookConfig,
    metrics: Arc<WorkerMetrics>,
}

#[derive(Debug)]
enum Attempt {
    Delivered(u16),
    Failed {
        status: Option<u16>,
        error: String,
        permanent: bool,
    },
}

impl WebhookSender {
    /// A sender with its own HTTP client.
    pub fn new(store: Store, config: WebhookConfig) -> Self {
        let http = client(&config);
        WebhookSender {
            store,
            http,
            config,
            metrics: Arc::default(),
        }
    }

    /// The same sender, counting its attempts into `metrics`.
    pub fn counting_into(self, metrics: Arc<WorkerMetrics>) -> Self {
        WebhookSender { metrics, ..self }
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
                    self.metrics.webhook_attempts.with(["delivered"]).inc();
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
                    let outcome = if retry.is_some() { "retrying" } else { "failed" };
                    self.metrics.webhook_attempts.with([outcome]).inc();
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
        if let Err(problem) = check_url(&delivery.url, self.config.allow_private) {
            return Attempt::Failed {
                status: None,
                error: problem.to_string(),
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
        outcome(sent)
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
    fn only_public_targets_pass_unless_private_ones_are_allowed() {
        for url in [
            "http://127.0.0.1:9/x",
            "http://localhost/x",
            "http://LOCALHOST./x",
            "http://example.com./hook",
            "http://metadata/computeMetadata",
            "http://svc.internal/x",
            "http://printer.local/x",
            "http://[::1]/x",
            "http://[::127.0.0.1]/x",
            "http://[::ffff:10.0.0.1]/x",
            "http://[64:ff9b::10.0.0.1]/x",
            "http://[64:ff9b::7f00:1]/x",
            "http://[fd00::1]/x",
            "http://[fe80::1]/x",
            "http://[ff02::1]/x",
            "http://[2001:db8::1]/x",
            "http://[2002:7f00:1::]/x",
            "http://[2001::1]/x",
            "http://10.1.2.3/x",
            "http://100.64.0.1/x",
            "http://169.254.169.254/latest/meta-data",
            "http://172.16.0.1/x",
            "http://192.168.1.1/x",
            "http://198.18.0.1/x",
            "http://198.19.255.255/x",
            "http://224.0.0.1/x",
            "http://239.255.255.250/x",
            "http://255.255.255.255/x",
            "http://0.0.0.0/x",
            "http://2130706433/x",
            "http://0x7f.1/x",
        ] {
            assert_eq!(check_url(url, false), Err(UrlProblem::Private), "{url}");
            assert!(check_url(url, true).is_ok(), "{url} with private targets allowed");
        }
        for url in [
            "https://example.com/hook",
            "http://hooks.example.co.uk:8443/x",
            "http://93.184.215.14/x",
            "http://[2606:4700::1111]/x",
            "http://[64:ff9b::8.8.8.8]/x",
            "http://198.20.0.1/x",
        ] {
            assert!(check_url(url, false).is_ok(), "{url}");
        }
        assert_eq!(check_url("ftp://example.com", true), Err(UrlProblem::Invalid));
        assert_eq!(check_url("not a url", true), Err(UrlProblem::Invalid));
        assert_eq!(check_url("http://user:pw@example.com/", true), Err(UrlProblem::Invalid));
    }

    fn config(allow_private: bool) -> WebhookConfig {
        WebhookConfig {
            min_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_secs(1),
            max_attempts: 3,
            timeout: Duration::from_secs(5),
            allow_private,
        }
    }

    #[tokio::test]
    async fn a_name_resolving_to_a_private_address_is_refused_when_connecting_for_good() {
        // `localhost` passes no check_url, but the resolver is the last word
        // whatever the name: its addresses are loopback.
        let http = client(&config(false));
        let attempt = outcome(http.post("http://localhost:9/hook").send().await);
        assert!(
            matches!(&attempt, Attempt::Failed { permanent: true, error, .. } if error.contains("not public")),
            "{attempt:?}"
        );
    }

    #[tokio::test]
    async fn a_dns_failure_or_a_refused_connection_is_retried() {
        let http = client(&config(false));
        let attempt = outcome(http.post("http://no-such-host.invalid/hook").send().await);
        assert!(
            matches!(attempt, Attempt::Failed { permanent: false, .. }),
            "{attempt:?}"
        );
        // Nothing listens on the port: transient too.
        let port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port()
        };
        let http = client(&config(true));
        let attempt = outcome(http.post(format!("http://127.0.0.1:{port}/hook")).send().await);
        assert!(
            matches!(attempt, Attempt::Failed { permanent: false, .. }),
            "{attempt:?}"
        );
    }

    #[tokio::test]
    async fn an_ipv6_literal_target_is_delivered() {
        let Ok(listener) = tokio::net::TcpListener::bind("[::1]:0").await else {
            eprintln!("no IPv6 loopback on this machine: nothing to check");
            return;
        };
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = Vec::new();
            let mut buf = [0u8; 1024];
            while !String::from_utf8_lossy(&request).contains("\r\n\r\n{}") {
                let n = socket.read(&mut buf).await.unwrap();
                assert!(n > 0, "the request ended early");
                request.extend_from_slice(&buf[..n]);
            }
            socket
                .write_all(b"HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n")
                .await
                .unwrap();
        });
        let url = format!("http://[::1]:{port}/hook");
        assert!(check_url(&url, true).is_ok());
        let http = client(&config(true));
        let attempt = outcome(http.post(&url).body("{}").send().await);
        assert!(matches!(attempt, Attempt::Delivered(204)), "{attempt:?}");
        server.await.unwrap();
    }
}
