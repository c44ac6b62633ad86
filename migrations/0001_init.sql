-- Lorry's durable state. Every accepted request is a row of `requests`; its
-- terminal status is written once, guarded by its current status, so that
-- redelivered work never writes a second result.

CREATE TABLE accounts (
    id              TEXT PRIMARY KEY,
    token_hash      TEXT NOT NULL UNIQUE,
    webhook_secret  TEXT NOT NULL,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now()
);

CREATE TABLE batches (
    id                TEXT PRIMARY KEY,
    account_id        TEXT NOT NULL REFERENCES accounts (id),
    model             TEXT NOT NULL,
    shape             TEXT NOT NULL,            -- 'native' | 'workers_ai'
    status            TEXT NOT NULL,
    end_reason        TEXT,                     -- 'cancelled' | 'expired' once asked
    total             INTEGER NOT NULL,
    completion_window TEXT NOT NULL,
    metadata          JSONB,
    webhook_url       TEXT,
    idempotency_key   TEXT,
    request_hash      TEXT,
    output_key        TEXT,
    errors_key        TEXT,
    progress_at       TIMESTAMPTZ,
    created_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    in_progress_at    TIMESTAMPTZ,
    expires_at        TIMESTAMPTZ NOT NULL,
    finalizing_at     TIMESTAMPTZ,
    completed_at      TIMESTAMPTZ,
    failed_at         TIMESTAMPTZ,
    expired_at        TIMESTAMPTZ,
    cancelling_at     TIMESTAMPTZ,
    cancelled_at      TIMESTAMPTZ,
    UNIQUE (account_id, idempotency_key)
);
CREATE INDEX batches_account_listing ON batches (account_id, id DESC);
CREATE INDEX batches_open ON batches (status) WHERE status IN ('in_progress', 'cancelling', 'finalizing');

CREATE TABLE requests (
    batch_id          TEXT NOT NULL REFERENCES batches (id),
    idx               INTEGER NOT NULL,
    custom_id         TEXT,
    body              JSONB NOT NULL,
    status            TEXT NOT NULL DEFAULT 'pending',
    response          JSONB,
    error             JSONB,
    prompt_tokens     INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    attempts          INTEGER NOT NULL DEFAULT 0,
    started_at        TIMESTAMPTZ,
    finished_at       TIMESTAMPTZ,
    PRIMARY KEY (batch_id, idx)
);
CREATE INDEX requests_open ON requests (batch_id) WHERE status IN ('pending', 'running');

-- Messages to publish, written in the same transaction as the state they announce.
CREATE TABLE outbox (
    id          BIGSERIAL PRIMARY KEY,
    exchange    TEXT NOT NULL,
    routing_key TEXT NOT NULL,
    payload     JSONB NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    sent_at     TIMESTAMPTZ
);
CREATE INDEX outbox_unsent ON outbox (id) WHERE sent_at IS NULL;

CREATE TABLE webhook_deliveries (
    id              TEXT PRIMARY KEY,           -- the webhook-id, the same on every attempt
    account_id      TEXT NOT NULL REFERENCES accounts (id),
    batch_id        TEXT NOT NULL REFERENCES batches (id),
    event_type      TEXT NOT NULL,
    url             TEXT NOT NULL,
    payload         JSONB NOT NULL,
    status          TEXT NOT NULL DEFAULT 'pending',   -- 'pending' | 'delivered' | 'failed'
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    delivered_at    TIMESTAMPTZ
);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at) WHERE status = 'pending';

CREATE TABLE webhook_attempts (
    delivery_id  TEXT NOT NULL REFERENCES webhook_deliveries (id),
    attempt      INTEGER NOT NULL,
    status_code  INTEGER,
    error        TEXT,
    attempted_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (delivery_id, attempt)
);
