-- A result is stored as the model generated it. `jsonb` cannot hold the
-- character U+0000, which byte-fallback tokens produce readily, so a chunk
-- holding one failed its commit; `json` keeps the text of the document,
-- escapes included.
ALTER TABLE requests ALTER COLUMN response TYPE json USING response::json;
