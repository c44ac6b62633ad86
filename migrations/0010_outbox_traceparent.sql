-- The W3C trace context of the request that wrote a message, published in
-- the message's headers, so that a trace follows the work through the broker.
ALTER TABLE outbox ADD COLUMN traceparent TEXT;
