"""The official `openai` SDK against a running Lorry, base_url only.

Run by the end-to-end suite (tests/e2e/sdk.rs) with LORRY_BASE_URL and
LORRY_TOKEN set; prints one JSON object with what the Rust side checks
against the engine's own answers, and exits non-zero on any failure.
"""

import http.server
import json
import os
import sys
import threading
import time
from typing import Literal

import httpx
import openai
from openai import OpenAI
from pydantic import BaseModel, Field

LLAMA = "@lorry/demo-llama"
BGE = "@lorry/demo-bge"
MESSAGES = [{"role": "user", "content": "Hello there"}]


class Verdict(BaseModel):
    label: Literal["spam", "ham"]
    score: int = Field(ge=0, le=9)


def webhook_receiver():
    """A receiver on a free loopback port: its URL, the calls it got (headers,
    body), and an event set once a `batch.completed` call has come."""
    calls = []
    completed = threading.Event()

    class Hook(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["content-length"]))
            calls.append(({k.lower(): v for k, v in self.headers.items()}, body))
            if json.loads(body).get("type") == "batch.completed":
                completed.set()
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/hook", calls, completed


def main() -> None:
    base_url = os.environ["LORRY_BASE_URL"] + "/v1"
    client = OpenAI(base_url=base_url, api_key=os.environ["LORRY_TOKEN"], max_retries=0)
    report = {}

    models = {m.id: m for m in client.models.list().data}
    assert LLAMA in models and BGE in models, models
    report["models"] = sorted(models)
    assert client.models.retrieve(LLAMA).id == LLAMA

    chat = client.chat.completions.create(
        model=LLAMA, messages=MESSAGES, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.object == "chat.completion", chat
    assert chat.choices[0].finish_reason == "length", chat
    assert chat.usage.completion_tokens == 6, chat.usage
    # The SDK reads the answer's `x-request-id` into `_request_id`.
    assert chat._request_id and chat._request_id.startswith("req_"), chat._request_id
    report["chat"] = chat.choices[0].message.content

    chunks = list(
        client.chat.completions.create(
            model=LLAMA,
            messages=MESSAGES,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == report["chat"], (streamed, report["chat"])
    assert chunks[-1].usage.completion_tokens == 6, chunks[-1]

    completion = client.completions.create(model=LLAMA, prompt="Once upon", max_tokens=4, extra_body={"ignore_eos": True})
    report["completion"] = completion.choices[0].text

    # The SDK asks for base64 and decodes it itself.
    embeddings = client.embeddings.create(model=BGE, input=["a first text", "second"])
    assert [e.index for e in embeddings.data] == [0, 1]
    report["embedding"] = embeddings.data[1].embedding

    try:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError as e:
        assert e.code == "model_not_found", e

    lines = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": LLAMA, "messages": MESSAGES, "max_tokens": 6, "ignore_eos": True},
        }
        for i in range(3)
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("requests.jsonl", data), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(data), uploaded
    hook_url, hook_calls, hook_completed = webhook_receiver()
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "sdk"},
        extra_headers={"Idempotency-Key": "sdk-batch"},
        extra_body={"webhook": {"url": hook_url}},
    )
    # The same key with another body is a final conflict: a client that
    # retries 409s (the SDK's default) sends it once.
    sent = []
    retrying = OpenAI(
        base_url=base_url,
        api_key=os.environ["LORRY_TOKEN"],
        max_retries=2,
        http_client=httpx.Client(event_hooks={"request": [sent.append]}),
    )
    try:
        retrying.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"job": "another"},
            extra_headers={"Idempotency-Key": "sdk-batch"},
        )
        raise AssertionError("a reused key with another body was accepted")
    except openai.ConflictError as e:
        assert e.code == "idempotency_key_reused", e
        assert e.response.headers["x-should-retry"] == "false", e.response.headers
    assert len(sent) == 1, f"a final conflict was sent {len(sent)} times"
    deadline = time.time() + 120
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.time() < deadline, batch
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.total == 3 and batch.request_counts.completed == 3, batch.request_counts
    output = client.files.content(batch.output_file_id).text
    results = [json.loads(line) for line in output.splitlines()]
    assert [r["custom_id"] for r in results] == ["req-0", "req-1", "req-2"], results
    report["batch"] = [r["response"]["body"]["choices"][0]["message"]["content"] for r in results]
    assert any(b.id == batch.id for b in client.batches.list().data)
    assert client.files.delete(uploaded.id).deleted

    # Structured outputs: the parse helper with a Pydantic model (strict JSON schema).
    parsed = client.beta.chat.completions.parse(
        model=LLAMA, messages=MESSAGES, response_format=Verdict, max_tokens=64, temperature=1, seed=5
    )
    choice = parsed.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Verdict), choice.message
    report["parsed"] = choice.message.parsed.model_dump()

    # Log-probabilities in the SDK's own types, whole and streamed.
    scored = client.chat.completions.create(
        model=LLAMA, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True}
    )
    content = scored.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 for t in content), content
    assert all(t.logprob <= 0 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content), content
    streamed = [
        item
        for chunk in client.chat.completions.create(
            model=LLAMA,
            messages=MESSAGES,
            max_tokens=5,
            logprobs=True,
            top_logprobs=2,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        if chunk.choices and chunk.choices[0].logprobs
        for item in chunk.choices[0].logprobs.content or []
    ]
    assert [t.token for t in streamed] == [t.token for t in content], (streamed, content)
    report["logprobs"] = [t.logprob for t in content]

    # Several choices of one prompt, each its own sample.
    several = client.chat.completions.create(
        model=LLAMA, messages=MESSAGES, max_tokens=6, n=3, temperature=1, seed=4, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in several.choices] == [0, 1, 2], several
    assert several.usage.completion_tokens == 18, several.usage
    report["choices"] = [c.message.content for c in several.choices]

    # Tools: a required call parses into tool_calls, its arguments valid under the function's schema,
    # the same streamed as deltas; a named function is the one called; the call and its result go back.
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city for some days",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    }
    clock = {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
    }
    asked = [{"role": "user", "content": "What is the weather in Paris for three days?"}]
    called = client.chat.completions.create(
        model=LLAMA, messages=asked, max_tokens=120, temperature=1, seed=3, tools=[weather, clock], tool_choice="required",
        parallel_tool_calls=False,
    )
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, called
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_"), call
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(arguments) == {"city", "days"} and isinstance(arguments["city"], str), arguments
        assert len(arguments["city"]) <= 12 and 1 <= arguments["days"] <= 7, arguments
    else:
        assert call.function.name == "get_time" and arguments == {}, call
    deltas = {}
    finish = None
    for chunk in client.chat.completions.create(
        model=LLAMA, messages=asked, max_tokens=120, temperature=1, seed=3, tools=[weather, clock], tool_choice="required",
        parallel_tool_calls=False, stream=True,
    ):
        delta = chunk.choices[0].delta
        assert not delta.content, chunk
        for piece in delta.tool_calls or []:
            entry = deltas.setdefault(piece.index, {"name": "", "arguments": ""})
            entry["name"] += piece.function.name or ""
            entry["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and deltas == {0: {"name": call.function.name, "arguments": call.function.arguments}}, deltas
    named = client.chat.completions.create(
        model=LLAMA, messages=asked, max_tokens=120, temperature=1, seed=5, tools=[weather, clock],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False,
    )
    assert {c.function.name for c in named.choices[0].message.tool_calls} == {"get_weather"}, named
    answered = client.chat.completions.create(
        model=LLAMA,
        messages=asked
        + [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sun"}'},
        ],
        max_tokens=4,
        tools=[weather, clock],
        tool_choice="none",
        extra_body={"ignore_eos": True},
    )
    assert answered.choices[0].finish_reason == "length" and answered.choices[0].message.tool_calls is None, answered
    report["tools"] = [call.function.name, arguments]

    # Its completion webhook, verified and parsed by the SDK with the account's secret.
    secret = httpx.get(
        base_url + "/account", headers={"Authorization": "Bearer " + os.environ["LORRY_TOKEN"]}
    ).json()["webhook_secret"]
    assert hook_completed.wait(timeout=60), hook_calls
    headers, body = next((h, b) for h, b in hook_calls if json.loads(b)["type"] == "batch.completed")
    event = client.webhooks.unwrap(body, headers, secret=secret)
    assert event.type == "batch.completed" and event.object == "event", event
    assert event.data.id == batch.id and event.id.startswith("evt_"), event
    report["webhook"] = event.type

    print(json.dumps(report))


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # the suite shows this
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        raise
