//! Per-account limits: a deployment's defaults and an account's own.

use serde::{Deserialize, Serialize};

/// The limits that apply to an account; 0 is no limit.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Limits {
    /// Batch requests accepted and not yet ended (pending or running), across its batches.
    pub queued_requests: u64,
    /// Real-time requests a second (a token bucket holding one second's worth, at least one).
    pub realtime_per_second: f64,
    /// Bytes of files it holds (uploads and batch output files).
    pub file_bytes: u64,
    /// Adapters it holds.
    pub adapters: u64,
}

impl Limits {
    /// No limit at all.
    pub const NONE: Limits = Limits {
        queued_requests: 0,
        realtime_per_second: 0.0,
        file_bytes: 0,
        adapters: 0,
    };
}

/// An account's own limits; `None` takes the deployment's default, 0 is no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Quotas {
    /// Batch requests accepted and not yet ended.
    pub queued_requests: Option<u64>,
    /// Real-time requests a second.
    pub realtime_per_second: Option<f64>,
    /// Bytes of files held.
    pub file_bytes: Option<u64>,
    /// Adapters held.
    pub adapters: Option<u64>,
}

impl Quotas {
    /// The limits these make over the deployment's `defaults`.
    pub fn over(&self, defaults: &Limits) -> Limits {
        Limits {
            queued_requests: self.queued_requests.unwrap_or(defaults.queued_requests),
            realtime_per_second: self.realtime_per_second.unwrap_or(defaults.realtime_per_second),
            file_bytes: self.file_bytes.unwrap_or(defaults.file_bytes),
            adapters: self.adapters.unwrap_or(defaults.adapters),
        }
    }
}

/// A change to an account's quotas: per limit, `None` leaves it, `Some(None)`
/// returns it to the deployment's default, `Some(Some(n))` sets it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct QuotaChange {
    /// Batch requests accepted and not yet ended.
    pub queued_requests: Option<Option<u64>>,
    /// Real-time requests a second.
    pub realtime_per_second: Option<Option<f64>>,
    /// Bytes of files held.
    pub file_bytes: Option<Option<u64>>,
    /// Adapters held.
    pub adapters: Option<Option<u64>>,
}

/// Over a limit: what the account holds and the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverQuota {
    /// What it holds now, before the refused addition.
    pub used: u64,
    /// The limit.
    pub limit: u64,
}

/// Why a write for an account was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The account was disabled (or deleted) after its key was checked.
    AccountDisabled,
    /// The write would take the account over a limit.
    OverQuota(OverQuota),
}

/// Whether adding `adding` to `used` stays within `limit` (0: no limit).
pub fn within(used: u64, adding: u64, limit: u64) -> Result<(), OverQuota> {
    if limit == 0 || used.saturating_add(adding) <= limit {
        Ok(())
    } else {
        Err(OverQuota { used, limit })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_accounts_own_limits_win_and_zero_is_no_limit() {
        let defaults = Limits {
            queued_requests: 100,
            realtime_per_second: 5.0,
            file_bytes: 1000,
            adapters: 3,
        };
        let own = Quotas {
            queued_requests: Some(0),
            adapters: Some(10),
            ..Quotas::default()
        };
        let limits = own.over(&defaults);
        assert_eq!((limits.queued_requests, limits.adapters), (0, 10));
        assert_eq!((limits.realtime_per_second, limits.file_bytes), (5.0, 1000));
        assert_eq!(within(99, 1, 100), Ok(()));
        assert_eq!(within(99, 2, 100), Err(OverQuota { used: 99, limit: 100 }));
        assert_eq!(within(u64::MAX, 1, 0), Ok(()));
        assert_eq!(
            within(u64::MAX, 1, 5),
            Err(OverQuota {
                used: u64::MAX,
                limit: 5
            })
        );
    }
}
