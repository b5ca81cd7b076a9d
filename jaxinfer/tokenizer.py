"""Text <-> token ids, and chat templates, for every model the engine loads.

One `Tokenizer` class fronts three sources:
- a GGUF file: llama.cpp stores the vocabulary as metadata arrays, from which we rebuild a `tokenizers`
  pipeline (byte-level BPE for `tokenizer.ggml.model = gpt2`, sentencepiece-style BPE for `llama`);
- a Hugging Face directory with `tokenizer.json` (+ `tokenizer_config.json` & co. for the special tokens);
- a sentencepiece `tokenizer.model`, wrapped as is.

The reference for behaviour (ids, BOS/EOS, decoding, chat templates) is what `transformers` produces for the
same files; tests/test_tokenizer.py checks that. transformers itself is not used here.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import gguf
import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from jaxinfer.gguf_file import read_gguf

__all__ = [
    "ChatTemplateError",
    "Tokenizer",
    "TokenizerNotFoundError",
    "UnsupportedTokenizerError",
    "load_tokenizer",
    "template_role",
]


class TokenizerNotFoundError(FileNotFoundError):
    """A path that holds no tokenizer we can load."""


class UnsupportedTokenizerError(ValueError):
    """A tokenizer description we do not know how to rebuild (e.g. an unknown GGUF tokenizer model)."""


class ChatTemplateError(ValueError):
    """The model has no chat template, or it cannot be used."""


def template_role(role: str) -> str:
    """A message's role as chat templates know it: "developer" is OpenAI's newer name for the system role, which
    templates written before it would render as an unknown role (SmolLM2's then adds its default system prompt too).
    The server and `LLM.chat` both map it, so a conversation gives one prompt either way."""
    return "system" if role == "developer" else role


# Chat-turn terminators that instruct models emit instead of (or before) their EOS. They join `eos_token_ids`
# only when the model's chat template actually writes them, so a base model keeps just its EOS.
_END_OF_TURN_MARKERS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|end|>")


class _Backend(Protocol):
    vocab_size: int
    special_ids: frozenset[int]

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str: ...

    def id_to_token(self, i: int) -> str | None: ...

    def token_to_id(self, s: str) -> int | None: ...

    def token_bytes(self, i: int) -> bytes: ...

    def is_byte_piece(self, i: int) -> bool: ...


class _HFBackend:
    """A `tokenizers.Tokenizer`; BOS/EOS insertion lives in its post-processor."""

    def __init__(self, tk: tokenizers.Tokenizer, clean_up_spaces: bool = False) -> None:
        self.tk = tk
        # transformers skips its WordPiece-era space clean-up for BPE models because it corrupts their output.
        self.clean_up_spaces = clean_up_spaces and type(tk.model).__name__ != "BPE"
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(i for i, t in tk.get_added_tokens_decoder().items() if t.special)
        # What token_bytes needs to know of the decoder: which of the steps that map a token to bytes it takes.
        steps = _decoder_steps(tk.decoder)
        kinds = {d.get("type") for d in steps}
        self._byte_level = "ByteLevel" in kinds
        self._byte_fallback = "ByteFallback" in kinds
        # Sentencepiece spells a space "▁"; its decoders (Replace, Metaspace) turn it back into one.
        self._metaspace = "Metaspace" in kinds or any(
            d.get("type") == "Replace" and d.get("pattern", {}).get("String") == "▁" for d in steps
        )

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        text = self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self.clean_up_spaces else text

    def id_to_token(self, i: int) -> str | None:
        return self.tk.id_to_token(i)

    def token_to_id(self, s: str) -> int | None:
        return self.tk.token_to_id(s)

    def token_bytes(self, i: int) -> bytes:
        token = self.tk.id_to_token(i)
        if token is None:
            return b""
        if self._byte_level:
            # As the ByteLevel decoder does: a token spelled outside the byte alphabet (an added token stored
            # raw) stands for its own UTF-8.
            table = _unicode_to_byte()
            return bytes(table[c] for c in token) if all(c in table for c in token) else token.encode("utf-8")
        if self._byte_fallback and (byte := _byte_token_value(token)) is not None:
            return bytes([byte])
        if self._metaspace:
            return token.replace("▁", " ").encode("utf-8")
        # Other decoders (WordPiece's "##", ...) only make sense on whole words: the token decoded alone.
        return self.decode([i], skip_special_tokens=False).encode("utf-8")

    def is_byte_piece(self, i: int) -> bool:
        return self._byte_fallback and _byte_token_value(self.tk.id_to_token(i) or "") is not None


def _decoder_steps(decoder: decoders.Decoder | None) -> list[dict[str, Any]]:
    """A `tokenizers` decoder's steps (a Sequence's members, or the decoder itself), as their JSON configs."""
    if decoder is None:
        return []
    state = json.loads(decoder.__getstate__())
    return list(state.get("decoders", [state]))


_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


def _byte_token_value(token: str) -> int | None:
    """The byte a sentencepiece byte-fallback token such as "<0xF0>" stands for (None: not one)."""
    digits = token[3:5]
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">") and set(digits) <= _HEX_DIGITS:
        return int(digits, 16)
    return None


def _clean_up_tokenization(text: str) -> str:
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't")):
        text = text.replace(before, after)
    for suffix in ("m", "s", "ve", "re"):
        text = text.replace(f" '{suffix}", f"'{suffix}")
    return text


class _SentencePieceBackend:
    """`sentencepiece.SentencePieceProcessor`, with BOS/EOS added here since sentencepiece never adds them."""

    def __init__(self, sp: Any, add_bos: bool, add_eos: bool) -> None:
        self.sp = sp
        self.add_bos = add_bos and sp.bos_id() >= 0
        self.add_eos = add_eos and sp.eos_id() >= 0
        self.vocab_size = sp.get_piece_size()
        # Control pieces (<s>, </s>, ...) and <unk> are what sentencepiece itself drops when decoding.
        self.special_ids = frozenset(i for i in range(self.vocab_size) if sp.is_control(i) or sp.is_unknown(i))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = list(self.sp.encode(text))
        if add_special_tokens and self.add_bos:
            ids.insert(0, self.sp.bos_id())
        if add_special_tokens and self.add_eos:
            ids.append(self.sp.eos_id())
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            return self.sp.decode([i for i in ids if i not in self.special_ids])
        # sentencepiece drops control pieces silently, so decode the runs between them and splice the pieces in.
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self.special_ids:
                parts += [self.sp.decode(run), self.sp.id_to_piece(i)]
                run = []
            else:
                run.append(i)
        parts.append(self.sp.decode(run))
        return "".join(parts)

    def id_to_token(self, i: int) -> str | None:
        return self.sp.id_to_piece(i) if 0 <= i < self.vocab_size else None

    def token_bytes(self, i: int) -> bytes:
        piece = self.id_to_token(i)
        if piece is None:
            return b""
        if self.sp.is_byte(i):
            return bytes([int(piece[3:5], 16)])  # "<0xF0>"
        return piece.replace("▁", " ").encode("utf-8")

    def is_byte_piece(self, i: int) -> bool:
        return 0 <= i < self.vocab_size and self.sp.is_byte(i)

    def token_to_id(self, s: str) -> int | None:
        i = self.sp.piece_to_id(s)
        # piece_to_id answers unk_id for unknown pieces; only the unk piece itself really maps there.
        return None if i == self.sp.unk_id() and s != self.sp.id_to_piece(i) else i


class Tokenizer:
    """The engine's tokenizer. Build it with `load_tokenizer` or one of the `from_*` constructors."""

    bos_token_id: int | None
    # Every id that ends generation: the model's EOS, any extra EOS ids listed by the model files
    # (generation_config.json's list, GGUF eot/eom ids), and the end-of-turn marker its chat template writes
    # (e.g. SmolLM2's ChatML `<|im_end|>`, Gemma's `<end_of_turn>`) -- see `_END_OF_TURN_MARKERS`.
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    unk_token_id: int | None
    vocab_size: int
    chat_template: str | None
    # Whether `encode(..., add_special_tokens=True)` puts BOS first; chat templates that write BOS themselves
    # want their output encoded with add_special_tokens=False.
    add_bos_token: bool

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.vocab_size = backend.vocab_size
        self.chat_template = chat_template
        self.eos_token_ids = _dedupe([*eos_token_ids, *self._template_end_of_turn_ids()])
        probe = backend.encode("", add_special_tokens=True)
        self.add_bos_token = bos_token_id is not None and probe[:1] == [bos_token_id]

    # ---- constructors -------------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path_or_reader: str | Path | gguf.GGUFReader | Mapping[str, Any]) -> Tokenizer:
        """From a GGUF file path, an open `gguf.GGUFReader`, or its metadata as a dict of Python values."""
        meta = _gguf_tokenizer_metadata(path_or_reader)
        return _tokenizer_from_gguf_metadata(cls, meta)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """From a Hugging Face model/tokenizer directory holding `tokenizer.json`."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerNotFoundError(f"{path} has no tokenizer.json")
        tk = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        cfg = _HFTokenizerFiles(path)
        add_bos, add_eos = cfg.config.get("add_bos_token"), cfg.config.get("add_eos_token")
        bos = cfg.token_string("bos_token")
        eos = cfg.token_string("eos_token")
        # Like transformers: explicit add_bos/add_eos flags replace the post-processor from tokenizer.json,
        # otherwise that post-processor decides what encode() adds.
        if add_bos is not None or add_eos is not None:
            tk.post_processor = _bos_eos_processor(tk, bos if add_bos else None, eos if add_eos else None)
        backend = _HFBackend(tk, clean_up_spaces=bool(cfg.config.get("clean_up_tokenization_spaces", False)))
        return cfg.build(cls, backend)

    @classmethod
    def from_sentencepiece(
        cls,
        model_path: str | Path,
        *,
        add_bos: bool = True,
        add_eos: bool = False,
        chat_template: str | None = None,
        eos_token_ids: Iterable[int] = (),
        pad_token_id: int | None = None,
    ) -> Tokenizer:
        """From a sentencepiece `tokenizer.model`; BOS/EOS/pad ids come from the model proto.

        add_bos defaults to True as Llama-style sentencepiece models expect; pass the model's own setting.
        """
        import sentencepiece

        model_path = Path(model_path)
        if not model_path.is_file():
            raise TokenizerNotFoundError(f"sentencepiece model {model_path} does not exist")
        sp = sentencepiece.SentencePieceProcessor(model_file=str(model_path))
        backend = _SentencePieceBackend(sp, add_bos=add_bos, add_eos=add_eos)

        def known(i: int) -> int | None:
            return i if i >= 0 else None

        eos = [i for i in (known(sp.eos_id()),) if i is not None]
        return cls(
            backend,
            bos_token_id=known(sp.bos_id()),
            eos_token_ids=[*eos, *eos_token_ids],
            pad_token_id=pad_token_id if pad_token_id is not None else known(sp.pad_id()),
            unk_token_id=known(sp.unk_id()),
            chat_template=chat_template,
        )

    # ---- encoding ------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special-token strings in the text (e.g. "<|im_start|>") become their ids.

        add_special_tokens adds BOS (and EOS) only where the model's tokenizer config asks for it.
        """
        return self._backend.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        token = self._backend.id_to_token(int(i))
        if token is None:
            raise IndexError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
        return token

    def token_to_id(self, s: str) -> int | None:
        return self._backend.token_to_id(s)

    def token_bytes(self, i: int) -> bytes:
        """The raw bytes token `i` stands for, as the decoder turns it into text (special tokens: their spelling).

        Unlike `decode([i])`, this keeps a token that holds part of a UTF-8 character (byte-level BPE pieces of
        an emoji, sentencepiece's "<0xF0>") as its bytes instead of U+FFFD, so the bytes of consecutive tokens
        join into the text they decode to (OpenAI's chat logprobs `bytes`). A sentencepiece "▁" is a space here
        even on the first token, whose space a whole decode strips.
        """
        if not 0 <= int(i) < self.vocab_size:
            raise IndexError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
        return self._backend.token_bytes(int(i))

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token stands for (special tokens: their spelling): a text encodes to at least
        its length over this many tokens, normalization aside (the server refuses megabytes without encoding them)."""
        return max(1, max(len(self._backend.token_bytes(i)) for i in range(self.vocab_size)))

    def is_special(self, i: int) -> bool:
        return int(i) in self._backend.special_ids

    def is_byte_piece(self, i: int) -> bool:
        """Whether token `i` is a sentencepiece byte-fallback piece ("<0xF0>"): a run of them decodes as a whole."""
        return self._backend.is_byte_piece(int(i))

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._backend.special_ids

    @property
    def bos_token(self) -> str | None:
        return self._token_or_none(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._token_or_none(self.eos_token_ids[0] if self.eos_token_ids else None)

    @property
    def pad_token(self) -> str | None:
        return self._token_or_none(self.pad_token_id)

    @property
    def unk_token(self) -> str | None:
        return self._token_or_none(self.unk_token_id)

    def _token_or_none(self, i: int | None) -> str | None:
        return None if i is None else self._backend.id_to_token(i)

    # ---- chat ----------------------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict], /, add_generation_prompt: bool = True, continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:  # fmt: skip
        """Render `messages` with the model's Jinja chat template, as transformers does (tokenize=False).

        `continue_final_message`: the text ends inside the last message (an assistant's answer begun by the caller),
        without the end-of-turn the template writes after it, so the model continues that message. Extra kwargs
        (tools, documents, enable_thinking, ...) are passed to the template.
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message continues the last message and add_generation_prompt opens a new "
                             "turn: set add_generation_prompt=False with it")  # fmt: skip
        if self.chat_template is None:
            raise ChatTemplateError(
                "this model has no chat template (none in its GGUF metadata / tokenizer files); format the prompt "
                "yourself, or give one (LLM(..., chat_template=...), serve.py --chat-template FILE)"
            )
        template = _compile_chat_template(self.chat_template)
        variables: dict[str, Any] = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
            "pad_token": self.pad_token,
            "tools": None,
            "documents": None,
        }
        if "messages" in kwargs:  # render's own argument: a template variable of that name would shadow them
            raise ValueError("'messages' is the conversation itself, not a template variable to set")
        variables.update(_plain(kwargs))
        text = template.render(messages=_plain(messages), add_generation_prompt=add_generation_prompt, **variables)
        return _cut_after_final_message(text, messages) if continue_final_message else text

    def with_chat_template(self, template: str) -> Tokenizer:
        """A copy that renders chats with `template` (Jinja text) instead of the model's: vLLM's --chat-template, for
        a base model without one or another format. Its end-of-turn marker (`<end_of_turn>`, `<|im_end|>`, ...)
        joins the stop ids, as the model's own template's does. ChatTemplateError when it does not compile."""
        _compile_chat_template(template)  # a syntax error now, not at the first chat request
        new = copy.copy(self)
        new.chat_template = template
        new.eos_token_ids = _dedupe([*self.eos_token_ids, *new._template_end_of_turn_ids()])
        return new

    def save_pretrained(self, directory: str | Path) -> Path:
        """Writes this tokenizer as a Hugging Face tokenizer directory that `load_tokenizer` reads back as the same
        tokenizer: tokenizer.json (the pipeline), generation_config.json (the special ids, which decide BOS, EOS and
        the stop ids), tokenizer_config.json and chat_template.jinja. Rebuilding a GGUF's vocabulary takes seconds
        for a large one (Gemma 3's 262k sentencepiece tokens: ~3 s); reading this back takes about a third of that.

        Each file is replaced whole, tokenizer.json last: a directory that holds it holds the rest. A tokenizer
        wrapping a sentencepiece model has no tokenizer.json to write: its tokenizer.model is the file to keep."""
        if not isinstance(self._backend, _HFBackend):
            raise TypeError(
                "save_pretrained: a sentencepiece-backed tokenizer is its tokenizer.model file; copy that instead"
            )
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        ids = {
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
            "pad_token_id": self.pad_token_id,
            "unk_token_id": self.unk_token_id,
        }
        _write_whole(out / "generation_config.json", json.dumps(ids, indent=1))
        config = {"clean_up_tokenization_spaces": self._backend.clean_up_spaces}
        _write_whole(out / "tokenizer_config.json", json.dumps(config, indent=1))
        template = out / "chat_template.jinja"
        if self.chat_template is not None:
            _write_whole(template, self.chat_template)
        else:
            template.unlink(missing_ok=True)
        _write_whole(out / "tokenizer.json", self._backend.tk.to_str())
        return out

    def _template_end_of_turn_ids(self) -> list[int]:
        if not self.chat_template:
            return []
        found = [m for m in _END_OF_TURN_MARKERS if m in self.chat_template]
        ids = [self._backend.token_to_id(m) for m in found]
        return [i for i in ids if i is not None]

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_ids}, "
            f"pad={self.pad_token_id}, chat_template={'yes' if self.chat_template else 'no'})"
        )


