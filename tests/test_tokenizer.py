"""jaxinfer.tokenizer against transformers (GGUF and HF-dir tokenizers) and sentencepiece (tokenizer.model)."""

from __future__ import annotations

import copy
import functools
import json
import random
from pathlib import Path
from typing import Any

import gguf
import pytest

from jaxinfer.model_files import ModelNotFoundError, gemma3_270m_gguf, smollm2_gguf
from jaxinfer.tokenizer import (
    ChatTemplateError,
    Tokenizer,
    TokenizerNotFoundError,
    UnsupportedTokenizerError,
    load_tokenizer,
)
from tests.hf_gguf import hf_tokenizer

TEXTS = {
    "plain": "The quick brown fox jumps over the lazy dog.",
    "hello": "Hello world",
    "empty": "",
    "one_space": " ",
    "leading_spaces": "   leading spaces",
    "trailing_spaces": "trailing spaces   ",
    "inner_spaces": "multiple    spaces   inside",
    "newlines": "line one\nline two\n\nline four\n",
    "tabs": "\ttab\tseparated\t\tvalues",
    "crlf": "\r\nwindows newline\r\n",
    "accents": "Café naïve résumé über façade",
    "cjk": "日本語のテキストと中文字符",
    "arabic": "مرحبا بالعالم",
    "emoji": "Emoji 😀👍🏽 family 👨\u200d👩\u200d👧\u200d👦 flag 🇫🇷",
    "rare_chars": "𓀀𓁐 hieroglyphs and \u2028 separator",
    "python": "def f(x):\n    if x > 0:\n        return x * 2\n    return -x\n",
    "numbers": "Numbers: 0 7 42 123 4567 3.14159 1,000,000 2024-01-31",
    "chatml_in_text": "<|im_start|>user\nhi<|im_end|>",
    "specials_inside": "text with <|im_start|> inside and <|endoftext|> too",
    "gemma_turns": "<start_of_turn>user\nhello<end_of_turn>\n",
    "bos_eos_strings": "<bos>literal bos<eos>",
    "contractions": "I'm sure they'll say it's fine, isn't it?",
    "long_word": "a" * 50 + " " + "ab" * 20,
    "mixed": "Mixed: ñ 你好 😀 \n\t end",
    "nbsp": "\u00a0non-breaking\u2009thin space",
    "byte_token_text": "<0x41> byte token text",
}

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": 'And 3+3? Answer with <b>HTML</b> & "quotes".'},
]


def _gguf_path(name: str) -> Path:
    locate = {"smollm2": smollm2_gguf, "gemma3": gemma3_270m_gguf}[name]
    try:
        return locate()
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@functools.cache
def _ours(name: str) -> Tokenizer:
    """Shared instances; tests that change one (e.g. its chat_template) build their own."""
    return load_tokenizer(_gguf_path(name))


def _reference(name: str) -> Any:
    pytest.importorskip("transformers")
    return hf_tokenizer(_gguf_path(name))  # loaded once per session (tests/hf_gguf.py)


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def pair(request: pytest.FixtureRequest) -> tuple[Tokenizer, Any]:
    return _ours(request.param), _reference(request.param)


@pytest.fixture(scope="module")
def smollm2() -> tuple[Tokenizer, Any]:
    return _ours("smollm2"), _reference("smollm2")


# ---- GGUF vs transformers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_gguf_encode_matches_transformers(pair: tuple[Tokenizer, Any], text: str) -> None:
    ours, ref = pair
    assert ours.encode(text) == ref(text).input_ids
    assert ours.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("skip", [True, False], ids=["skip_special", "keep_special"])
@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_gguf_decode_matches_transformers(pair: tuple[Tokenizer, Any], text: str, skip: bool) -> None:
    ours, ref = pair
    ids = ref(text).input_ids
    assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_gguf_round_trip(pair: tuple[Tokenizer, Any], text: str) -> None:
    ours, ref = pair
    if ref.decode(ref(text).input_ids, skip_special_tokens=True) != text:
        pytest.skip("the reference does not round-trip this text either (special-token strings)")
    assert ours.decode(ours.encode(text)) == text


