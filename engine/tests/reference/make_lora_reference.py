"""Reference data for the engine's LoRA conformance test, from transformers + peft.

Usage (from the repository root):
    python3 -m venv .venv && .venv/bin/pip install torch transformers peft safetensors
    cargo run -q -- fixtures tiny-llama /tmp/tiny-llama
    .venv/bin/python engine/tests/reference/make_lora_reference.py /tmp/tiny-llama engine/tests/data/lora

It writes two adapters in PEFT's own format (seeded, with random A and B so
that they change the output) and, for the base model and each adapter, the
logits at the last position of a fixed prompt and 24 greedily decoded tokens:
- `adapter-a`: rank 8, alpha 16, all seven projections;
- `adapter-b`: rank 4, alpha 8, rsLoRA, q/v/down with `down_proj` at rank 2
  and alpha 6 through `rank_pattern` and `alpha_pattern`.
"""

import json
import os
import sys

import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from make_reference import PROMPT, decode  # the conformance data's prompt and decoding

ADAPTERS = {
    "adapter-a": dict(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "adapter-b": dict(
        r=4,
        lora_alpha=8,
        use_rslora=True,
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"down_proj": 2},
        alpha_pattern={"down_proj": 6},
    ),
}


def base_model(fixture_dir: str):
    return AutoModelForCausalLM.from_pretrained(fixture_dir, torch_dtype=torch.float32, attn_implementation="eager")


def main(fixture_dir: str, out_dir: str) -> None:
    record = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "peft": peft.__version__,
        "prompt_ids": PROMPT,
        "base": decode(base_model(fixture_dir)),
    }
    for seed, (name, options) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        config = LoraConfig(lora_dropout=0.0, init_lora_weights=False, task_type="CAUSAL_LM", **options)
        model = get_peft_model(base_model(fixture_dir), config)
        model.save_pretrained(os.path.join(out_dir, name))
        os.remove(os.path.join(out_dir, name, "README.md"))  # a generated model card
        record[name] = decode(model)
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(record, f)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
