-- LoRA adapters uploaded by accounts. The files live in S3 under the
-- account; a row is 'ready' once both files are there and were checked
-- together against the base model. Names are unique per account.

CREATE TABLE adapters (
    id             TEXT PRIMARY KEY,
    account_id     TEXT NOT NULL REFERENCES accounts (id),
    name           TEXT NOT NULL,
    model          TEXT NOT NULL,            -- the base model it adapts
    description    TEXT NOT NULL DEFAULT '',
    status         TEXT NOT NULL,            -- 'pending' (files missing) | 'ready'
    config_key     TEXT,                     -- S3 key of adapter_config.json
    weights_key    TEXT,                     -- S3 key of adapter_model.safetensors
    weights_bytes  BIGINT,
    weights_sha256 TEXT,
    rank           INTEGER,
    targets        TEXT[],
    created_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    modified_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    UNIQUE (account_id, name)
);
CREATE INDEX adapters_account_listing ON adapters (account_id, id DESC);
