-- OpenAI's files API and the batches made from files.

CREATE TABLE files (
    id          TEXT PRIMARY KEY,                      -- file-<uuid v7>
    account_id  TEXT NOT NULL REFERENCES accounts (id),
    purpose     TEXT NOT NULL,                         -- 'batch' | 'batch_output'
    filename    TEXT NOT NULL,
    bytes       BIGINT NOT NULL,
    lines       INTEGER NOT NULL,
    object_key  TEXT NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX files_account_listing ON files (account_id, id DESC);

-- A batch made from a file: {"endpoint", "input_file_id", "model"} and, once
-- it has ended, "output_file_id" and "error_file_id".
ALTER TABLE batches ADD COLUMN openai JSONB;

-- Why a generation ended ('stop' | 'length'), for OpenAI's answers.
ALTER TABLE requests ADD COLUMN finish_reason TEXT;
