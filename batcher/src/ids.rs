//! Identifiers, made once and trusted everywhere after.

use std::fmt;

use serde::{Deserialize, Serialize};

macro_rules! prefixed_id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            /// A fresh, time-ordered id.
            pub fn generate() -> Self {
                $name(format!(concat!($prefix, "{}"), uuid::Uuid::now_v7().simple()))
            }

            /// Accept an id from outside if it has the right shape.
            pub fn parse(raw: &str) -> Option<Self> {
                let rest = raw.strip_prefix($prefix)?;
                (rest.len() == 32 && rest.bytes().all(|b| b.is_ascii_hexdigit())).then(|| $name(raw.to_string()))
            }

            /// The id as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

prefixed_id!(
    /// A batch: `batch_<uuid v7>`.
    BatchId,
    "batch_"
);
prefixed_id!(
    /// A webhook delivery, sent as `webhook-id`: `msg_<uuid v7>`.
    DeliveryId,
    "msg_"
);

prefixed_id!(
    /// A LoRA adapter (a Workers AI finetune): `lora_<uuid v7>`.
    AdapterId,
    "lora_"
);

prefixed_id!(
    /// A file of the OpenAI files API: `file-<uuid v7>`.
    FileId,
    "file-"
);

prefixed_id!(
    /// An API key's record (not the key itself): `key_<uuid v7>`.
    KeyId,
    "key_"
);

/// An account id: the name an operator gave it (`lorry accounts create NAME`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct AccountId(pub String);

impl AccountId {
    /// The longest account name.
    pub const MAX_LEN: usize = 64;

    /// A new account's name, if it has the allowed shape: 1 to 64 of
    /// `a-z`, `0-9`, `-` and `_`, starting with a letter or a digit (it is a
    /// path segment of the Workers AI routes and of S3 keys).
    pub fn parse_name(raw: &str) -> Option<Self> {
        let first = raw.bytes().next()?;
        let allowed = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_';
        (raw.len() <= Self::MAX_LEN && first.is_ascii_alphanumeric() && raw.bytes().all(allowed))
            .then(|| AccountId(raw.to_string()))
    }
}

impl fmt::Display for AccountId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_foreign_shapes_are_refused() {
        let id = BatchId::generate();
        assert_eq!(BatchId::parse(id.as_str()), Some(id.clone()));
        assert!(BatchId::parse("batch_123").is_none());
        assert!(BatchId::parse(&id.as_str().replace("batch_", "msg_")).is_none());
        assert!(BatchId::generate() > id, "ids are time-ordered");
    }

    #[test]
    fn account_names_are_path_segments() {
        for good in ["default", "acme", "a", "team-7_b", &"x".repeat(64)] {
            assert_eq!(AccountId::parse_name(good).map(|a| a.0), Some(good.to_string()));
        }
        for bad in [
            "",
            "-lead",
            "_lead",
            "Upper",
            "a/b",
            "a.b",
            "a b",
            "é",
            &"x".repeat(65),
            "a\0",
        ] {
            assert!(AccountId::parse_name(bad).is_none(), "{bad:?} accepted");
        }
    }
}
