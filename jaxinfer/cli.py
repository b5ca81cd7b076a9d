"""The `jaxinfer` command, on the model of vLLM's CLI:

    jaxinfer serve [MODEL] [flags]        the OpenAI-compatible server (what `python serve.py` runs)
    jaxinfer generate --prompt TEXT ...   offline batch generation with the paged engine
    jaxinfer chat [--url URL]             interactive, streaming chat against a running server
    jaxinfer complete [--url URL]         interactive, streaming completions against a running server
    jaxinfer bench {offline,serving,latency} ...   the benchmarks in benchmarks/ (a source checkout)
    jaxinfer convert SRC DST              write a model as an orbax checkpoint
    jaxinfer env                          versions, backend and devices, for bug reports

`jaxinfer SUBCOMMAND --help` lists every flag with its default. Imports of jax live inside the subcommands, so
`--help`, `chat` and `complete` start at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import importlib
import json
import logging
import os
import platform
import re
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from jaxinfer.engine.config import EngineArgs
from jaxinfer.errors import user_errors
from jaxinfer.server.args import ServerArgs, add_engine_flags, make_parser, parse_args

PROG = "jaxinfer"
DEFAULT_URL = "http://localhost:8000/v1"
BENCHMARKS = {
    "offline": ("benchmarks.bench_offline", "offline throughput against the references"),
    "serving": ("benchmarks.bench_serving", "online serving: request rate, TTFT, ITL against the references"),
    "latency": ("benchmarks.bench_latency", "one batch's prefill and decode latency against the roofline"),
}
# Flags the server's parser leaves without a help text: said here, so that --help explains every flag.
_MISSING_HELP = {
    "host": "address to listen on",
    "port": "port to listen on",
    "dtype": "dtype of the weights and the KV cache",
    "enable_prefix_caching": "turn the prefix cache off",
    "log_level": "logging level",
}


class DefaultsFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends `(default: X)` to every flag's help unless the help already speaks of its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        # "(default" / "default:": a text that names its default itself ("built-in defaults" does not).
        if "(default" in text.lower() or "default:" in text.lower() or action.default is argparse.SUPPRESS:
            return text
        if isinstance(action, argparse._StoreFalseAction):  # --no-X: "(default: True)" read as if it were on
            return f"{text} (default: not given)".strip()
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)".strip()
        return text


def _fill_missing_help(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if not action.help and action.dest != "help":
            action.help = _MISSING_HELP.get(action.dest, action.dest.replace("_", " "))


# ---------------------------------------------------------------------------------------------- serve


def run_server(args: ServerArgs) -> int:
    """What `python serve.py` and `jaxinfer serve` run: the HTTP server, the model loading behind it."""
    from jaxinfer.server.keys import defer_hangups

    defer_hangups()  # a key reload (SIGHUP) during the start would otherwise end the process
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level != "debug":
        logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every restore step at info
    if args.num_processes > 1 or args.coordinator_address:
        from jaxinfer import distributed

        distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
        if not distributed.is_lead():
            # A follower serves no HTTP: it loads its shards and runs every step the lead announces.
            from jaxinfer.engine.build import build_engine  # not before: jax and orbax load only where needed

            engine, _ = build_engine(args)
            distributed.follow(engine.runner)
            return 0
    engine = None
    if args.separate_engine_process:
        # The engine's process first: its start (imports, weights, compiled steps) then overlaps the app's imports
        # below (fastapi and the handlers, ~0.4 s), which it waited for when the app's lifespan started it.
        from jaxinfer.engine.mp_engine import MPAsyncEngine

        engine = MPAsyncEngine(args)
    from jaxinfer.server.app import build_app
    from jaxinfer.server.http import serve

    try:
        return serve(build_app(args, engine=engine), args)
    finally:
        if engine is not None:  # stopped already by the app's shutdown, unless the app never ran (a bad flag, a port
            engine.shutdown()  # in use): then the process that loads for nobody is stopped here


def _add_serve(sub: argparse._SubParsersAction) -> None:
    server = make_parser()
    _fill_missing_help(server)
    p = sub.add_parser(
        "serve",
        parents=[server],
        add_help=False,  # the server's parser brings -h
        formatter_class=DefaultsFormatter,
        help="serve a model with the OpenAI-compatible API",
        description="OpenAI-compatible HTTP server. `jaxinfer serve MODEL` is `--model MODEL`; /health answers 503"
        " until the model is loaded and its step buckets are compiled, then 200 (the mixed steps of few rows and the"
        " rarer sampling variants are compiled, or loaded from the cache, afterwards while the engine is idle).",
        usage="jaxinfer serve [MODEL] [options]",
    )
    p.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="same as --model, given first (default: --model's)"
    )
    p.set_defaults(run=_serve, parser=p)  # server_args reports the server's own checks with it


def server_args(rest: list[str]) -> ServerArgs:
    """`jaxinfer serve` arguments (after `serve`) as ServerArgs, through the server's own parser and checks."""
    ns = make_cli_parser().parse_args(["serve", *rest])
    if ns.model_tag is not None:
        if rest[:1] != [ns.model_tag]:
            raise SystemExit(f"{PROG} serve: give MODEL right after `serve` ({ns.model_tag!r} came later)")
        if "--model" in rest:
            raise SystemExit(f"{PROG} serve: give the model either as MODEL or as --model, not both")
        rest = ["--model", ns.model_tag, *rest[1:]]
    return parse_args(rest, reporter=ns.parser)  # `jaxinfer serve`'s short usage and name, not serve.py's


