//! What the batcher's test binaries share.

use lorry_batcher::objects::{ObjectStore, ObjectStoreConfig};

/// A fresh bucket named `{prefix}-…` on the S3-compatible server `scripts/test` starts.
pub async fn fresh_bucket(prefix: &str) -> ObjectStore {
    let env = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_string());
    let objects = ObjectStore::new(&ObjectStoreConfig {
        endpoint: Some(env("LORRY_S3_ENDPOINT", "http://127.0.0.1:9310")),
        bucket: format!("{prefix}-{}", &uuid::Uuid::new_v4().simple().to_string()[..16]),
        region: "us-east-1".into(),
        access_key: env("AWS_ACCESS_KEY_ID", "lorry"),
        secret_key: env("AWS_SECRET_ACCESS_KEY", "lorry-secret-key"),
    });
    objects.ensure_bucket().await.unwrap();
    objects
}