def test_gguf_vocab_and_special_tokens(pair: tuple[Tokenizer, Any]) -> None:
    ours, ref = pair
    assert ours.vocab_size == len(ref)
    assert ours.bos_token_id == ref.bos_token_id
    assert ours.eos_token_ids[0] == ref.eos_token_id
    assert ours.pad_token_id == ref.pad_token_id
    assert ours.unk_token_id == ref.unk_token_id
    assert ours.add_bos_token == ref.add_bos_token
    for i in [*range(0, 520, 7), ours.vocab_size - 1, *ref.all_special_ids]:
        assert ours.id_to_token(i) == ref.convert_ids_to_tokens(i)
        assert ours.token_to_id(ours.id_to_token(i)) == i
    assert set(ref.all_special_ids) <= ours.special_token_ids
    assert all(ours.is_special(i) for i in ref.all_special_ids)
    assert ours.token_to_id("definitely-not-a-token-\x00") is None
    with pytest.raises(IndexError):
        ours.id_to_token(ours.vocab_size + 10)


def test_gguf_expected_ids() -> None:
    """The values the engine relies on, spelled out (see the model cards / GGUF metadata)."""
    smol = _ours("smollm2")
    assert (smol.bos_token_id, smol.eos_token_ids, smol.pad_token_id) == (1, (2,), 2)  # <|im_end|> is EOS
    assert not smol.add_bos_token and smol.encode("Hi")[0] != 1
    assert smol.is_special(0) and smol.is_special(2) and not smol.is_special(1000)
    gemma = _ours("gemma3")
    assert (gemma.bos_token_id, gemma.eos_token_ids, gemma.pad_token_id) == (2, (1,), 0)
    assert gemma.add_bos_token and gemma.encode("Hi")[0] == 2 and gemma.encode("") == [2]
    assert gemma.token_to_id("<end_of_turn>") == 106 and gemma.is_special(106)


def test_gguf_reader_and_path_agree() -> None:
    """A path is read with our header scan; an open GGUFReader (shared with weight loading) works the same."""
    path = _gguf_path("smollm2")
    from_reader = Tokenizer.from_gguf(gguf.GGUFReader(path))
    from_path = Tokenizer.from_gguf(path)
    text = TEXTS["python"] + TEXTS["emoji"] + TEXTS["chatml_in_text"]
    assert from_reader.encode(text) == from_path.encode(text)
    assert from_reader.eos_token_ids == from_path.eos_token_ids
    assert from_reader.chat_template == from_path.chat_template


# ---- chat templates ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:]], ids=["with_system", "no_system"])
def test_chat_template_matches_transformers(smollm2: tuple[Tokenizer, Any], messages: list, generation_prompt: bool):
    ours, ref = smollm2
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=generation_prompt) == expected


TRIMMING_TEMPLATE = """{% for m in messages %}<start_of_turn>{{ m.role }}
{{ m.content | trim }}<end_of_turn>
{% endfor %}{% if add_generation_prompt %}<start_of_turn>model
{% endif %}"""


@pytest.mark.parametrize("template", [None, TRIMMING_TEMPLATE], ids=["chatml", "trimming"])
@pytest.mark.parametrize("final", ["The answer is", "The answer is ", "  Well,\n"])
def test_continue_final_message_matches_transformers(smollm2: tuple[Tokenizer, Any], template, final: str) -> None:
    """The text ends inside the last (assistant) message, as transformers renders it, for a template that keeps
    the content's spaces (ChatML) and one that trims them (as Gemma's does)."""
    ours, ref = smollm2
    if template is not None:
        ours = Tokenizer.from_gguf(_gguf_path("smollm2"))
        ours.chat_template = template
    messages = [CONVERSATION[1], {"role": "assistant", "content": final}]
    expected = ref.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=False,
                                       continue_final_message=True)  # fmt: skip
    assert ours.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True) == expected
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        ours.apply_chat_template(messages, continue_final_message=True)


