"""Command-line flags of the OpenAI-compatible server, under vLLM's names where vLLM has one."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from jaxinfer.device import DEVICE_ENV, DEVICES, DTYPES, KV_CACHE_DTYPES
from jaxinfer.engine.config import (
    BATCH_DEFAULTS,
    DEFAULT_MAX_MODEL_LEN_CAP,
    GENERATION_CONFIGS,
    LAYER_LOOPS,
    EngineArgs,
)

API_KEY_ENV = "JAXINFER_API_KEY"
CHAT_TRUNCATION = ("off", "oldest")  # jaxinfer.server.truncation
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "none")  # jaxinfer.server.tool_parsers


@dataclass(frozen=True)
class ServerArgs(EngineArgs):
    """The engine's settings (EngineArgs: model, dtype, max_num_seqs, ...) and the HTTP server's own."""

    served_model_name: list[str] = field(default_factory=list)  # empty: the --model string
    host: str = "127.0.0.1"
    port: int = 8000
    # Origins a browser may call the API from (CORS); ["*"]: any, as vLLM's and llama.cpp's servers allow; []: none.
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    api_key: str | None = None
    api_keys_file: str | None = None  # JSON Lines of keys with limits (jaxinfer.server.keys), reloaded on SIGHUP
    access_log: bool = True
    access_log_file: str | None = None
    otlp_traces_endpoint: str | None = None
    max_waiting: int | None = None
    log_level: str = "info"
    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int | None = None
    graceful_shutdown_timeout: float = 30.0
    max_body_bytes: int = 4 * 2**20
    # Fan-out caps: what one request may make the server hold (each past its cap is a 400 naming the parameter).
    max_n: int = 128  # samples per prompt (OpenAI's own bound)
    max_prompts: int = 256  # prompts in one /v1/completions request
    max_stop: int = 16  # stop strings
    max_stop_len: int = 256  # characters in one stop string
    max_stop_token_ids: int = 256
    # A stream whose client stops reading (without disconnecting) is aborted after this many seconds without
    # progress, or once this many outputs wait for it: its KV pages and buffered output cannot pile up.
    stream_stall_timeout: float = 60.0
    max_stream_buffer: int = 1024
    tokenizer_threads: int = 4  # tokenization, chat templates and validation off the event loop
    engine_process: bool = True  # the engine core in its own process (ignored with an injected loader)
    tool_call_parser: str = "auto"  # tool_choice "auto": the format of the model's calls (TOOL_CALL_PARSERS)
    chat_truncation: str = "off"  # "oldest": drop a chat's oldest turns instead of a 400 when it does not fit
    filters_config: str | None = None  # JSON file of input/output content filters (jaxinfer.server.filters)

    @property
    def model_names(self) -> list[str]:
        return self.served_model_name or [self.model]

    @property
    def separate_engine_process(self) -> bool:
        """Whether the real engine runs in a process of its own: unless --no-engine-process, or several hosts (the
        lead's runner talks to the followers from the server's process)."""
        return self.engine_process and self.num_processes == 1 and self.coordinator_address is None


def _int_at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {value}")
        return value

    return parse


_positive_int, _non_negative_int = _int_at_least(1), _int_at_least(0)
# 0: any free port. (The socket layer took 99999 as 99999 mod 65536 and listened on 34463.)
_port = _int_at_least(0, 65535)


def _per_backend(i: int) -> str:
    return ", ".join(f"{backend} {limits[i]}" for backend, limits in BATCH_DEFAULTS.items())


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _bytes(zero_turns_off: bool = False) -> Callable[[str], int]:
    """A byte-size flag's type: an int or text like 4GiB (jaxinfer.cache.sizing); 0 too when it turns a thing off."""

    def parse(text: str) -> int:
        from jaxinfer.cache.sizing import parse_bytes, parse_size

        try:  # unnamed: argparse says "argument --flag: " before the message
            return int(parse_size(text, None) if zero_turns_off else parse_bytes(text, None))
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The flags of EngineArgs (what `LLM(...)` takes), with its defaults: shared by `serve` and `generate`."""
    D = EngineArgs
    p.add_argument(
        "--model",
        default=D.model,
        help="preset name, .gguf file, HF directory, checkpoint, or pkg.module:build (a model of your own)",
    )
    p.add_argument("--tokenizer", default=D.tokenizer,
                   help="model name or path to read the tokenizer from (default: the model's own)")  # fmt: skip
    p.add_argument("--chat-template", default=D.chat_template, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template, or a file holding one, instead of the model's (a base model has "
                   "none) (default: the model's)")  # fmt: skip
    p.add_argument(
        "--dtype",
        default=D.dtype,
        choices=DTYPES,
        help="weights and activations; auto: float32 on CPU, the checkpoint's (or bfloat16) on GPU/TPU",
    )
    p.add_argument("--kv-cache-dtype", default=D.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="KV cache; auto: as --dtype, but on CPU float16 for a float32 --dtype and float32 for a "
                        "16-bit one")  # fmt: skip
    p.add_argument(
        "--device",
        default=D.device,
        choices=DEVICES,
        help=f"fail at start-up unless jax runs on this backend (default: ${DEVICE_ENV}, else JAX_PLATFORMS's first)",
    )
    p.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=D.max_model_len,
        help=f"context length (default: the model's, capped at {DEFAULT_MAX_MODEL_LEN_CAP})",
    )
    p.add_argument("--max-num-seqs", type=_positive_int, default=D.max_num_seqs,
                   help=f"sequences decoded together (default per backend: {_per_backend(0)})")  # fmt: skip
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=D.max_num_batched_tokens,
                   help=f"token budget of one step (default per backend: {_per_backend(1)})")  # fmt: skip
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=D.gpu_memory_utilization,
        help="fraction of the free device memory given to the KV cache",
    )
    p.add_argument(
        "--num-kv-tokens",
        type=_positive_int,
        default=D.num_kv_tokens,
        help="explicit KV pool size in tokens (overrides --gpu-memory-utilization)",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=_bytes(),
        default=D.kv_cache_memory,
        help="most KV cache bytes per device, e.g. 4GiB or 2000000000 (CPU default: what the scheduler can "
        "address, at most 1.5GiB)",
    )
    p.add_argument("--block-size", type=_positive_int, default=D.block_size, help="tokens per KV page")
    sessions = p.add_argument_group(
        "sessions (a request's X-Session-Id header, else its `user` field, keeps the conversation's KV pages)"
    )
    sessions.add_argument(
        "--session-ttl",
        type=_positive_float,
        default=D.session_ttl,
        help="seconds a finished turn's KV pages stay pinned for the session's next turn",
    )
    sessions.add_argument(
        "--session-cache-pages",
        type=_non_negative_int,
        default=D.session_cache_pages,
        help="most KV pages all sessions pin together; the least recently used go first (default: a quarter of the"
        " pool; 0: sessions off)",
    )
    sessions.add_argument(
        "--host-kv-cache-memory",
        type=_bytes(zero_turns_off=True),
        default=D.host_kv_cache_memory,
        help="host memory for prefix KV pages the device pool gives up, copied back on a hit instead of recomputed,"
        " e.g. 8GiB; data-parallel replicas share it equally (default: 1GiB on GPU/TPU, off on CPU; 0: off)",
    )
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--max-logprobs", type=_positive_int, default=D.max_logprobs,
                   help="most top alternatives a request may ask for (computed every step)")  # fmt: skip
    p.add_argument("--seed", type=int, default=D.seed, help="seed for requests that bring none")
    p.add_argument("--tensor-parallel-size", type=_positive_int, default=D.tensor_parallel_size,
                   help="devices each replica spans")  # fmt: skip
    p.add_argument("--data-parallel-size", type=_positive_int, default=D.data_parallel_size,
                   help="model replicas in this process")  # fmt: skip
    p.add_argument(
        "--overlap-scheduling",
        action=argparse.BooleanOptionalAction,
        default=D.overlap_scheduling,
        help="dispatch each step before the previous step's tokens reach the host, so scheduling, detokenization and"
        " streaming overlap the device (same outputs; --no-overlap-scheduling runs the plain loop, for debugging)",
    )
    p.add_argument(
        "--layer-loop",
        default=D.layer_loop,
        choices=LAYER_LOOPS,
        help="how a step runs the layers: scan (one loop body over stacked weights: small programs, fast compile and"
        " warm start), unroll, or auto (scan on a single CPU device, unroll elsewhere: measured per backend)",
    )
    p.add_argument(
        "--generation-config",
        default=D.generation_config,
        choices=GENERATION_CONFIGS,
        help="auto: a request's unset temperature, top_p, top_k, min_p and repetition_penalty take the model's "
        "generation_config.json values, and its max_new_tokens caps an unset max_tokens, as vLLM's; vllm: the "
        "built-in defaults",
    )
    p.add_argument(
        "--step-timeline",
        action="store_true",
        help="timestamp every step (a watcher thread waits on each step's outputs) and report the device's busy"
        " and idle time per step on /metrics (jaxinfer:device_idle_share, jaxinfer:step_*_ms)",
    )
    p.add_argument(
        "--compilation-cache-dir",
        default=D.compilation_cache_dir,
        help="persistent XLA cache (default: $JAXINFER_COMPILE_CACHE or ~/.cache/jaxinfer/xla)",
    )
    p.add_argument(
        "--no-compilation-cache",
        dest="enable_compilation_cache",
        action="store_false",
        help="compile every step afresh at start-up",
    )


def make_parser() -> argparse.ArgumentParser:
    D = ServerArgs
    p = argparse.ArgumentParser(prog="serve.py", description="OpenAI-compatible HTTP server for jaxinfer models.")
    add_engine_flags(p)
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=[],
        help="name(s) clients use in the `model` field (default: the --model string)",
    )
    p.add_argument("--host", default=D.host)
    p.add_argument("--port", type=_port, default=D.port)
    p.add_argument(
        "--allowed-origins",
        nargs="*",
        default=["*"],
        metavar="ORIGIN",
        help="origins a web page may call the API from (CORS headers; '*': any); with no value, none",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or D.api_key,
        help=f"require `Authorization: Bearer KEY` on /v1 and /(de)tokenize (default: ${API_KEY_ENV})",
    )
    p.add_argument(
        "--api-keys-file",
        default=D.api_keys_file,
        help='JSON Lines file of API keys, one {"id", "key", "rpm", "tpm", "max_concurrent"} object a line'
        " (limits optional: requests/tokens per minute, requests in flight; over one: 429); read again on SIGHUP."
        " Works beside --api-key (id `default`, no limits)",
    )
    p.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=D.access_log,
        help="one JSON line per request on the `jaxinfer.access` logger (id, key id, tokens, queue time, TTFT,"
        " end-to-end time, finish reasons); --no-access-log: none",
    )
    p.add_argument("--access-log-file", default=D.access_log_file,
                   help="write the access log's JSON lines to this file instead of stderr")  # fmt: skip
    p.add_argument(
        "--otlp-traces-endpoint",
        default=D.otlp_traces_endpoint,
        help="send OpenTelemetry traces of every request (queue, prefill chunks, decode, detokenize) to this OTLP"
        " endpoint (gRPC; $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf for HTTP); needs jaxinfer[otel]",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=D.max_waiting,
        help="sequences (prompts x n) that may wait for a first token; more get 429 (default: no bound)",
    )
    caps = p.add_argument_group("per-request bounds (each past its bound is a 400 naming the parameter)")
    caps.add_argument("--max-n", type=_positive_int, default=D.max_n, help="most samples per prompt (n)")
    caps.add_argument("--max-prompts", type=_positive_int, default=D.max_prompts,
                      help="most prompts in one completions request")  # fmt: skip
    caps.add_argument("--max-stop", type=_positive_int, default=D.max_stop, help="most stop strings")
    caps.add_argument("--max-stop-len", type=_positive_int, default=D.max_stop_len,
                      help="most characters in one stop string")  # fmt: skip
    caps.add_argument("--max-stop-token-ids", type=_positive_int, default=D.max_stop_token_ids,
                      help="most stop_token_ids")  # fmt: skip
    caps.add_argument("--stream-stall-timeout", type=_positive_float, default=D.stream_stall_timeout,
                      help="seconds a stream may make no progress while output waits for its client (a client that"
                      " stopped reading) before its request is aborted")  # fmt: skip
    caps.add_argument("--max-stream-buffer", type=_positive_int, default=D.max_stream_buffer,
                      help="outputs that may wait for a stream's client before its request is aborted")  # fmt: skip
    caps.add_argument("--tokenizer-threads", type=_positive_int, default=D.tokenizer_threads,
                      help="threads for tokenization, chat templates and validation (off the event loop)")  # fmt: skip
    policy = p.add_argument_group("serving policies (docs/guides/serving-policies.md)")
    policy.add_argument("--chat-truncation", default=D.chat_truncation, choices=CHAT_TRUNCATION,
                        help="a chat whose prompt plus max_tokens exceeds the context: off answers 400"
                        " (context_length_exceeded); oldest drops its oldest turns, keeping the system prompt and"
                        " the last user message, and reports them in usage.truncated_messages")  # fmt: skip
    policy.add_argument("--tool-call-parser", default=D.tool_call_parser, choices=TOOL_CALL_PARSERS,
                        help='tool_choice "auto" (the default with tools): the format the model writes its calls in;'
                        " auto: the one its chat template teaches (hermes: <tool_call> JSON </tool_call>, Qwen 2.5"
                        " and 3; llama3_json: the answer is the JSON call, Llama 3.1-3.3), else none (\"auto\" is"
                        " then a 400)")  # fmt: skip
    policy.add_argument("--filters-config", default=D.filters_config, metavar="PATH",
                        help="JSON file of content filters run on prompts (a blocked one is a 400, code"
                        " content_filter) and on generated text (held until it passes; a blocked choice ends with"
                        " finish_reason content_filter)")  # fmt: skip
    p.add_argument("--log-level", default=D.log_level, choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--coordinator-address", default=D.coordinator_address,
                   help="multi-host: HOST:PORT of process 0 (with --num-processes and --process-id)")  # fmt: skip
    p.add_argument("--num-processes", type=_positive_int, default=D.num_processes,
                   help="multi-host: number of processes")  # fmt: skip
    p.add_argument("--process-id", type=int, default=D.process_id,
                   help="multi-host: this process's rank (0 serves HTTP); found by jax on TPU pods, SLURM")  # fmt: skip
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=D.engine_process,
        help="run the engine core (scheduler, device steps) in its own process, away from HTTP and detokenization;"
        " --no-engine-process runs it on a thread of the server process (multi-host always does)",
    )
    p.add_argument(
        "--graceful-shutdown-timeout",
        type=float,
        default=D.graceful_shutdown_timeout,
        help="seconds SIGTERM waits for in-flight requests before aborting them",
    )
    return p


def parse_args(argv: Sequence[str] | None = None, reporter: argparse.ArgumentParser | None = None) -> ServerArgs:
    """The server's flags, checked before anything starts. A bad value exits through `reporter.error`, as argparse
    exits for a bad flag: pass the parser the user's command was read with (`jaxinfer serve`'s, whose usage is short
    and whose name is the command run); by default, the server's own."""
    parser = make_parser()
    ns = parser.parse_args(argv)
    error = (reporter or parser).error
    if ns.max_waiting is not None and ns.max_waiting < 1:  # 0 would refuse every request
        error("--max-waiting must be >= 1")
    if not 0 < ns.gpu_memory_utilization <= 1:
        error("--gpu-memory-utilization must be in (0, 1]")
    # Bad keys stop the start, before the model loads.
    from jaxinfer.server.keys import KeyFileError, KeyRing, check_key

    try:
        if ns.api_key is not None:
            check_key(ns.api_key, "--api-key")
    except KeyFileError as e:
        error(str(e))
    try:
        if ns.api_keys_file is not None:
            KeyRing(ns.api_key, ns.api_keys_file)
    except KeyFileError as e:
        error(f"--api-keys-file: {e}")
    if ns.filters_config is not None:  # a bad file stops the server before it starts, not at its first request
        from jaxinfer.server.filters import load_filters

        try:
            load_filters(ns.filters_config)
        except ValueError as e:
            error(str(e))
    return ServerArgs(**vars(ns))