def _serve(ns: argparse.Namespace, rest: list[str]) -> int:
    return run_server(server_args(rest))


# ---------------------------------------------------------------------------------------------- generate


def _add_sampling_flags(p: argparse.ArgumentParser, max_tokens: int, local: bool = False) -> None:
    """`local`: generate, which holds the model, so an unset flag falls back to its generation config (as the
    server fills a request); its --seed is the engine's (from the engine flags). chat and complete send what is
    given, greedy unless --temperature says otherwise."""
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="most new tokens per answer")
    if local:
        p.add_argument("--temperature", type=float, default=None,
                       help="0: greedy (default: the model's generation config, else 0)")  # fmt: skip
        p.add_argument("--top-p", type=float, default=None,
                       help="nucleus sampling mass (default: the model's generation config, else 1.0)")  # fmt: skip
    else:
        p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
        p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    unset = "(default: the model's generation config, else off)"
    p.add_argument("--top-k", type=int, default=None, help=f"sample among the k most likely tokens {unset}")
    p.add_argument(
        "--min-p", type=float, default=None, help=f"drop tokens below min_p x the top one's probability {unset}"
    )
    p.add_argument("--repetition-penalty", type=float, default=None, help=f"> 1 discourages repeats {unset}")
    p.add_argument(
        "--stop", action="append", default=None, help="a stop string; repeat the flag for more (default: none)"
    )
    if not local:
        p.add_argument("--seed", type=int, default=None, help="sampling seed (default: none)")


def _sampling_fields(ns: argparse.Namespace, with_seed: bool = True) -> dict:
    """The sampling flags as SamplingParams fields, which are also the request's fields (vLLM's names). Flags not
    given are left out. `with_seed=False` for generate, whose --seed is the engine's."""
    fields = {"max_tokens": ns.max_tokens}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop",
                 *(("seed",) if with_seed else ())):  # fmt: skip
        if getattr(ns, name, None) is not None:
            fields[name] = getattr(ns, name)
    return fields


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        formatter_class=DefaultsFormatter,
        help="generate offline for a batch of prompts",
        description="Offline batch generation with the `LLM` API (paged engine, continuous batching).",
    )
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", action="append", help="a prompt; repeat the flag for a batch")
    given.add_argument(
        "--prompts-file",
        metavar="FILE",
        help="prompts, one a line ('-': standard input); a line that is a JSON object is {\"prompt\": TEXT}, "
        '{"prompt_token_ids": [...]} or {"messages": [...]} (a conversation)',
    )
    p.add_argument("--n", type=int, default=1, help="answers per prompt")
    p.add_argument(
        "--output-json",
        metavar="FILE",
        help="write the results as JSON Lines, one object a prompt in order ('-': standard output), instead of text",
    )
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="send each prompt as a user message through the chat template (default: when the model has one)",
    )
    _add_sampling_flags(p, max_tokens=64, local=True)
    add_engine_flags(p)
    _fill_missing_help(p)
    p.set_defaults(run=_generate)