# Exercises the globals and filters HF gives templates: tojson (unescaped, with options), special-token strings,
# loop controls, namespace, and extra kwargs.
CUSTOM_TEMPLATE = """{{ bos_token }}{% set ns = namespace(n=0) %}
{%- for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}
[{{ m.role | upper }}] {{ m.content }}{{ eos_token }}
{% endfor %}
{{ messages | tojson }}|{{ {'b': 1, 'a': '<é>'} | tojson(indent=2, sort_keys=True) }}|{{ ns.n }}|{{ extra }}
{%- if add_generation_prompt %}[ASSISTANT]{% endif %}"""


def test_custom_chat_template_matches_transformers(smollm2: tuple[Tokenizer, Any]) -> None:
    ours, ref = smollm2
    ours_custom = Tokenizer.from_gguf(_gguf_path("smollm2"))
    ours_custom.chat_template = CUSTOM_TEMPLATE
    messages = [*CONVERSATION, {"role": "skip", "content": "hidden"}]
    expected = ref.apply_chat_template(
        messages, chat_template=CUSTOM_TEMPLATE, tokenize=False, add_generation_prompt=True, extra="x"
    )
    assert ours_custom.apply_chat_template(messages, extra="x") == expected
    assert ours.chat_template != CUSTOM_TEMPLATE  # the cached tokenizer was not touched


def test_chat_template_raise_exception_and_strftime() -> None:
    tok = Tokenizer.from_gguf(_gguf_path("smollm2"))
    tok.chat_template = (
        "{{ strftime_now('%Y') }}{% if messages[0].role != 'user' %}{{ raise_exception('bad') }}{% endif %}"
    )
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]).isdigit()
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="bad"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_chat_template_is_sandboxed() -> None:
    import jinja2

    tok = Tokenizer.from_gguf(_gguf_path("smollm2"))
    tok.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_no_chat_template_is_a_clear_error() -> None:
    gemma = _ours("gemma3")
    assert gemma.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        gemma.apply_chat_template(CONVERSATION)


# ---- HF directory ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(smollm2: tuple[Tokenizer, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    _, ref = smollm2
    directory = tmp_path_factory.mktemp("smollm2_hf")
    ref.save_pretrained(directory)
    return directory


def test_hf_dir_matches_transformers(smollm2: tuple[Tokenizer, Any], hf_dir: Path) -> None:
    _, ref = smollm2
    tok = load_tokenizer(hf_dir)
    for text in TEXTS.values():
        ids = ref(text).input_ids
        assert tok.encode(text) == ids
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    for messages in (CONVERSATION, CONVERSATION[1:]):
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok.apply_chat_template(messages) == expected
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id, tok.vocab_size) == (1, (2,), 2, len(ref))


def test_hf_dir_side_files(hf_dir: Path, tmp_path: Path) -> None:
    """add_bos_token, a list of EOS ids, and the template inside tokenizer_config.json are honoured."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((hf_dir / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(add_bos_token=True, chat_template="{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.add_bos_token and tok.encode("Hi")[0] == 1 and tok.encode("Hi", add_special_tokens=False)[0] != 1
    assert tok.eos_token_ids == (2, 0)
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]) == "a<|im_end|>"


# ---- sentencepiece ---------------------------------------------------------------------------------------

SP_TEXTS = {k: TEXTS[k] for k in ("plain", "hello", "empty", "accents", "cjk", "emoji", "python", "numbers")} | {
    "leading_spaces": "  two  spaces",
    "trailing": "trail ",
    "newlines_tabs": "a\n\n\tb",
    "special_string": "<s> literal",
}


def _train_sentencepiece(directory: Path, **options: Any) -> Path:
    sentencepiece = pytest.importorskip("sentencepiece")
    rng = random.Random(0)
    words = (
        "the quick brown fox jumps over lazy dog hello world token model engine jax inference server batch "
        "cache attention layer weight prompt sample greedy decode encode vocabulary café naïve über"
    ).split()
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(300)]
    # byte_fallback needs 256 byte pieces plus every character seen, so ~300 is about the smallest usable vocab.
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(directory / "tokenizer"),
        vocab_size=300,
        byte_fallback=True,
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
        **options,
    )
    return directory / "tokenizer.model"


@pytest.fixture(scope="module")
def sp_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A Llama-like BPE model (no normalization, spaces kept) and sentencepiece's defaults (unigram, NFKC)."""
    bpe_dir = tmp_path_factory.mktemp("sp_bpe")
    bpe = _train_sentencepiece(
        bpe_dir, model_type="bpe", normalization_rule_name="identity", remove_extra_whitespaces=False
    )
    (bpe_dir / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    unigram = _train_sentencepiece(tmp_path_factory.mktemp("sp_unigram"))
    return {"bpe": bpe, "unigram": unigram}


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
@pytest.mark.parametrize("text", SP_TEXTS.values(), ids=SP_TEXTS.keys())
def test_sentencepiece_matches_sentencepiece(sp_models: dict[str, Path], kind: str, text: str) -> None:
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_models[kind]))
    tok = load_tokenizer(sp_models[kind])
    expected = [sp.bos_id(), *sp.encode(text)]
    assert tok.encode(text) == expected
    assert tok.encode(text, add_special_tokens=False) == expected[1:]
    assert tok.decode(expected) == sp.decode(expected)
    assert tok.decode(expected, skip_special_tokens=False).startswith("<s>")


