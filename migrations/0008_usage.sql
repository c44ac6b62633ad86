-- Real-time requests served, per account, UTC day, model and adapter (the
-- batch lane's usage is its request rows, written with their results).
CREATE TABLE realtime_usage (
    account_id    TEXT NOT NULL,
    day           DATE NOT NULL,
    model         TEXT NOT NULL,
    adapter       TEXT NOT NULL DEFAULT '',     -- the adapter's id, or '' for none
    requests      BIGINT NOT NULL DEFAULT 0,
    input_tokens  BIGINT NOT NULL DEFAULT 0,
    output_tokens BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (account_id, day, model, adapter)
);
