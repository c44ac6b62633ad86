"""Reference data for the engine's conformance tests, from Hugging Face transformers.

Usage (from the repository root):
    python3 -m venv .venv && .venv/bin/pip install torch transformers safetensors
    cargo run -q -- fixtures tiny-llama /tmp/tiny-llama
    .venv/bin/python engine/tests/reference/make_reference.py /tmp/tiny-llama engine/tests/data/tiny-llama.json

It records, for a fixed prompt of token ids: the logits at the prompt's last
position, and 24 greedily decoded tokens (with the smallest gap between the
best and second-best logit, so a reader can see no step was a near-tie).
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM

PROMPT = [0, 75, 104, 101, 3, 200, 17, 42, 99, 150, 7, 8, 250, 31, 64, 5, 120, 121, 122, 9]
NEW_TOKENS = 24


def main(fixture_dir: str, out_path: str) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        fixture_dir, torch_dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        out = model(ids, use_cache=True)
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
    import transformers

    record = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "prompt_ids": PROMPT,
        "last_logits": [float(x) for x in last_logits],
        "greedy_ids": greedy,
        "min_greedy_gap": min_gap,
    }
    with open(out_path, "w") as f:
        json.dump(record, f)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