@pytest.mark.parametrize("text", SP_TEXTS.values(), ids=SP_TEXTS.keys())
def test_sentencepiece_matches_transformers_llama(sp_models: dict[str, Path], text: str) -> None:
    transformers = pytest.importorskip("transformers")
    if text[:1].isspace() or "<s>" in text:
        # transformers' Metaspace adds no dummy prefix to text that starts with a space (sentencepiece does),
        # and it parses "<s>" in text as BOS (sentencepiece does not).
        pytest.skip("transformers deliberately differs from sentencepiece here")
    directory = sp_models["bpe"].parent
    ref = transformers.LlamaTokenizer.from_pretrained(str(directory))
    tok = load_tokenizer(directory)
    assert tok.encode(text) == ref(text).input_ids
    assert tok.decode(tok.encode(text)) == ref.decode(ref(text).input_ids, skip_special_tokens=True)


def _gguf_metadata_from_sentencepiece(model: Path) -> dict[str, Any]:
    """What llama.cpp's converter stores for a sentencepiece model, built from the model itself."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(model))

    def token_type(i: int) -> int:
        checks = [(sp.is_unknown, 2), (sp.is_control, 3), (sp.is_byte, 6), (sp.is_unused, 5)]
        return next((kind for check, kind in checks if check(i)), 1)

    n = sp.get_piece_size()
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": [token_type(i) for i in range(n)],
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
    }


@pytest.mark.parametrize("text", SP_TEXTS.values(), ids=SP_TEXTS.keys())
def test_gguf_llama_kind_matches_sentencepiece(sp_models: dict[str, Path], text: str) -> None:
    """A llama-kind GGUF with add_space_prefix (merges from scores, dummy prefix) tokenizes like sentencepiece."""
    import sentencepiece

    if "<s>" in text:
        pytest.skip("llama.cpp (and so our GGUF path) parses control tokens in text; sentencepiece does not")
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_models["bpe"]))
    tok = Tokenizer.from_gguf(_gguf_metadata_from_sentencepiece(sp_models["bpe"]))
    expected = [sp.bos_id(), *sp.encode(text)]
    assert tok.encode(text) == expected
    assert tok.decode(expected) == sp.decode(expected)


# ---- token bytes ------------------------------------------------------------------------------------------


def _check_token_bytes(tok: Tokenizer, text: str) -> None:
    """The tokens' bytes, joined, decode to what the tokens decode to (special tokens kept) after a plain token:
    the context keeps a sentencepiece decoder from stripping the first token's space, which its bytes keep."""
    ids = tok.encode(text, add_special_tokens=False)
    context = tok.encode("a", add_special_tokens=False)[-1:]
    joined = b"".join(tok.token_bytes(i) for i in ids)
    head = tok.decode(context, skip_special_tokens=False)
    assert head + joined.decode("utf-8") == tok.decode([*context, *ids], skip_special_tokens=False)


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_gguf_token_bytes(name: str) -> None:
    tok = _ours(name)
    for text in TEXTS.values():
        _check_token_bytes(tok, text)
    # The pieces of a split character are its bytes; a token decoded alone shows U+FFFD for them.
    beaver = tok.encode("🦫", add_special_tokens=False)
    assert len(beaver) > 1 and all(tok.decode([i]) == "\ufffd" for i in beaver)
    assert b"".join(tok.token_bytes(i) for i in beaver) == "🦫".encode()
    eos = tok.eos_token_ids[0]
    assert tok.token_bytes(eos) == tok.decode([eos], skip_special_tokens=False).encode()
    with pytest.raises(IndexError):
        tok.token_bytes(tok.vocab_size)


