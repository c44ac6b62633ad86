-- A chunk's claim and its results' commit name their requests by index. With
-- the open requests indexed by batch alone, the commit's plan read every open
-- request of the batch (a 50,000-request batch: tens of milliseconds for
-- each 32 results written). Keyed by (batch, index), the index finds the
-- rows named; asking whether a batch has an open request still reads its
-- first entry. The index is built inside the migration's transaction:
-- writes to `requests` wait for it (an index of the open requests only).
DROP INDEX requests_open;
CREATE INDEX requests_open ON requests (batch_id, idx) WHERE status IN ('pending', 'running');
