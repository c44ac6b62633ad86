-- Accounts are made and ended by an operator (`lorry accounts`, `/admin/v1`);
-- each holds any number of named API keys, stored as SHA-256 digests, and
-- may have quotas of its own.
ALTER TABLE accounts ADD COLUMN disabled_at TIMESTAMPTZ;

-- Per-account quota overrides; NULL takes the deployment's default, 0 is no limit.
ALTER TABLE accounts
    ADD COLUMN quota_queued_requests     BIGINT CHECK (quota_queued_requests >= 0),
    ADD COLUMN quota_realtime_per_second DOUBLE PRECISION CHECK (quota_realtime_per_second >= 0),
    ADD COLUMN quota_file_bytes          BIGINT CHECK (quota_file_bytes >= 0),
    ADD COLUMN quota_adapters            BIGINT CHECK (quota_adapters >= 0);

CREATE TABLE api_keys (
    id            TEXT PRIMARY KEY,                 -- key_<uuid v7>
    account_id    TEXT NOT NULL REFERENCES accounts (id) ON DELETE CASCADE,
    name          TEXT NOT NULL,
    key_hash      TEXT NOT NULL UNIQUE,
    redacted      TEXT NOT NULL,                    -- the key's first and last characters
    created_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_used_at  TIMESTAMPTZ,                      -- to the minute
    revoked_at    TIMESTAMPTZ
);
CREATE INDEX api_keys_account_listing ON api_keys (account_id, id);

-- Each account's one token becomes its key named 'bootstrap'.
INSERT INTO api_keys (id, account_id, name, key_hash, redacted, created_at)
SELECT 'key_' || md5(id), id, 'bootstrap', token_hash, '…', created_at FROM accounts;

ALTER TABLE accounts DROP COLUMN token_hash;
