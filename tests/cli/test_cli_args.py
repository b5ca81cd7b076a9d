"""The `jaxinfer` command line: every flag of every subcommand documents its default in --help, `serve MODEL` is
`--model MODEL` under the server's own validation, and `env` reports the backend."""

from __future__ import annotations

import argparse
import http.server
import json
import subprocess
import sys
import threading

import pytest

from jaxinfer.cli import DefaultsFormatter, main, make_cli_parser, server_args
from tests.cli.conftest import REPO_ENV

SUBCOMMANDS = ["serve", "generate", "chat", "complete", "bench", "convert", "env"]


def _subparser(name: str) -> argparse.ArgumentParser:
    for action in make_cli_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise AssertionError("no subcommands")


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_flag_documents_its_default(name: str):
    sub = _subparser(name)
    formatter = DefaultsFormatter(prog="x")
    flags = [a for a in sub._actions if a.dest != "help" and a.option_strings]
    for action in flags:
        text = formatter._get_help_string(action)
        assert "default" in text.lower(), f"{name} {action.option_strings}: {text!r}"
        assert "default" in sub.format_help() and action.option_strings[-1] in sub.format_help()


def test_serve_model_positional_is_the_model_flag():
    assert server_args(["some/model.gguf", "--port", "9"]).model == "some/model.gguf"
    assert server_args(["--port", "9"]).port == 9
    with pytest.raises(SystemExit):
        server_args(["a.gguf", "--model", "b.gguf"])  # both: ambiguous
    with pytest.raises(SystemExit):
        server_args(["--gpu-memory-utilization", "2"])  # the server's own validation still runs


def test_bench_needs_a_kind():
    with pytest.raises(SystemExit):
        main(["bench", "nonsense"])


def test_env_reports_backend_and_versions():
    secret = "sk-do-not-print-me"
    env = {**REPO_ENV, "JAXINFER_API_KEY": secret, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "env", "--json"], env=env, capture_output=True,
                         text=True, timeout=120, check=True)  # fmt: skip
    info = json.loads(out.stdout)
    assert info["backend"] == "cpu" and info["devices"][0]["platform"] == "cpu"
    assert {"jax", "jaxlib", "jaxinfer"} <= set(info["packages"])
    # A bug report quotes the settings, never a key: `env` printed the server's API key.
    assert info["env"]["JAX_PLATFORMS"] == "cpu" and info["env"]["JAXINFER_API_KEY"] == "<redacted>"
    assert secret not in out.stdout


def test_ports_outside_the_tcp_range_are_refused():
    """99999 was taken modulo 65536: the log said port 99999 while the server listened on 34463."""
    assert server_args(["--port", "0"]).port == 0 and server_args(["--port", "65535"]).port == 65535
    for bad in ("99999", "-5", "65536"):
        with pytest.raises(SystemExit):
            server_args(["--port", bad])


@pytest.mark.parametrize(
    "flags",
    [["--api-keys-file", "/nonexistent.jsonl"], ["--max-waiting", "0"], ["--gpu-memory-utilization", "1.5"],
     ["--port", "99999"]],  # the last one argparse's own type check refuses
)  # fmt: skip
def test_serve_names_a_bad_value_as_it_names_a_bad_flag(flags, capsys):
    """The server's checks after argparse's printed serve.py's 40-line usage and `serve.py: error:`."""
    with pytest.raises(SystemExit) as e:
        main(["serve", *flags])
    usage, said = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and usage == "usage: jaxinfer serve [MODEL] [options]"
    assert said.startswith("jaxinfer serve: error: ") and flags[0] in said


def test_bad_values_and_missing_models_are_one_line_errors(tmp_path, capsys):
    assert main(["generate", "--prompt", "x", "--temperature", "-1"]) == 2  # before any model loads
    assert "jaxinfer generate: error: temperature must be >= 0" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("jaxinfer convert: ModelNotFoundError:") and "nowhere" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "flags, says",
    [(["--model", "{junk}"], "not a readable GGUF"), (["--gpu-memory-utilization", "2"], "gpu_memory_utilization"),
     (["--tensor-parallel-size", "3"], "tensor"), (["--device", "tpu"], "tpu"),
     (["--tokenizer", "/no/such/dir"], "tokenizer: model path '/no/such/dir' does not exist")],
)  # fmt: skip
def test_generate_names_a_bad_model_file_or_setting_in_one_line(tmp_path, capsys, flags, says):
    """Each of these printed a 40-65 line traceback (and an AttributeError from LLM.__del__ after it)."""
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    rc = main(["generate", "--prompt", "x", *(f.format(junk=junk) for f in flags)])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("jaxinfer generate: ") and len(err.strip().splitlines()) == 1, err
    assert says in err


