//! Per-account limits at the API: the real-time rate (a token bucket per
//! account, in this process) and the refusals of the limits the database
//! checks (queued batch requests, file bytes, adapters).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use lorry_batcher::ids::AccountId;
use lorry_batcher::quota::{Limits, OverQuota, Refusal};
use lorry_batcher::store::Account;
use lorry_protocol::ErrorCode;

use crate::{ApiError, AppState};

/// The limits that apply to `account`.
pub fn limits(state: &AppState, account: &Account) -> Limits {
    account.quotas.over(&state.config.quotas)
}

/// One bucket per account: `rate` tokens a second, holding one second's worth (at least one).
#[derive(Default)]
pub struct RealtimeRate {
    buckets: Mutex<HashMap<AccountId, Bucket>>,
}

struct Bucket {
    tokens: f64,
    at: Instant,
}

impl RealtimeRate {
    /// Take a token for `account` at `rate` a second (0: no limit), or the
    /// seconds until one will be there.
    pub fn take(&self, account: &AccountId, rate: f64, now: Instant) -> Result<(), f64> {
        if rate <= 0.0 || !rate.is_finite() {
            return Ok(());
        }
        let capacity = rate.max(1.0);
        let mut buckets = self.buckets.lock().expect("the rate buckets' lock is never poisoned");
        let bucket = buckets.entry(account.clone()).or_insert(Bucket {
            tokens: capacity,
            at: now,
        });
        let elapsed = now.saturating_duration_since(bucket.at).as_secs_f64();
        bucket.tokens = (bucket.tokens + elapsed * rate).min(capacity);
        bucket.at = now;
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            Ok(())
        } else {
            Err((1.0 - bucket.tokens) / rate)
        }
    }
}

/// A real-time request of `account`, if its rate allows: else `429 quota_realtime_rate`.
pub fn realtime(state: &AppState, account: &Account) -> Result<(), ApiError> {
    let rate = limits(state, account).realtime_per_second;
    state
        .realtime_rate
        .take(&account.id, rate, Instant::now())
        .map_err(|wait| {
            ApiError::new(
                ErrorCode::QuotaRealtimeRate,
                format!("the account's real-time requests are limited to {rate} a second"),
            )
            .retry_after(wait.ceil().max(1.0) as u64)
        })
}

/// The error for a write refused by the database's check of a limit.
pub fn refused(refusal: Refusal, code: ErrorCode, what: &str) -> ApiError {
    match refusal {
        Refusal::AccountDisabled => ApiError::new(ErrorCode::InvalidToken, "the account is disabled"),
        Refusal::OverQuota(OverQuota { used, limit }) => ApiError::new(
            code,
            format!("the account holds {used} {what} of its limit of {limit}; this would pass it"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_bucket_holds_one_seconds_worth_and_refills_at_the_rate() {
        let rate = RealtimeRate::default();
        let a = AccountId("a".into());
        let b = AccountId("b".into());
        let t0 = Instant::now();
        for _ in 0..4 {
            assert_eq!(rate.take(&a, 4.0, t0), Ok(()));
        }
        let wait = rate.take(&a, 4.0, t0).unwrap_err();
        assert!((wait - 0.25).abs() < 1e-9, "{wait}");
        assert_eq!(rate.take(&b, 4.0, t0), Ok(()), "accounts have their own buckets");
        assert_eq!(rate.take(&a, 4.0, t0 + Duration::from_millis(250)), Ok(()));
        assert!(rate.take(&a, 4.0, t0 + Duration::from_millis(250)).is_err());
        // Under one a second: a bucket of one.
        assert_eq!(rate.take(&b, 0.5, t0 + Duration::from_secs(10)), Ok(()));
        let wait = rate.take(&b, 0.5, t0 + Duration::from_secs(10)).unwrap_err();
        assert!((wait - 2.0).abs() < 1e-9, "{wait}");
        for _ in 0..100 {
            assert_eq!(rate.take(&a, 0.0, t0), Ok(()), "0 is no limit");
        }
    }
}