def _generate(ns: argparse.Namespace, rest: list[str]) -> int:
    from jaxinfer import LLM, SamplingParams

    fields = {"n": ns.n, **_sampling_fields(ns, with_seed=False)}
    try:
        SamplingParams(**fields)
    except ValueError as e:  # checked before the model loads, and named as argparse names a bad flag
        print(f"{PROG} generate: error: {e}", file=sys.stderr)
        return 2
    prompts = _read_prompts(ns)  # before the model loads: a bad file is named at once
    settings = dataclasses.asdict(EngineArgs.from_mapping(vars(ns)))
    with LLM(settings.pop("model"), **settings) as llm:
        # The flags given, over the model's generation config (--generation-config): as the server fills a request.
        # Where neither sets a temperature, the CLI answers greedily (SamplingParams' own default is vLLM's 1.0).
        if "temperature" not in fields and "temperature" not in llm.engine.sampling_defaults:
            fields["temperature"] = 0.0
        sp = dataclasses.replace(llm.get_default_sampling_params(), **fields)
        chat = llm.tokenizer.chat_template is not None if ns.chat is None else ns.chat
        labels = [_label(p) for p in prompts]
        prompts = [{"messages": [{"role": "user", "content": p["prompt"]}]} if chat and set(p) == {"prompt"} else p
                   for p in prompts]  # fmt: skip
        # A prompt's own problem (too long, no chat template) is a ValueError: main names it in one line.
        convs = [i for i, p in enumerate(prompts) if "messages" in p]
        outs: list = [None] * len(prompts)
        if convs:
            for i, out in zip(convs, llm.chat([prompts[i]["messages"] for i in convs], sp), strict=True):
                outs[i] = out
        rest = [i for i in range(len(prompts)) if outs[i] is None]
        if rest:
            for i, out in zip(rest, llm.generate([prompts[i] for i in rest], sp), strict=True):
                outs[i] = out
    if ns.output_json is not None:
        _write_json_lines(ns.output_json, outs)
        return 0
    for label, out in zip(labels, outs, strict=True):
        print(f"### {label}")
        for c in out.outputs:
            if len(out.outputs) > 1:  # --n: each answer under its own line, so multi-line answers stay apart
                print(f"## answer {c.index + 1}")
            print(c.text)
        print()
    return 0


def _read_prompts(ns: argparse.Namespace) -> list[dict]:
    """The prompts, each as LLM.generate takes a dict ({"prompt"} or {"prompt_token_ids"}) or {"messages"}."""
    if ns.prompt is not None:
        return [{"prompt": p} for p in ns.prompt]
    if ns.prompts_file == "-":
        lines = sys.stdin.read().splitlines()
    else:
        lines = Path(ns.prompts_file).read_text(encoding="utf-8").splitlines()  # OSError: main names it
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            prompts.append({"prompt": line})
            continue
        where = f"{ns.prompts_file}:{n}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e})") from None
        keys = set(item) if isinstance(item, dict) else set()
        if keys not in ({"prompt"}, {"prompt_token_ids"}, {"prompt", "prompt_token_ids"}, {"messages"}):
            raise ValueError(f"{where}: expected {{\"prompt\": ...}}, {{\"prompt_token_ids\": [...]}} or "
                             f"{{\"messages\": [...]}}, got {line.strip()[:80]}")  # fmt: skip
        prompts.append(item)
    if not prompts:
        raise ValueError(f"{ns.prompts_file}: no prompts")
    return prompts


