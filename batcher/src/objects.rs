//! The S3 object store: batch outputs and, later, adapters and files.

use std::time::Duration;

use aws_sdk_s3::config::{Credentials, Region};
use aws_sdk_s3::presigning::PresigningConfig;
pub use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::Client;

use crate::ids::{AccountId, AdapterId, BatchId};
use crate::BatcherError;

type Result<T> = std::result::Result<T, BatcherError>;

/// Where and how to reach the object store.
#[derive(Clone)]
pub struct ObjectStoreConfig {
    /// An S3-compatible endpoint; `None` means AWS itself.
    pub endpoint: Option<String>,
    /// The bucket, created at start-up if missing.
    pub bucket: String,
    /// The region.
    pub region: String,
    /// Access key id.
    pub access_key: String,
    /// Secret access key.
    pub secret_key: String,
}

impl std::fmt::Debug for ObjectStoreConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectStoreConfig")
            .field("endpoint", &self.endpoint)
            .field("bucket", &self.bucket)
            .field("region", &self.region)
            .field("access_key", &self.access_key)
            .finish_non_exhaustive()
    }
}

/// A bucket on an S3-compatible store; cheap to clone.
#[derive(Clone, Debug)]
pub struct ObjectStore {
    client: Client,
    bucket: String,
}

fn s3_error(e: impl std::error::Error) -> BatcherError {
    use std::fmt::Write;
    let mut message = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        let _ = write!(message, ": {inner}");
        source = inner.source();
    }
    BatcherError::ObjectStore(message)
}

impl ObjectStore {
    /// A client for the configured bucket (no network yet).
    pub fn new(config: &ObjectStoreConfig) -> Self {
        let credentials = Credentials::new(&config.access_key, &config.secret_key, None, None, "lorry");
        let mut builder = aws_sdk_s3::Config::builder()
            .behavior_version_latest()
            .region(Region::new(config.region.clone()))
            .credentials_provider(credentials)
            .force_path_style(config.endpoint.is_some());
        if let Some(endpoint) = &config.endpoint {
            builder = builder.endpoint_url(endpoint);
        }
        ObjectStore {
            client: Client::from_conf(builder.build()),
            bucket: config.bucket.clone(),
        }
    }

    /// The bucket's name.
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// Create the bucket unless it exists.
    pub async fn ensure_bucket(&self) -> Result<()> {
        if self.ping().await.is_ok() {
            return Ok(());
        }
        match self.client.create_bucket().bucket(&self.bucket).send().await {
            Ok(_) => Ok(()),
            Err(e) => {
                let exists = e
                    .as_service_error()
                    .is_some_and(|s| s.is_bucket_already_owned_by_you() || s.is_bucket_already_exists());
                if exists {
                    Ok(())
                } else {
                    Err(s3_error(e))
                }
            }
        }
    }

    /// Whether the bucket is reachable.
    pub async fn ping(&self) -> Result<()> {
        self.client
            .head_bucket()
            .bucket(&self.bucket)
            .send()
            .await
            .map_err(s3_error)?;
        Ok(())
    }

    /// Store an object.
    pub async fn put(&self, key: &str, body: impl Into<ByteStream>, content_type: &str) -> Result<()> {
        self.client
            .put_object()
            .bucket(&self.bucket)
            .key(key)
            .content_type(content_type)
            .body(body.into())
            .send()
            .await
            .map_err(s3_error)?;
        Ok(())
    }

    /// Read an object whole.
    pub async fn get(&self, key: &str) -> Result<Vec<u8>> {
        let body = self.body(key).await?.collect().await.map_err(s3_error)?;
        Ok(body.into_bytes().to_vec())
    }

    /// An object's bytes as they arrive, for answers that pass them on
    /// without holding the whole object.
    pub async fn get_stream(
        &self,
        key: &str,
    ) -> Result<impl futures::Stream<Item = Result<bytes::Bytes>> + Send + 'static> {
        Ok(futures::stream::unfold(self.body(key).await?, |mut body| async move {
            body.next().await.map(|piece| (piece.map_err(s3_error), body))
        }))
    }

    async fn body(&self, key: &str) -> Result<ByteStream> {
        let object = self
            .client
            .get_object()
            .bucket(&self.bucket)
            .key(key)
            .send()
            .await
            .map_err(s3_error)?;
        Ok(object.body)
    }

    /// Delete an object (deleting one that is not there succeeds).
    pub async fn delete(&self, key: &str) -> Result<()> {
        self.client
            .delete_object()
            .bucket(&self.bucket)
            .key(key)
            .send()
            .await
            .map_err(s3_error)?;
        Ok(())
    }

    /// Delete every object whose key starts with `prefix`; returns how many.
    pub async fn delete_prefix(&self, prefix: &str) -> Result<usize> {
        use futures::{StreamExt as _, TryStreamExt as _};
        let mut deleted = 0;
        let mut token = None;
        loop {
            let page = self
                .client
                .list_objects_v2()
                .bucket(&self.bucket)
                .prefix(prefix)
                .set_continuation_token(token.take())
                .send()
                .await
                .map_err(s3_error)?;
            let keys: Vec<String> = page
                .contents()
                .iter()
                .filter_map(|o| o.key().map(str::to_string))
                .collect();
            deleted += keys.len();
            futures::stream::iter(keys)
                .map(|key| async move { self.delete(&key).await })
                .buffer_unordered(8)
                .try_collect::<Vec<()>>()
                .await?;
            match page.next_continuation_token() {
                Some(next) if page.is_truncated() == Some(true) => token = Some(next.to_string()),
                _ => return Ok(deleted),
            }
        }
    }

    /// A presigned GET URL valid for `ttl`.
    pub async fn presign_get(&self, key: &str, ttl: Duration) -> Result<String> {
        let config = PresigningConfig::expires_in(ttl).map_err(s3_error)?;
        let request = self
            .client
            .get_object()
            .bucket(&self.bucket)
            .key(key)
            .presigned(config)
            .await
            .map_err(s3_error)?;
        Ok(request.uri().to_string())
    }
}

/// Where a batch's files live: under its account.
pub fn batch_key(account: &AccountId, batch: &BatchId, file: &str) -> String {
    format!("accounts/{account}/batches/{batch}/{file}")
}

/// Where everything of an account lives.
pub fn account_prefix(account: &AccountId) -> String {
    format!("accounts/{account}/")
}

/// Where an adapter's files live: under its account.
pub fn adapter_key(account: &AccountId, adapter: &AdapterId, file: &str) -> String {
    format!("accounts/{account}/adapters/{adapter}/{file}")
}