def _cut_after_final_message(text: str, messages: list[dict]) -> str:
    """`text` up to the end of the last message's content (its last text part), where the template rendered it:
    what follows (an end-of-turn, a newline) would close the turn the model is to continue. A template that strips
    the content's surrounding space renders it stripped, so that is what is looked for then."""
    content = messages[-1].get("content") if messages else None
    if isinstance(content, list | tuple):
        texts = [p.get("text") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        content = texts[-1] if texts else None
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message: the last message has no text to continue")
    for wanted in (content, content.strip()):
        at = text.rfind(wanted)
        if at >= 0:
            return text[: at + len(wanted)]
    raise ValueError("continue_final_message: the chat template does not render the last message's text as given, "
                     "so there is no place to continue it from")  # fmt: skip


def _dedupe(ids: Iterable[int | None]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def _write_whole(path: Path, text: str) -> None:
    """Writes `text` beside `path` and renames it into place, so a reader finds the old file or the new one whole
    (two processes filling one cache entry at once included)."""
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    part.write_text(text, encoding="utf-8")
    os.replace(part, path)


# ---- chat templates ----------------------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps the body.

    Some Hub templates use it, and without the tag registered they would not even compile.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes (<, >, &, ') which would corrupt prompts; HF templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile_chat_template(source: str) -> jinja2.Template:
    # Templates come from model files, i.e. untrusted: render them in Jinja's immutable sandbox.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from e


def _plain(value: Any) -> Any:
    """A copy made of plain dict/list/scalars, so templates never see (or mutate) the caller's objects."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return value.item()
    return value


# ---- Hugging Face directories ------------------------------------------------------------------------------


class _HFTokenizerFiles:
    """The JSON side files next to tokenizer.json / tokenizer.model that name special tokens and the template."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.config = _read_json(path / "tokenizer_config.json")
        self.special_map = _read_json(path / "special_tokens_map.json")
        self.generation = _read_json(path / "generation_config.json")
        self.model_config = _read_json(path / "config.json")

    def token_string(self, name: str) -> str | None:
        value = self.config.get(name, self.special_map.get(name))
        if isinstance(value, Mapping):  # a serialized AddedToken
            value = value.get("content")
        return value if isinstance(value, str) else None

    def config_id(self, name: str) -> Any:
        # generation_config.json is what generate() uses, config.json the fallback.
        return self.generation.get(name, self.model_config.get(name))

    def chat_template(self) -> str | None:
        jinja_file = self.path / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text(encoding="utf-8")
        template = _read_json(self.path / "chat_template.json").get("chat_template")
        template = template if template is not None else self.config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default", next(iter(named.values()), None))
        return template if isinstance(template, str) else None

    def build(self, cls: type[Tokenizer], backend: _Backend) -> Tokenizer:
        def token_id(name: str, config_key: str) -> int | None:
            text = self.token_string(name)
            i = backend.token_to_id(text) if text is not None else None
            if i is None:
                configured = self.config_id(config_key)
                i = configured[0] if isinstance(configured, list) and configured else configured
            return i if isinstance(i, int) else None

        eos_ids: list[int | None] = [token_id("eos_token", "eos_token_id")]
        extra = self.config_id("eos_token_id")
        eos_ids += extra if isinstance(extra, list) else [extra]
        return cls(
            backend,
            bos_token_id=token_id("bos_token", "bos_token_id"),
            eos_token_ids=_dedupe(i for i in eos_ids if isinstance(i, int)),
            pad_token_id=token_id("pad_token", "pad_token_id"),
            unk_token_id=token_id("unk_token", "unk_token_id"),
            chat_template=self.chat_template(),
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _bos_eos_processor(tk: tokenizers.Tokenizer, bos: str | None, eos: str | None) -> processors.TemplateProcessing:
    """`[bos] $A [eos]` for the tokens that are given and exist in the vocabulary."""
    specials = [(t, tk.token_to_id(t)) for t in (bos, eos) if t is not None and tk.token_to_id(t) is not None]
    names = {t for t, _ in specials}

    def template(seq: str, type_id: int) -> list[str]:
        head = [f"{bos}:{type_id}"] if bos in names else []
        tail = [f"{eos}:{type_id}"] if eos in names else []
        return [*head, f"${seq}:{type_id}", *tail]

    return processors.TemplateProcessing(
        single=template("A", 0), pair=template("A", 0) + template("B", 1), special_tokens=specials
    )


# ---- GGUF --------------------------------------------------------------------------------------------------


def _wanted_gguf_key(key: str) -> bool:
    return key.startswith("tokenizer.") or key == "general.architecture"


def _gguf_tokenizer_metadata(source: str | Path | gguf.GGUFReader | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return {k: v for k, v in source.items() if _wanted_gguf_key(k)}
    if isinstance(source, gguf.GGUFReader):
        return {k: f.contents() for k, f in source.fields.items() if _wanted_gguf_key(k)}
    path = Path(source)
    if not path.is_file():
        raise TokenizerNotFoundError(f"GGUF file {path} does not exist")
    try:
        meta = read_gguf(path, tensors=False).metadata
    except ValueError as e:
        raise UnsupportedTokenizerError(str(e)) from e
    return {k: v for k, v in meta.items() if _wanted_gguf_key(k)}


def _tokenizer_from_gguf_metadata(cls: type[Tokenizer], meta: Mapping[str, Any]) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise UnsupportedTokenizerError("GGUF metadata has no tokenizer (tokenizer.ggml.model / .tokens missing)")
    token_types = list(meta.get("tokenizer.ggml.token_type") or [gguf.TokenType.NORMAL] * len(tokens))

    def meta_id(name: str) -> int | None:
        i = meta.get(f"tokenizer.ggml.{name}_token_id")
        return int(i) if i is not None and 0 <= int(i) < len(tokens) else None

    ids = {name: meta_id(name) for name in ("bos", "eos", "unknown", "padding", "eot", "eom")}
    if kind == "gpt2":
        tk = _byte_level_bpe(tokens, list(meta.get("tokenizer.ggml.merges") or []), meta.get("tokenizer.ggml.pre"))
        default_add_bos = False
    elif kind == "llama":
        arch = str(meta.get("general.architecture", ""))
        scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
        add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        tk = _sentencepiece_bpe(tokens, scores, arch, add_prefix, unk_id=ids["unknown"])
        # Like llama.cpp (and transformers' GGUF loader), sentencepiece vocabularies add BOS unless told not to.
        default_add_bos = True
    else:
        raise UnsupportedTokenizerError(
            f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2' byte-level BPE, "
            "'llama' sentencepiece BPE)"
        )
    special_ids = {i for i in (ids["bos"], ids["eos"], ids["unknown"], ids["padding"]) if i is not None}
    _add_gguf_added_tokens(tk, tokens, token_types, special_ids)

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    bos_text = tk.id_to_token(ids["bos"]) if ids["bos"] is not None and add_bos else None
    eos_text = tk.id_to_token(ids["eos"]) if ids["eos"] is not None and add_eos else None
    tk.post_processor = _bos_eos_processor(tk, bos_text, eos_text)
    return cls(
        _HFBackend(tk),
        bos_token_id=ids["bos"],
        eos_token_ids=_dedupe([ids["eos"], ids["eot"], ids["eom"]]),
        pad_token_id=ids["padding"],
        unk_token_id=ids["unknown"],
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _add_gguf_added_tokens(
    tk: tokenizers.Tokenizer,
    tokens: Sequence[str],
    token_types: Sequence[int],
    special_ids: set[int],
) -> None:
    """Register control / user-defined tokens so they are matched whole in raw text, as llama.cpp does.

    Control tokens (and the bos/eos/unk/pad ids) become special tokens (skipped by decode when asked);
    user-defined ones (Gemma's "\\n\\n", "<start_of_image>", ...) plain added tokens. All are matched
    before normalization (normalized=False) so e.g. spaces inside them are not rewritten first.

    Only tokens whose spelling is in the vocabulary are registered: adding any other would mint a new id beyond
    the model's embedding table. That skips byte-level "control" tokens written outside the byte alphabet
    (converter mislabels, transformers skips them too) and the runs of spaces we respelled, which BPE reaches.
    """
    vocab = tk.get_vocab()
    special: list[AddedToken] = []
    plain: list[AddedToken] = []
    for i, (token, token_type) in enumerate(zip(tokens, token_types, strict=True)):
        if vocab.get(token) != i:
            continue
        if token_type in (gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN) or i in special_ids:
            special.append(AddedToken(token, special=True, normalized=False))
        elif token_type == gguf.TokenType.USER_DEFINED:
            plain.append(AddedToken(token, special=False, normalized=False))
    tk.add_special_tokens(special)
    tk.add_tokens(plain)


@functools.cache
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used to spell byte-level BPE vocabularies.

    Printable Latin-1 bytes stand for themselves; the others (space, control bytes, ...) are shifted to
    U+0100 and up, in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + n) for n, b in enumerate(shifted)})
    return dict(sorted(table.items()))


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of `_byte_to_unicode`: a byte-level BPE spelling's character -> the byte it stands for."""
    return {c: b for b, c in _byte_to_unicode().items()}


# Pre-tokenizer split regexes named by `tokenizer.ggml.pre` (llama.cpp's names for them).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_REGEX_BY_PRE = {
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}
# GPT-2's own regex (built into the ByteLevel pre-tokenizer).
_GPT2_PRES = frozenset({"default", "gpt2", "gpt-2", "phi-2", "mpt", "olmo"})
# GPT-2's regex after isolating every digit (StarCoder-family vocabularies, incl. SmolLM).
_DIGIT_GPT2_PRES = frozenset({"starcoder", "refact", "smollm", "codeshell", "command-r"})


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    pre = pre or "default"
    if pre in _GPT2_PRES:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_GPT2_PRES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _SPLIT_REGEX_BY_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_REGEX_BY_PRE[pre]), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    known = sorted(_GPT2_PRES | _DIGIT_GPT2_PRES | set(_SPLIT_REGEX_BY_PRE))
    raise UnsupportedTokenizerError(
        f"GGUF pre-tokenizer tokenizer.ggml.pre={pre!r} is unknown; its split regex decides how text is cut "
        f"before BPE, so guessing would give wrong ids. Known: {', '.join(known)}"
    )


def _byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], pre: str | None) -> tokenizers.Tokenizer:
    """GPT-2 style byte-level BPE from GGUF arrays."""
    pre_tokenizer = _byte_level_pre_tokenizer(pre)  # first, so an unknown `pre` fails before the slow part
    spell = _byte_to_unicode()
    alphabet = set(spell.values())

    def byte_spelling(token: str) -> str:
        # llama.cpp keeps byte-level spelling for BPE tokens, but some converters store added tokens raw.
        return token if set(token) <= alphabet else "".join(spell[b] for b in token.encode("utf-8"))

    vocab = {byte_spelling(t): i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tk = tokenizers.Tokenizer(
        BPE(
            vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False
        )
    )
    tk.pre_tokenizer = pre_tokenizer
    tk.decoder = decoders.ByteLevel()
    return tk


# Gemma vocabularies list tokens in merge order; their scores are not a usable merge priority.
_RANK_BY_POSITION_ARCHS = frozenset({"gemma", "gemma2", "gemma3"})


def _sentencepiece_bpe(
    tokens: Sequence[str], scores: Sequence[float], arch: str, add_prefix: bool, unk_id: int | None
) -> tokenizers.Tokenizer:
    """Sentencepiece-BPE (llama / gemma GGUFs) as a `tokenizers` BPE with byte fallback.

    Spaces are written "▁"; tokens stored with literal spaces (Gemma's runs of spaces) are respelled to match.
    A GGUF has no merge list here, so merges are derived from the vocabulary: every split of a token into two
    vocabulary entries, ranked by the token's score (or its position, for Gemma).
    """
    tokens = _respell_space_tokens(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    if arch in _RANK_BY_POSITION_ARCHS:
        rank = {t: -float(i) for i, t in enumerate(tokens)}
    else:
        rank = {t: float(s) for t, s in zip(tokens, scores, strict=True)}
    unk = tokens[unk_id] if unk_id is not None else None
    model = BPE(vocab=vocab, merges=_merges_from_vocab(vocab, rank), unk_token=unk, fuse_unk=True, byte_fallback=True)
    tk = tokenizers.Tokenizer(model)
    steps: list[decoders.Decoder] = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        # Sentencepiece's dummy prefix, placed as llama.cpp does: a "▁" before every run of text, i.e. at the
        # start and after each special token, even when the text already starts with a space. (transformers'
        # Metaspace(prepend_scheme="first") would skip it in both of those places.)
        tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        tk.normalizer = normalizers.Replace(" ", "▁")
    tk.decoder = decoders.Sequence(steps)
    return tk


def _respell_space_tokens(tokens: Sequence[str]) -> list[str]:
    """Tokens of only whitespace containing " " get "▁" spelling, unless that spelling is already taken."""
    taken = set(tokens)
    out = []
    for t in tokens:
        if " " in t and not t.strip():
            respelled = "▁" * len(t)
            t = respelled if respelled not in taken else t
        out.append(t)
    return out


def _merges_from_vocab(vocab: Mapping[str, int], rank: Mapping[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a sentencepiece vocabulary, best first.

    A merge (left, right) exists for every way to cut a token into two vocabulary entries. Merges are ordered by
    the rank of the token they produce; ties go to the longer left piece, then to vocabulary order. This is the
    order transformers derives too, so ids match it. (Two cuts of one token differ in left length, so nothing
    finer is needed to break ties.)
    """
    merges: list[tuple[float, int, int, str, str]] = []
    for token, token_rank in rank.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((-token_rank, -len(left), -len(right), left, right))
    # Stable sort: equal keys (tokens of equal score) keep vocabulary order.
    merges.sort(key=lambda m: m[:3])
    return [(m[3], m[4]) for m in merges]


# ---- dispatch ----------------------------------------------------------------------------------------------


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer at `path`: a .gguf file, a HF directory with tokenizer.json, or a sentencepiece model
    (a tokenizer.model file, or a directory holding one)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise TokenizerNotFoundError(f"tokenizer path {path} does not exist")
    if path.is_file():
        if path.suffix == ".gguf" or _has_gguf_magic(path):
            return Tokenizer.from_gguf(path)
        if path.suffix == ".model":
            return _sentencepiece_with_hf_files(path, path.parent)
        if path.name == "tokenizer.json":
            return Tokenizer.from_hf_dir(path.parent)
        raise TokenizerNotFoundError(
            f"{path} is not a tokenizer file (expected a .gguf, a sentencepiece .model or tokenizer.json)"
        )
    if (path / "tokenizer.json").is_file():
        return Tokenizer.from_hf_dir(path)
    if (path / "tokenizer.model").is_file():
        return _sentencepiece_with_hf_files(path / "tokenizer.model", path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return Tokenizer.from_gguf(ggufs[0])
    raise TokenizerNotFoundError(
        f"no tokenizer in directory {path}: expected tokenizer.json, tokenizer.model or a single .gguf file"
        + (f" (found {len(ggufs)} .gguf files, pass one)" if ggufs else "")
    )


def _has_gguf_magic(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def _sentencepiece_with_hf_files(model_path: Path, directory: Path) -> Tokenizer:
    """A sentencepiece model, with BOS/EOS flags and chat template from HF side files when they exist."""
    cfg = _HFTokenizerFiles(directory)
    extra = cfg.config_id("eos_token_id")
    tok = Tokenizer.from_sentencepiece(
        model_path,
        add_bos=bool(cfg.config.get("add_bos_token", True)),
        add_eos=bool(cfg.config.get("add_eos_token", False)),
        chat_template=cfg.chat_template(),
        eos_token_ids=[i for i in (extra if isinstance(extra, list) else [extra]) if isinstance(i, int)],
    )
    return tok