def _label(prompt: dict) -> object:
    """What the text output heads a prompt's answers with: its text, its ids, or a conversation's last message."""
    if "messages" not in prompt:
        return prompt.get("prompt", prompt.get("prompt_token_ids"))
    last = prompt["messages"][-1] if isinstance(prompt["messages"], list) and prompt["messages"] else None
    return last.get("content") if isinstance(last, dict) else "(a conversation)"


def _write_json_lines(path: str, outs: list) -> None:
    rows = (json.dumps({
        "prompt": out.prompt,
        "prompt_token_ids": out.prompt_token_ids,
        "outputs": [{"index": c.index, "text": c.text, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
                     "stop_reason": c.stop_reason} for c in out.outputs],
    }, ensure_ascii=False) for out in outs)  # fmt: skip
    if path == "-":
        sys.stdout.writelines(row + "\n" for row in rows)
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(row + "\n" for row in rows)


# ---------------------------------------------------------------------------------------------- chat / complete


class ServerError(RuntimeError):
    """The server could not be reached or refused a request (the message says which and why)."""


class ServerClient:
    """The little of the OpenAI API that chat and complete need, over urllib (no client library required)."""

    def __init__(self, url: str, api_key: str | None):
        self.url = url.rstrip("/")
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def _open(self, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=self.headers)
        try:
            return urllib.request.urlopen(req, timeout=600)
        except urllib.error.HTTPError as e:
            raise ServerError(f"{self.url}{path} answered {e.code}: {e.read().decode(errors='replace')}") from e
        except urllib.error.URLError as e:
            raise ServerError(f"cannot reach {self.url} ({e.reason}); is `jaxinfer serve` running?") from e

    def first_model(self) -> str:
        with self._open("/models") as r:
            return json.load(r)["data"][0]["id"]

    def stream(self, path: str, body: dict, delta: Callable[[dict], str]) -> Iterator[str]:
        """POSTs with stream=True and yields each text delta as it arrives (server-sent events). A stream that ends
        before its [DONE] (the server died or dropped the connection) is a ServerError, not a short answer."""
        with self._open(path, {**body, "stream": True}) as r:
            try:
                for raw in r:
                    line = raw.decode(errors="replace").strip()
                    if not line.startswith("data:"):
                        continue
                    payload = line[len("data:") :].strip()
                    if payload == "[DONE]":
                        return
                    event = json.loads(payload)
                    if "error" in event:
                        raise ServerError(f"the server failed the request: {event['error'].get('message')}")
                    for choice in event.get("choices", []):
                        text = delta(choice)
                        if text:
                            yield text
            except (OSError, http.client.HTTPException) as e:
                raise ServerError(f"the connection to {self.url} broke mid-answer: {e}") from e
        raise ServerError(f"{self.url} closed the stream before it ended (no [DONE]): the answer is cut short")


