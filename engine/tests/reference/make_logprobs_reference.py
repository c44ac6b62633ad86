"""Reference log-probabilities for the engine's logprobs tests, from Hugging Face transformers.

Usage (from the repository root):
    python3 -m venv .venv && .venv/bin/pip install torch transformers safetensors
    for m in tiny-llama tiny-qwen2 tiny-gemma; do
        cargo run -q -- fixtures $m /tmp/$m
        .venv/bin/python engine/tests/reference/make_logprobs_reference.py /tmp/$m engine/tests/data/logprobs-$m.json
    done

It records, for a fixed prompt of token ids, NEW_TOKENS greedily decoded
tokens and at each position the chosen token's log-probability and the TOP
most likely tokens with theirs: `log_softmax` of the model's logits in
float32, as OpenAI reports log-probabilities (before temperature or any
filter). Each position's gap between the TOP-th and the next logit is kept
too, so a reader can see that no alternative's rank is a near-tie.
"""

import json
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM

PROMPT = [0, 75, 104, 101, 3, 200, 17, 42, 99, 150, 7, 8, 250, 31, 64, 5, 120, 121, 122, 9]
NEW_TOKENS = 16
TOP = 5


def main(fixture_dir: str, out_path: str) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(fixture_dir, torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    steps = []
    with torch.no_grad():
        out = model(torch.tensor([PROMPT]), use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
        for _ in range(NEW_TOKENS):
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            token = int(torch.argmax(logits))
            ranked = torch.topk(logits, TOP + 1)
            steps.append(
                {
                    "token": token,
                    "logprob": float(logprobs[token]),
                    "top_ids": [int(i) for i in ranked.indices[:TOP]],
                    "top_logprobs": [float(logprobs[i]) for i in ranked.indices[:TOP]],
                    "rank_gap": min(float(ranked.values[i] - ranked.values[i + 1]) for i in range(TOP)),
                }
            )
            out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
    record = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "prompt_ids": PROMPT,
        "top": TOP,
        "steps": steps,
    }
    with open(out_path, "w") as f:
        json.dump(record, f)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
