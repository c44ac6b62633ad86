"""Reference data for the engine's conformance tests, from Hugging Face transformers.

Usage (from the repository root):
    python3 -m venv .venv && .venv/bin/pip install torch transformers safetensors
    cargo run -q -- fixtures tiny-llama /tmp/tiny-llama
    .venv/bin/python engine/tests/reference/make_reference.py /tmp/tiny-llama engine/tests/data/tiny-llama.json

It records, for a fixed prompt of token ids: for a decoder, the logits at the
prompt's last position and 24 greedily decoded tokens (with the smallest gap
between the best and second-best logit, so a reader can see no step was a
near-tie); for a BERT encoder, the L2-normalised CLS and mean-pooled
embeddings, pooled as sentence-transformers does.
"""

import json
import sys

import torch
import transformers
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

PROMPT = [0, 75, 104, 101, 3, 200, 17, 42, 99, 150, 7, 8, 250, 31, 64, 5, 120, 121, 122, 9]
NEW_TOKENS = 24


def encoder(fixture_dir: str) -> dict:
    model = AutoModel.from_pretrained(fixture_dir, torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        hidden = model(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT))).last_hidden_state[0]
    normalise = torch.nn.functional.normalize
    return {
        "prompt_ids": PROMPT,
        "cls": [float(x) for x in normalise(hidden[0], dim=-1)],
        "mean": [float(x) for x in normalise(hidden.mean(dim=0), dim=-1)],
    }


def main(fixture_dir: str, out_path: str) -> None:
    torch.manual_seed(0)
    if AutoConfig.from_pretrained(fixture_dir).model_type == "bert":
        write(out_path, encoder(fixture_dir))
        return
    model = AutoModelForCausalLM.from_pretrained(
        fixture_dir, torch_dtype=torch.float32, attn_implementation="eager"
    )
    write(out_path, {"prompt_ids": PROMPT, **decode(model)})


def decode(model) -> dict:
    """The logits at the prompt's last position and NEW_TOKENS greedy tokens."""
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([PROMPT]), use_cache=True)
        last_logits = out.logits[0, -1]
        past, logits = out.past_key_values, last_logits
        greedy, min_gap = [], float("inf")
        for _ in range(NEW_TOKENS):
            top2 = torch.topk(logits, 2).values
            min_gap = min(min_gap, float(top2[0] - top2[1]))
            token = int(torch.argmax(logits))
            greedy.append(token)
            out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
    return {
        "last_logits": [float(x) for x in last_logits],
        "greedy_ids": greedy,
        "min_greedy_gap": min_gap,
    }


def write(out_path: str, record: dict) -> None:
    record = {"transformers": transformers.__version__, "torch": torch.__version__, **record}
    with open(out_path, "w") as f:
        json.dump(record, f)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