def test_gguf_token_bytes_of_every_token() -> None:
    """Every SmolLM2 token's bytes decode to the token decoded alone, U+FFFD for each piece of a character in it
    (the byte-level decoder's lossy UTF-8, as Python's errors="replace")."""
    tok = _ours("smollm2")
    split = 0
    for i in range(tok.vocab_size):
        raw = tok.token_bytes(i)
        assert raw.decode("utf-8", errors="replace") == tok.decode([i], skip_special_tokens=False), i
        split += raw != raw.decode("utf-8", errors="replace").encode()
    assert 0 < split < tok.vocab_size // 100


def test_byte_fallback_token_bytes() -> None:
    tok = _ours("gemma3")
    byte = tok.token_to_id("<0xF0>")
    assert byte is not None and tok.token_bytes(byte) == b"\xf0"


def test_hf_dir_token_bytes(hf_dir: Path) -> None:
    tok = load_tokenizer(hf_dir)
    for text in TEXTS.values():
        _check_token_bytes(tok, text)


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_sentencepiece_token_bytes(sp_models: dict[str, Path], kind: str) -> None:
    """sentencepiece itself, and (bpe) the llama-kind GGUF and the fast tokenizer.json transformers converts it to
    (its Metaspace / Replace decoder spells "▁" as a space and strips the first one)."""
    toks = [load_tokenizer(sp_models[kind])]
    if kind == "bpe":
        toks.append(Tokenizer.from_gguf(_gguf_metadata_from_sentencepiece(sp_models["bpe"])))
    for tok in toks:
        for text in SP_TEXTS.values():
            _check_token_bytes(tok, text)
        word = tok.encode("the", add_special_tokens=False)  # with the dummy prefix, which decode() strips
        assert b"".join(tok.token_bytes(i) for i in word) == b" the" and tok.decode(word) == "the"


def test_hf_dir_sentencepiece_token_bytes(sp_models: dict[str, Path], tmp_path: Path) -> None:
    """The fast tokenizer.json transformers converts the sentencepiece model to (a Replace, ByteFallback, Fuse,
    Strip decoder); and the same with a Metaspace decoder (on text that needs no byte fallback)."""
    import tokenizers

    transformers = pytest.importorskip("transformers")
    fast = transformers.LlamaTokenizerFast.from_pretrained(str(sp_models["bpe"].parent))
    fast.save_pretrained(tmp_path)
    tok = Tokenizer.from_hf_dir(tmp_path)
    for text in SP_TEXTS.values():
        _check_token_bytes(tok, text)
    assert tok.token_bytes(tok.token_to_id("<0xF0>")) == b"\xf0"

    tk = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tk.decoder = tokenizers.decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tk.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_hf_dir(tmp_path)
    for key in ("plain", "hello", "python", "leading_spaces"):
        _check_token_bytes(tok, SP_TEXTS[key])


# ---- errors ------------------------------------------------------------------------------------------------


