-- A stored request keeps its objects' keys in the order the client wrote
-- them. `jsonb` sorts them, and the order is what a model sees: a chat
-- template prints a tool's parameters schema as it finds it, and a
-- structured output's schema orders the generated object's fields. `json`
-- keeps the document's text. Rows written before keep the order `jsonb` gave them.
ALTER TABLE requests ALTER COLUMN request TYPE json USING request::json;
