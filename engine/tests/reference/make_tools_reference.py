"""Reference renderings of conversations with tools, by transformers' own
chat-template renderer, for engine/tests/tools.rs.

The templates in engine/tests/data/templates/ are the models' own, as
llama.cpp keeps them in models/templates/ (taken from the llama-cpp-python
0.3.16 sdist, vendor/llama.cpp/models/templates/). Run with transformers
5.25.0 and jinja2 installed:

    python engine/tests/reference/make_tools_reference.py > engine/tests/data/tools-reference.json
"""

import json
import pathlib

import transformers
from transformers.utils.chat_template_utils import render_jinja_template

HERE = pathlib.Path(__file__).resolve().parent
TEMPLATES = HERE.parent / "data" / "templates"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city's name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now", "parameters": {"type": "object", "properties": {}}}}

# (template, bos, eos, the id its calls carry: Mistral's are nine letters and digits)
FAMILIES = [
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "", "<|im_end|>", "call_abc123"),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "<|begin_of_text|>", "<|eot_id|>", "call_abc123"),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>", "call_abc123"),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "<s>", "</s>", "abc123XYZ"),
]


def conversations(call_id):
    asked = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    call = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}
    answered = asked + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "{\"temperature\": 21}", "tool_call_id": call_id},
    ]
    return [
        {"messages": asked, "tools": [WEATHER, CLOCK]},
        {"messages": answered, "tools": [WEATHER, CLOCK]},
    ]


def main():
    out = {"transformers": transformers.__version__, "families": []}
    for name, bos, eos, call_id in FAMILIES:
        template = (TEMPLATES / name).read_text()
        cases = []
        for case in conversations(call_id):
            rendered, _ = render_jinja_template(
                conversations=[case["messages"]],
                tools=case["tools"],
                chat_template=template,
                add_generation_prompt=True,
                bos_token=bos,
                eos_token=eos,
            )
            cases.append({**case, "text": rendered[0]})
        out["families"].append({"template": name, "bos_token": bos, "eos_token": eos, "cases": cases})
    print(json.dumps(out, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
