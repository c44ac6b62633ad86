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

/// An account id; accounts are created by operators, so any short token is allowed.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct AccountId(pub String);

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
}
