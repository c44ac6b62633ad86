#!/usr/bin/env python3
"""Write the fuzz targets' seeds (fuzz/corpus/<target>/seed-*): valid and
nearly valid inputs of each parser, so that fuzzing starts past the first
checks. Files that fuzzing adds beside them are kept as they are. Run from the repository root: python3 fuzz/seed.py (it needs the `gguf`
and `numpy` packages from PyPI)."""
import json
import os
import shutil

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
MODELS = ["@lorry/echo", "@lorry/text", "@lorry/embed"]
OPENAI = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]


def write(target, name, data):
    os.makedirs(os.path.join(ROOT, target), exist_ok=True)
    if isinstance(data, (dict, list)):
        data = json.dumps(data)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(ROOT, target, "seed-" + name), "wb") as f:
        f.write(data)


chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 3,
        "stop": ["\n", "end"], "stop_token_ids": [2], "ignore_eos": False,
        "repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": -0.5}
inputs = {
    "prompt": {"prompt": "Once upon", "raw": True, "max_tokens": 4},
    "chat": chat,
    "lora": {"prompt": "x", "lora": "support-tone", "stream": True},
    "echo": {"text": "a b c"},
    "embed": {"text": ["a", "b"], "pooling": "mean"},
}

write("json_body", "object", {"a": [1, 2.5, -3e7, True, None, "\u00e9\ud83d\ude00"], "b": {"c": ""}})
write("json_body", "escapes", '{"s": "\\u0041\\ud83d\\ude00\\n", "n": 1e308}')
write("json_body", "duplicate", '{"a": 1, "a": 2}')
write("json_body", "nul", '{"a": "x\\u0000y"}')

write("native_batch", "echo", {"model": "@lorry/echo", "requests": [
    {"custom_id": "doc-1", "body": {"prompt": "hello"}}, {"body": {"messages": [{"role": "user", "content": "x"}]}}],
    "completion_window": "24h", "metadata": {"job": "nightly"}, "webhook": {"url": "https://example.com/hook"}})
write("native_batch", "text", {"model": "@lorry/text:support", "requests": [
    {"custom_id": "a", "body": chat}, {"custom_id": "b", "body": {"prompt": "p", "adapter": "lora_x"}}],
    "completion_window": "15m"})
write("native_batch", "embed", {"model": "@lorry/embed", "requests": [{"body": {"text": ["a"], "pooling": "cls"}}]})
write("native_batch", "private-hook", {"model": "@lorry/echo", "requests": [{"body": {"prompt": "x"}}],
                                        "webhook": {"url": "http://[::ffff:127.0.0.1]/"}})

for i, model in enumerate(MODELS):
    for name, body in inputs.items():
        write("workers_ai", f"{i}-{name}", bytes([i]) + json.dumps(body).encode())
    write("workers_ai", f"{i}-queue", bytes([i]) + json.dumps(
        {"requests": [dict(inputs["prompt"], external_reference="r1"), inputs["echo"]],
         "queueRequest": True, "webhook": {"url": "https://example.com/h"}}).encode())
    write("workers_ai", f"{i}-poll", bytes([i]) + json.dumps({"request_id": "batch_0123"}).encode())

oa_chat = {"model": "@lorry/text", "messages": [{"role": "developer", "content": [{"type": "text", "text": "hi"}]},
           {"role": "user", "content": "x"}], "max_completion_tokens": 5, "n": 1, "stream": True,
           "stream_options": {"include_usage": True}, "user": "u"}
oa_completion = {"model": "@lorry/text:tone", "prompt": "Once", "max_tokens": 3, "stop": "x", "echo": False}
oa_embed = {"model": "@lorry/embed", "input": ["a", "b"], "encoding_format": "base64"}
for i, body in enumerate([oa_chat, oa_completion, oa_embed]):
    write("openai", f"{i}", bytes([i]) + json.dumps(body).encode())

lines = [{"custom_id": f"r{i}", "method": "POST", "url": OPENAI[i % 3],
          "body": [oa_chat | {"stream": False, "stream_options": None}, oa_completion, oa_embed][i % 3]} for i in range(3)]
lines[0]["body"].pop("stream_options")
write("batch_file", "three", "\n".join(json.dumps(l) for l in lines) + "\n")
write("batch_file", "crlf", "\r\n".join(json.dumps(l) for l in lines))

here = os.path.dirname(os.path.abspath(__file__))
data = os.path.join(here, "..", "engine", "tests", "data")
for adapter in ["adapter-a", "adapter-b"]:
    write("adapter_config", adapter, open(os.path.join(data, "lora", adapter, "adapter_config.json"), "rb").read())
write("adapter_config", "patterns", {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
                                     "rank_pattern": {"q_proj": 4}, "alpha_pattern": {"v_proj": 2},
                                     "layers_to_transform": [0], "layers_pattern": "layers"})
write("adapter_weights", "adapter-b", open(os.path.join(data, "lora", "adapter-b", "adapter_model.safetensors"), "rb").read())

write("gguf", "dequant", open(os.path.join(data, "gguf", "dequant.gguf"), "rb").read())
for name in ["hf-llama", "smollm2-hf"]:
    write("model_config", name, open(os.path.join(data, "gguf", name, "config.json"), "rb").read())


def small_gguf(path):
    """A GGUF file small enough to fuzz quickly: a two-layer Llama's
    metadata, an eight-token vocabulary and its tensor directory with tiny
    tensors (the `gguf` package, from PyPI)."""
    import gguf
    import numpy as np
    writer = gguf.GGUFWriter(path, "llama")
    dim, ff, vocab = 8, 16, 8
    writer.add_block_count(2)
    writer.add_context_length(64)
    writer.add_embedding_length(dim)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([1] * vocab)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    rng = np.random.default_rng(0)
    tensor = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    writer.add_tensor("token_embd.weight", tensor(vocab, dim))
    writer.add_tensor("output_norm.weight", tensor(dim))
    for layer in range(2):
        for name, shape in [("attn_norm", (dim,)), ("ffn_norm", (dim,)), ("attn_q", (dim, dim)),
                            ("attn_k", (dim // 2, dim)), ("attn_v", (dim // 2, dim)), ("attn_output", (dim, dim)),
                            ("ffn_gate", (ff, dim)), ("ffn_up", (ff, dim)), ("ffn_down", (dim, ff))]:
            writer.add_tensor(f"blk.{layer}.{name}.weight", tensor(*shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


small_gguf(os.path.join(ROOT, "gguf", "seed-small-llama"))
