-- The batch lane's chunk messages wait in the outbox under their account and
-- are published a few at a time, taking turns by account, so that one
-- account's large batch does not hold up another's (the relay's fair dispatch).
ALTER TABLE outbox ADD COLUMN account_id TEXT;
CREATE INDEX outbox_held ON outbox (routing_key, account_id, id) WHERE sent_at IS NULL AND account_id IS NOT NULL;

-- Each account's last turn on each lane: the account whose turn is oldest goes next.
CREATE SEQUENCE dispatch_turn;
CREATE TABLE dispatch_turns (
    routing_key TEXT NOT NULL,
    account_id  TEXT NOT NULL,
    turn        BIGINT NOT NULL,
    PRIMARY KEY (routing_key, account_id)
);

-- An account's own batches go out highest priority first (then oldest first).
ALTER TABLE batches ADD COLUMN priority SMALLINT NOT NULL DEFAULT 0;
