"""`jaxinfer chat` driven through a pseudo-terminal, as a user types: it answers, streams the answer token by
token, keeps the conversation across turns, and /reset starts over (keeping the system prompt).

The reference is the server itself over plain HTTP: the greedy answer to the whole conversation so far. A second
turn that matched the answer to its message alone would mean the history was dropped.
"""

from __future__ import annotations

import sys
import time

import httpx
import pexpect
import pytest

from tests.cli.conftest import API_KEY, MODEL_NAME, REPO_ENV
from tests.tiny_model import SETTINGS

SYSTEM = "You are terse."
TURNS = ["What is the capital of France?", "And of Italy?"]
MAX_TOKENS = 16
PROMPT = "\r\n> "


def _reference(server, messages: list[dict]) -> str:
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=server.headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _answer(child: pexpect.spawn, message: str) -> tuple[str, int]:
    """Sends one line; returns the printed answer and how many separate terminal reads its text arrived in."""
    child.sendline(message)
    child.expect_exact(message + "\r\n")  # the terminal's echo of the typed line
    chunks: list[str] = []
    deadline = time.monotonic() + 120
    while not "".join(chunks).endswith(PROMPT):
        assert time.monotonic() < deadline, f"no prompt after the answer: {''.join(chunks)!r}"
        try:
            chunks.append(child.read_nonblocking(4096, timeout=5))
        except pexpect.TIMEOUT:
            continue
    text = "".join(chunks)[: -len(PROMPT)]
    starts, offset = [], 0
    for c in chunks:
        starts.append(offset)
        offset += len(c)
    return text.replace("\r\n", "\n"), sum(s < len(text) for s in starts)


@pytest.fixture()
def chat(live_server):
    child = pexpect.spawn(
        sys.executable,
        [
            "-m",
            "jaxinfer.cli",
            "chat",
            "--url",
            f"{live_server.url}/v1",
            "--api-key",
            API_KEY,
            "--system-prompt",
            SYSTEM,
            "--max-tokens",
            str(MAX_TOKENS),
        ],  # fmt: skip
        env=REPO_ENV,
        encoding="utf-8",
        timeout=120,
        dimensions=(50, 400),  # no line wrapping in the way of the comparison
    )
    child.expect_exact("> ")
    yield child
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_chat_streams_keeps_history_and_resets(chat, live_server):
    messages = [{"role": "system", "content": SYSTEM}]
    reads = []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        expected = _reference(live_server, messages)
        answer, n_reads = _answer(chat, turn)
        assert answer == expected
        assert expected.strip(), "the model answered nothing: the test could not see streaming"
        messages.append({"role": "assistant", "content": answer})
        reads.append(n_reads)
    # Streaming: each answer's text reached the terminal in several reads, not in one block at the end.
    assert max(reads) >= 2, reads  # (max: a busy machine may deschedule the reader for a whole answer)
    without_history = _reference(live_server, [messages[0], {"role": "user", "content": TURNS[1]}])
    assert without_history != messages[-1]["content"], "the history changed nothing: the test cannot see it"

    chat.sendline("/reset")
    chat.expect_exact("(history cleared)")
    chat.expect_exact("> ")
    answer, _ = _answer(chat, TURNS[1])
    assert answer == without_history


def test_chat_survives_a_refused_message(chat, live_server):
    # Longer than the server's context: a 400. The session goes on and the message is not kept in the history.
    chat.sendline("word " * (SETTINGS["max_model_len"] + 50))
    chat.expect_exact("[error: ")
    chat.expect_exact("> ")
    answer, _ = _answer(chat, TURNS[0])
    assert answer == _reference(
        live_server, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
    )