def _add_client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help="the server's OpenAI API base URL")
    p.add_argument("--model-name", default=None, help="model to ask for (default: the server's first model)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="(default: $OPENAI_API_KEY)")
    p.add_argument("-q", "--quick", metavar="MESSAGE", default=None, help="send one message, print the answer, exit")
    _add_sampling_flags(p, max_tokens=256)


def _add_chat(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat",
        formatter_class=DefaultsFormatter,
        help="chat with a running server, streaming",
        description="Interactive chat against a running server. The conversation is kept and sent with every turn;"
        " type /reset to start over (the system prompt stays), /exit or Ctrl-D to leave; Ctrl-C stops an answer."
        " Reading from a pipe, exits 1 when an answer failed.",
    )
    p.add_argument("--system-prompt", default=None, help="a system message that opens the conversation")
    _add_client_flags(p)
    p.set_defaults(run=_chat)


def _add_complete(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "complete",
        formatter_class=DefaultsFormatter,
        help="complete prompts with a running server, streaming",
        description="Interactive completions against a running server: each line you type is a prompt; Ctrl-C stops"
        " an answer. Reading from a pipe, exits 1 when an answer failed.",
    )
    _add_client_flags(p)
    p.set_defaults(run=_complete)


def _sampling_body(ns: argparse.Namespace, model: str) -> dict:
    return {"model": model, **_sampling_fields(ns)}


def _check_sampling(ns: argparse.Namespace) -> None:
    """The sampling flags, checked before anything is sent, as `generate` checks them (a NaN is not even JSON)."""
    from jaxinfer.types import SamplingParams

    try:
        SamplingParams(**_sampling_fields(ns))
    except ValueError as e:
        print(f"{PROG} {ns.command}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None  # as argparse exits for a bad flag


def _print_stream(pieces: Iterator[str]) -> str:
    text = []
    try:
        for piece in pieces:
            text.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()  # one write per token: the user sees the answer as it is generated
    finally:
        pieces.close()  # Ctrl-C or an error: the connection closes, so the server stops generating
        sys.stdout.write("\n")
        sys.stdout.flush()
    return "".join(text)


def _turn(ns: argparse.Namespace, pieces: Iterator[str]) -> str | None:
    """Streams one answer; in the interactive loop a failed or interrupted one is reported and gives None (the loop
    goes on), with -q it raises."""
    try:
        return _print_stream(pieces)
    except ServerError as e:
        if ns.quick is not None:
            raise
        print(f"[error: {e}]", file=sys.stderr)
    except KeyboardInterrupt:  # as llama.cpp's chat: Ctrl-C stops the answer, not the session
        if ns.quick is not None:
            raise
        print("[interrupted]", file=sys.stderr)
    return None


def _prompts(quick: str | None) -> Iterator[str]:
    if quick is not None:
        yield quick
        return
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip():
            yield line


def _exit_code(failed: int) -> int:
    """1 when an answer failed and the messages came from a pipe (a script must see it); a person at the terminal
    saw each error where it happened."""
    return 1 if failed and not sys.stdin.isatty() else 0


def _chat(ns: argparse.Namespace, rest: list[str]) -> int:
    _check_sampling(ns)
    client = ServerClient(ns.url, ns.api_key)
    model = ns.model_name or client.first_model()
    system = [{"role": "system", "content": ns.system_prompt}] if ns.system_prompt else []
    history = list(system)
    if ns.quick is None:
        print(f"Chatting with {model} at {ns.url}. /reset starts over, /exit or Ctrl-D leaves.")
    failed = 0
    for line in _prompts(ns.quick):
        if line.strip() == "/reset":
            history = list(system)
            print("(history cleared)")
            continue
        body = {**_sampling_body(ns, model), "messages": [*history, {"role": "user", "content": line}]}
        answer = _turn(ns, client.stream("/chat/completions", body, lambda c: c.get("delta", {}).get("content")))
        if answer is None:
            failed += 1
            print("(the message was not added to the history)", file=sys.stderr)
            continue
        history += [{"role": "user", "content": line}, {"role": "assistant", "content": answer}]
    return _exit_code(failed)


def _complete(ns: argparse.Namespace, rest: list[str]) -> int:
    _check_sampling(ns)
    client = ServerClient(ns.url, ns.api_key)
    model = ns.model_name or client.first_model()
    failed = 0
    for prompt in _prompts(ns.quick):
        body = {**_sampling_body(ns, model), "prompt": prompt}
        failed += _turn(ns, client.stream("/completions", body, lambda c: c.get("text"))) is None
    return _exit_code(failed)


# ---------------------------------------------------------------------------------------------- bench / convert


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        formatter_class=DefaultsFormatter,
        help="run a benchmark (from a source checkout)",
        description="Runs a script of benchmarks/ with the flags that follow; `jaxinfer bench KIND --help` lists"
        " them. The benchmarks live in the repository, not in the installed package: run from a checkout.",
    )
    p.add_argument("kind", choices=sorted(BENCHMARKS), help="; ".join(f"{k}: {v[1]}" for k, v in BENCHMARKS.items()))
    p.set_defaults(run=_bench, passthrough=True)


def _bench(ns: argparse.Namespace, rest: list[str]) -> int:
    module = BENCHMARKS[ns.kind][0]
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "benchmarks").is_dir() and str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name not in ("benchmarks", module):
            raise
        raise SystemExit(f"{PROG} bench: {module} not found; run from a jaxinfer source checkout") from e
    return int(mod.main(rest) or 0)


