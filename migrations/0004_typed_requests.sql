-- A request is stored as the typed request the API validated (`request`),
-- which workers read without validating it again. `body`, the client's own
-- JSON, is kept only on rows written before this migration; workers validate
-- those as they always did.
ALTER TABLE requests ALTER COLUMN body DROP NOT NULL;
ALTER TABLE requests ADD COLUMN request JSONB;