def _write_gguf(path: Path, tokenizer_model: str, pre: str | None = None) -> Path:
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_tokenizer_model(tokenizer_model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.add_token_types([1, 1, 1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tiny_gguf_file(tmp_path: Path) -> None:
    tok = load_tokenizer(_write_gguf(tmp_path / "tiny.gguf", "gpt2", pre="default"))
    assert tok.encode("abab") == [2, 2] and tok.decode([2, 0]) == "aba"
    assert tok.bos_token_id is None and tok.eos_token_ids == ()


def test_missing_file() -> None:
    with pytest.raises(TokenizerNotFoundError, match="does not exist"):
        load_tokenizer("/nonexistent/model.gguf")
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_gguf("/nonexistent/model.gguf")


def test_unknown_gguf_tokenizer_model(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedTokenizerError, match="'rwkv'"):
        load_tokenizer(_write_gguf(tmp_path / "rwkv.gguf", "rwkv"))


def test_unknown_gguf_pre_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedTokenizerError, match="'mystery-pre'"):
        load_tokenizer(_write_gguf(tmp_path / "pre.gguf", "gpt2", pre="mystery-pre"))


def test_dir_without_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerNotFoundError, match="no tokenizer in directory"):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_not_a_tokenizer_file(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(TokenizerNotFoundError, match="not a tokenizer file"):
        load_tokenizer(path)


@pytest.fixture(scope="module")
def saved(pair: tuple[Tokenizer, Any], tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A GGUF's tokenizer written by `Tokenizer.save_pretrained` and read back from that directory alone."""
    ours, _ = pair
    return load_tokenizer(ours.save_pretrained(tmp_path_factory.mktemp("saved")))


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_a_saved_tokenizer_encodes_and_decodes_as_transformers(saved: Tokenizer, pair, text: str) -> None:
    """What a start reads instead of rebuilding a GGUF's vocabulary (the conversion cache, `jaxinfer convert`)."""
    _, ref = pair
    ids = ref(text).input_ids
    assert saved.encode(text) == ids
    assert saved.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False).input_ids
    for skip in (True, False):
        assert saved.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_a_saved_tokenizer_keeps_the_special_ids_template_and_bytes(saved: Tokenizer, pair) -> None:
    ours, ref = pair
    assert (saved.bos_token_id, saved.eos_token_ids[0], saved.pad_token_id, saved.unk_token_id) == (
        ref.bos_token_id, ref.eos_token_id, ref.pad_token_id, ref.unk_token_id,
    )  # fmt: skip
    assert (saved.add_bos_token, saved.vocab_size) == (ref.add_bos_token, len(ref))
    assert (saved.eos_token_ids, saved.chat_template, saved.special_token_ids) == (
        ours.eos_token_ids, ours.chat_template, ours.special_token_ids,
    )  # fmt: skip
    if saved.chat_template is not None:
        expected = ref.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
        assert saved.apply_chat_template(CONVERSATION) == expected
    step = max(1, saved.vocab_size // 4000)
    assert all(saved.token_bytes(i) == ours.token_bytes(i) for i in range(0, saved.vocab_size, step))
    assert all(saved.is_byte_piece(i) == ours.is_byte_piece(i) for i in range(0, saved.vocab_size, step))


def test_saving_again_replaces_the_template_and_a_sentencepiece_model_is_refused(smollm2, sp_models, tmp_path):
    ours, _ = smollm2
    ours.save_pretrained(tmp_path)
    base = copy.copy(ours)
    base.chat_template = None  # a model without a template, saved over one with
    base.save_pretrained(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.chat_template is None and not (tmp_path / "chat_template.jinja").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    with pytest.raises(TypeError, match="tokenizer.model"):
        load_tokenizer(sp_models["bpe"]).save_pretrained(tmp_path / "sp")


GEMMA_STYLE = """{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}
{{ m.content | trim }}<end_of_turn>
{% endfor %}{% if add_generation_prompt %}<start_of_turn>model
{% endif %}"""


def test_a_chat_template_given_for_a_base_model_renders_and_stops_at_its_end_of_turn() -> None:
    """Gemma 3 270M base ships no chat template: --chat-template / LLM(chat_template=...) gives one, and its
    end-of-turn marker joins the stop ids, as the model's own template's would."""
    from jaxinfer.tokenizer import ChatTemplateError

    base = _ours("gemma3")
    if base.chat_template is not None:
        pytest.skip("this Gemma 3 GGUF ships a chat template")
    with pytest.raises(ChatTemplateError, match="no chat template.*chat_template=|no chat template.*--chat-template"):
        base.apply_chat_template([{"role": "user", "content": "Hi"}])
    chat = base.with_chat_template(GEMMA_STYLE)
    assert chat.apply_chat_template([{"role": "user", "content": " Hi "}]).endswith(
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    )
    assert 106 in chat.eos_token_ids and 106 not in base.eos_token_ids and base.chat_template is None
    with pytest.raises(ChatTemplateError, match="does not compile"):
        base.with_chat_template("{% for m in messages %}")
