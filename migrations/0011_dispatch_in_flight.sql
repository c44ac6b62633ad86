-- A chunk the fair dispatch published is in flight until a worker has served
-- it (acked, or dead-lettered): the account with the fewest chunks in flight
-- on a lane goes next, so an account that arrives behind another's large
-- batch gets the freed places until both have as many.
ALTER TABLE outbox ADD COLUMN done_at TIMESTAMPTZ;
-- What was sent before counts as served.
UPDATE outbox SET done_at = sent_at WHERE sent_at IS NOT NULL;
CREATE INDEX outbox_in_flight ON outbox (account_id, routing_key)
    WHERE account_id IS NOT NULL AND sent_at IS NOT NULL AND done_at IS NULL;