def test_generate_prints_what_llm_generates(tiny_model, capsys):
    from jaxinfer import LLM, SamplingParams
    from tests.tiny_model import SETTINGS, settings_flags

    flags = settings_flags()
    prompts = ["Hello there", "The capital of France is"]
    assert main(["generate", "--model", tiny_model, "--no-chat", "--max-tokens", "6", *flags,
                 *(a for p in prompts for a in ("--prompt", p))]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    with LLM(tiny_model, **SETTINGS) as llm:
        refs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    assert printed == "".join(f"### {p}\n{r.outputs[0].text}\n\n" for p, r in zip(prompts, refs, strict=True))
    # The sampling flags reach the request: top_k 1 samples greedily at any temperature, and a stop string cuts.
    text = refs[0].outputs[0].text
    cut = next(i for i in range(1, len(text)) if not text[i].isspace())  # a stop string inside the answer
    assert main(["generate", "--model", tiny_model, "--no-chat", "--max-tokens", "6", *flags, "--prompt", prompts[0],
                 "--temperature", "1.5", "--top-k", "1", "--stop", text[cut:]]) == 0  # fmt: skip
    assert capsys.readouterr().out == f"### {prompts[0]}\n{text[:cut]}\n\n"
    # A prompt the context cannot hold: the prompt's problem, named in one line, not a traceback.
    assert main(["generate", "--model", tiny_model, "--no-chat", *flags, "--prompt", "word " * 400]) == 1
    err = capsys.readouterr().err
    assert err.startswith("jaxinfer generate: ValueError: prompt:") and len(err.strip().splitlines()) == 1, err


def test_generate_reads_a_prompts_file_and_writes_json_lines(tiny_model, tmp_path, capsys, monkeypatch):
    """--prompts-file: text lines, and JSON lines holding a prompt, token ids or a conversation (each through the
    chat template, whatever --chat says); --output-json: one object a prompt, in the file's order, as LLM gives."""
    import io

    from jaxinfer import LLM, SamplingParams
    from tests.tiny_model import SETTINGS, settings_flags

    ids = [504, 3458, 314]
    convo = [{"role": "user", "content": "Name a colour."}]
    lines = ["Hello there", "", json.dumps({"prompt_token_ids": ids}), json.dumps({"messages": convo}),
             json.dumps({"prompt": "line one\nline two"})]  # fmt: skip
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    flags = ["generate", "--model", tiny_model, "--no-chat", "--max-tokens", "5", *settings_flags()]
    assert main([*flags, "--prompts-file", str(tmp_path / "prompts.jsonl"), "--output-json", "-"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    g = SamplingParams(max_tokens=5, temperature=0)
    with LLM(tiny_model, **SETTINGS) as llm:
        refs = llm.generate(["Hello there", {"prompt_token_ids": ids}], g, use_tqdm=False)
        refs.insert(2, llm.chat(convo, g, use_tqdm=False)[0])
        refs += llm.generate(["line one\nline two"], g, use_tqdm=False)
    assert [r["outputs"][0]["token_ids"] for r in rows] == [list(r.outputs[0].token_ids) for r in refs]
    assert [r["prompt_token_ids"] for r in rows] == [list(r.prompt_token_ids) for r in refs]
    assert rows[0]["prompt"] == "Hello there" and rows[0]["outputs"][0]["finish_reason"] in ("length", "stop")
    # Standard input, and the text output heads each answer with its prompt.
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\n"))
    assert main([*flags, "--prompts-file", "-"]) == 0
    assert capsys.readouterr().out == f"### Hello there\n{refs[0].outputs[0].text}\n\n"
    # A line that is not a prompt is named by file and line, before the model loads.
    (tmp_path / "bad.jsonl").write_text('Hi\n{"text": "x"}\n')
    assert main([*flags, "--prompts-file", str(tmp_path / "bad.jsonl")]) == 1
    assert "bad.jsonl:2: expected" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("gen", "flags", "want"),
    [
        ({}, [], {"temperature": 0.0, "top_p": 1.0, "top_k": 0}),  # no generation config: greedy
        ({"temperature": 0.7, "top_p": 0.8, "top_k": 5}, [], {"temperature": 0.7, "top_p": 0.8, "top_k": 5}),
        (
            {"temperature": 0.7, "top_p": 0.8},
            ["--temperature", "0", "--top-p", "0.5"],
            {"temperature": 0.0, "top_p": 0.5},
        ),
    ],
)
def test_generate_falls_back_to_the_models_generation_config(tiny_model, tmp_path, monkeypatch, gen, flags, want):
    """An unset sampling flag takes the model's generation_config.json value, as the server fills a request; only
    where neither sets a temperature does generate answer greedily."""
    import shutil

    from jaxinfer import LLM
    from tests.tiny_model import settings_flags

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    if gen:
        (model / "generation_config.json").write_text(json.dumps(gen))
    seen = []
    real = LLM.generate

    def spy(self, prompts, sampling_params=None, **kw):
        seen.append(sampling_params)
        return real(self, prompts, sampling_params, **kw)

    monkeypatch.setattr(LLM, "generate", spy)
    assert main(["generate", "--model", str(model), "--no-chat", "--max-tokens", "2", *settings_flags(), *flags,
                 "--prompt", "Hi"]) == 0  # fmt: skip
    assert {k: getattr(seen[0], k) for k in want} == want


def test_the_reference_generator_names_a_bad_model_in_one_line(capsys):
    """`python -m jaxinfer.generate` (the contiguous-cache reference's CLI) printed a traceback for a bad preset."""
    from jaxinfer.generate import main as reference_main

    assert reference_main(["--prompt", "x", "--model", "no-such-preset"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("python -m jaxinfer.generate: ModelNotFoundError: ") and len(err.splitlines()) == 1, err


def test_complete_quick_streams_the_servers_completion(live_server):
    import httpx

    from tests.cli.conftest import MODEL_NAME
    from tests.server.conftest import API_KEY

    prompt = "Once upon a time"
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    ref = httpx.post(f"{live_server.url}/v1/completions", json=body, headers=live_server.headers, timeout=120)
    out = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "complete", "--url", f"{live_server.url}/v1",
                          "--api-key", API_KEY, "--max-tokens", "8", "-q", prompt], env=REPO_ENV, capture_output=True,
                         text=True, timeout=120, check=True)  # fmt: skip
    assert out.stdout == ref.json()["choices"][0]["text"] + "\n"


class _CutStream(http.server.BaseHTTPRequestHandler):
    """An OpenAI server that dies mid-answer: two chunks of a stream, then the connection closes (no [DONE])."""

    def do_GET(self):  # /v1/models
        body = json.dumps({"data": [{"id": "m"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for text in ("Once upon", " a time"):
            choice = {"index": 0, "delta": {"content": text}, "text": text}
            self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("command", ["chat", "complete"])
def test_an_answer_cut_short_by_the_server_is_an_error(command, capsys):
    """It printed the half answer and exited 0 (and chat kept it in the history)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CutStream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rc = main([command, "--url", f"http://127.0.0.1:{server.server_port}/v1", "-q", "hi"])
    except Exception as e:  # main lets only bugs through
        raise AssertionError(f"not a one-line error: {e!r}") from e
    finally:
        server.shutdown()
    captured = capsys.readouterr()
    assert rc == 1 and "Once upon a time" in captured.out
    assert "closed the stream before it ended" in captured.err and len(captured.err.strip().splitlines()) == 1


def test_ctrl_c_stops_an_answer_not_the_session(capsys):
    from jaxinfer.cli import _turn

    def answer():
        yield "Once"
        raise KeyboardInterrupt

    assert _turn(argparse.Namespace(quick=None), answer()) is None  # the loop goes on to the next message
    assert "[interrupted]" in capsys.readouterr().err
    with pytest.raises(KeyboardInterrupt):  # with -q there is no session to go back to
        _turn(argparse.Namespace(quick="hi"), answer())


def test_version_and_the_defaults_help_shows(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("jaxinfer ")
    formatter = DefaultsFormatter(prog="x")
    for name in ("serve", "generate"):
        actions = [a for a in _subparser(name)._actions if a.option_strings]
        flags = {a.option_strings[-1]: formatter._get_help_string(a) for a in actions}
        # "--no-compilation-cache ... (default: True)" read as if the flag were on; "built-in defaults" hid auto.
        assert flags["--no-compilation-cache"].endswith("(default: not given)")
        assert flags["--generation-config"].endswith("(default: %(default)s)")
        assert flags["--no-enable-prefix-caching"] == "turn the prefix cache off (default: not given)"
