-- Retention: a file may expire (OpenAI's `expires_after`, and a batch's
-- `output_expires_after` for its output and error files); ended batches and
-- files older than LORRY_RETENTION_DAYS are purged by the sweeper.
ALTER TABLE files ADD COLUMN expires_at TIMESTAMPTZ;
CREATE INDEX files_expiry ON files (expires_at) WHERE expires_at IS NOT NULL;
CREATE INDEX batches_ended ON batches (coalesce(completed_at, failed_at, expired_at, cancelled_at))
    WHERE status IN ('completed', 'failed', 'expired', 'cancelled');