def _add_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        formatter_class=DefaultsFormatter,
        help="convert a model (GGUF, HF directory, preset) to an orbax checkpoint",
        description="Writes SRC as an orbax checkpoint that --model DST then restores without converting.",
    )
    p.add_argument("src", help="preset name, GGUF file or HF directory")
    p.add_argument("dst", help="output checkpoint directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="stored dtype")
    p.set_defaults(run=_convert)


def _convert(ns: argparse.Namespace, rest: list[str]) -> int:
    from jaxinfer.weights.convert import main as convert_main

    return convert_main([ns.src, ns.dst, "--dtype", ns.dtype])


# ---------------------------------------------------------------------------------------------- env


ENV_PACKAGES = (
    "jaxinfer", "jax", "jaxlib", "flax", "orbax-checkpoint", "numpy", "tokenizers", "gguf", "fastapi", "uvicorn",
    "pyzmq", "torch", "transformers", "libtpu", "jax-cuda12-plugin", "jax-cuda13-plugin",
)  # fmt: skip


# Variables a bug report names but must not quote: JAXINFER_API_KEY (the server's key) and its kind.
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)


def collect_env() -> dict:
    """What a bug report needs: versions, the backend and its devices, and the settings that change behaviour."""
    from importlib.metadata import PackageNotFoundError, version

    def ver(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    info: dict = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {name: v for name in ENV_PACKAGES if (v := ver(name)) is not None},
        "env": {
            k: "<redacted>" if _SECRET_NAME.search(k) else v
            for k, v in sorted(os.environ.items())
            if k.startswith(("JAX", "XLA", "CUDA_VISIBLE", "TPU"))
        },
    }
    try:
        import jax

        info["backend"] = jax.default_backend()
        info["process_count"] = jax.process_count()
        info["devices"] = [
            {"id": d.id, "kind": d.device_kind, "platform": d.platform, "memory_bytes": (d.memory_stats() or {}).get(
                "bytes_limit")}
            for d in jax.devices()
        ]  # fmt: skip
    except RuntimeError as e:  # no backend could start: that is what the report must say
        info["backend_error"] = str(e)
    return info


def _add_env(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "env",
        formatter_class=DefaultsFormatter,
        help="print versions, backend and devices (for bug reports)",
        description="Prints what a bug report needs: Python, package versions, the jax backend and its devices.",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(run=_env)


def _env(ns: argparse.Namespace, rest: list[str]) -> int:
    info = collect_env()
    if ns.json:
        print(json.dumps(info, indent=2))
        return 0
    for key in ("python", "platform", "backend", "backend_error", "process_count"):
        if key in info:
            print(f"{key:14} {info[key]}")
    for d in info.get("devices", []):
        mem = f", {d['memory_bytes'] / 2**30:.1f} GiB" if d["memory_bytes"] else ""
        print(f"{'device ' + str(d['id']):14} {d['kind']} ({d['platform']}{mem})")
    for name, v in info["packages"].items():
        print(f"{name:14} {v}")
    for k, v in info["env"].items():
        print(f"{k}={v}")
    return 0


# ---------------------------------------------------------------------------------------------- main


def make_cli_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0], formatter_class=DefaultsFormatter)
    p.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_serve, _add_generate, _add_chat, _add_complete, _add_bench, _add_convert, _add_env):
        add(sub)
    return p


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jaxinfer")
    except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        return "(not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_cli_parser()
    if argv[:1] == ["bench"] and len(argv) >= 2:
        # `bench KIND ...`: everything after KIND (--help included) belongs to the benchmark's own parser.
        ns = parser.parse_args(argv[:2])
        return ns.run(ns, argv[2:])
    ns = parser.parse_args(argv)
    rest = argv[1:] if ns.command == "serve" else []
    try:
        return ns.run(ns, rest)
    except Exception as e:
        if not isinstance(e, (ServerError, *user_errors())):  # a server's answer is not our bug either
            raise  # a bug: its traceback
        print(f"{PROG} {ns.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
