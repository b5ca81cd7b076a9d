"""Many clients at once over loopback: abandoned streams give their KV pages back, and 200 concurrent streams
all finish with the text the same request gives alone."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx

from tests.server.conftest import MODEL, held_pages

PROMPTS = [
    "The capital of France is",
    "def add(a, b):",
    "Once upon a time",
    "1, 2, 3, 4,",
    "Q: Why is the sky blue?\nA:",
    "import numpy as np\n",
    "The best way to learn is",
    "Dear diary, today",
]


def metric(text: str, name: str, labels: str = "") -> float:
    """Sum of a metric's samples in Prometheus text (all label sets unless `labels` narrows them)."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        if labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


async def _sse_events(response: httpx.Response):
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]


def _wait_idle(http: httpx.Client, timeout: float = 60) -> str:
    """Metrics text once no request is in flight and no KV page is used (or fails after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        text = http.get("/metrics").text
        idle = metric(text, "jaxinfer:num_requests_in_flight") == 0 and held_pages(text) == 0
        if idle or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def test_disconnects_return_pages(server, http):
    before = http.get("/metrics").text

    async def cut_short(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        seen = 0
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for _ in _sse_events(r):
                seen += 1
                if seen == 3:
                    break  # leaving the block closes the connection mid-stream
        return seen

    async def main() -> list[int]:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(cut_short(c, i) for i in range(50)))

    assert asyncio.run(main()) == [3] * 50
    after = _wait_idle(http)
    assert held_pages(after) == 0, after
    assert metric(after, "jaxinfer:num_requests_in_flight") == 0
    aborted = metric(after, "jaxinfer:request_success_total", 'finished_reason="abort"') - metric(
        before, "jaxinfer:request_success_total", 'finished_reason="abort"'
    )
    assert aborted == 50
    # Aborted early: far fewer tokens than 50 x 400 were generated.
    generated = metric(after, "jaxinfer:generation_tokens_total") - metric(before, "jaxinfer:generation_tokens_total")
    assert generated < 50 * 20
    assert http.get("/health").status_code == 200
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_200_concurrent_streams(server, http):
    def body(prompt: str, stream: bool) -> dict:
        return {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": stream}

    expected = {p: http.post("/v1/completions", json=body(p, False)).json()["choices"][0]["text"] for p in PROMPTS}
    before = http.get("/metrics").text

    async def one(client: httpx.AsyncClient, prompt: str) -> tuple[str, str | None, bool]:
        text, reason, done = "", None, False
        async with client.stream("POST", "/v1/completions", json=body(prompt, True)) as r:
            assert r.status_code == 200, await r.aread()
            async for data in _sse_events(r):
                if data == "[DONE]":
                    done = True
                    continue
                choice = json.loads(data)["choices"][0]
                text += choice["text"]
                reason = choice["finish_reason"] or reason
        return text, reason, done

    async def main():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=600, limits=limits) as c:
            return await asyncio.gather(*(one(c, PROMPTS[i % len(PROMPTS)]) for i in range(200)))

    t0 = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t0
    for i, (text, reason, done) in enumerate(results):
        assert done and reason in ("stop", "length")
        assert text == expected[PROMPTS[i % len(PROMPTS)]], i
    after = _wait_idle(http)
    finished = metric(after, "jaxinfer:request_success_total") - metric(before, "jaxinfer:request_success_total")
    assert finished == 200
    assert (
        metric(after, "jaxinfer:e2e_request_latency_seconds_count")
        - metric(before, "jaxinfer:e2e_request_latency_seconds_count")
        == 200
    )
    assert held_pages(after) == 0
    print(f"200 streams in {elapsed:.1f}s")
