"""orbax round trip, the GGUF conversion cache, and clear errors for broken or unsupported inputs."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest

from jaxinfer.config import ModelConfig, UnsupportedConfigError, from_gguf_metadata, from_hf_config
from jaxinfer.model import init_params
from jaxinfer.types import SamplingParams
from jaxinfer.weights import gguf_loader, load_weights, read_model_config
from jaxinfer.weights.checkpoint import CheckpointError, restore_checkpoint, save_checkpoint
from jaxinfer.weights.convert import convert
from tests.model.hf_reference import build

TINY = ModelConfig(
    arch="gemma3", vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2,
    num_kv_heads=1, head_dim=16, qk_norm=True, sandwich_norm=True, norm_offset=1.0, embed_scale=True,
    tie_word_embeddings=True, layer_windows=(4, 0),
)  # fmt: skip


def _assert_same(a, b):
    la, lb = jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_identical(tmp_path, dtype):
    cfg = TINY.replace(dtype=dtype)
    params = init_params(cfg, seed=3)
    save_checkpoint(tmp_path / "ck", cfg, params, source={"kind": "test"})
    cfg2, params2, source = restore_checkpoint(tmp_path / "ck")
    assert cfg2 == cfg and source == {"kind": "test"}
    _assert_same(params, params2)


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="not a jaxinfer checkpoint"):
        restore_checkpoint(tmp_path / "nowhere")


def test_corrupt_checkpoint(tmp_path):
    save_checkpoint(tmp_path / "ck", TINY, init_params(TINY))
    # Truncate every data file of the orbax tree.
    data = [p for p in (tmp_path / "ck" / "params").rglob("*") if p.is_file() and p.stat().st_size > 100]
    assert data
    for p in data:
        p.write_bytes(p.read_bytes()[:20])
    with pytest.raises(CheckpointError, match="corrupt or incomplete"):
        restore_checkpoint(tmp_path / "ck")


def test_an_interrupted_save_leaves_no_files_and_abandoned_ones_are_swept(tmp_path, monkeypatch):
    """Ctrl-C during a conversion left a model's worth of files (318 MB for the default model) in a temporary
    sibling that nothing removed; a killed writer's siblings piled up the same way."""
    import os
    import time

    import orbax.checkpoint as ocp

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(ocp.StandardCheckpointer, "save", interrupted)
        with pytest.raises(KeyboardInterrupt):
            save_checkpoint(tmp_path / "ck", TINY, init_params(TINY))
    assert list(tmp_path.iterdir()) == []

    dead_pid = 2**22 + 12345  # above Linux's pid_max: no process has it
    abandoned, recent, live = (tmp_path / f"ck.tmp-{pid}-7" for pid in (dead_pid, dead_pid + 1, os.getppid()))
    for d in (abandoned, recent, live):
        (d / "params").mkdir(parents=True)
    hours_ago = time.time() - 2 * 3600
    for d in (abandoned, live):
        os.utime(d, (hours_ago, hours_ago))
    save_checkpoint(tmp_path / "ck", TINY, init_params(TINY))
    # Only the old one of a dead process goes: a recent one may be another host's writer (a shared cache).
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ck", recent.name, live.name])


def test_incomplete_and_mismatched_checkpoint(tmp_path):
    save_checkpoint(tmp_path / "ck", TINY, init_params(TINY))
    meta_path = tmp_path / "ck" / "jaxinfer.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["hidden_size"] = 64  # the stored arrays no longer fit the config
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError):
        restore_checkpoint(tmp_path / "ck")
    meta["config"]["num_layers"] = 3  # hand-edited: its layer_windows still list 2 layers
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"jaxinfer.json of .*ck holds no valid config: .*layer_windows"):
        restore_checkpoint(tmp_path / "ck")
    meta_path.write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt"):
        restore_checkpoint(tmp_path / "ck")
    shutil.rmtree(tmp_path / "ck" / "params")
    meta_path.write_text(json.dumps({**meta, "config": TINY.to_dict()}))
    with pytest.raises(CheckpointError, match="params/ directory is missing"):
        restore_checkpoint(tmp_path / "ck")


def _write_tokenizer(path):
    """A word-level tokenizer.json (the loader reads any HF tokenizer file)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def test_convert_hf_dir_round_trip(tmp_path):
    build("qwen3", tmp_path / "hf")
    _write_tokenizer(tmp_path / "hf")
    cfg, params, _ = load_weights(tmp_path / "hf")
    convert(str(tmp_path / "hf"), tmp_path / "ck")
    cfg2, params2, path = load_weights(tmp_path / "ck")
    assert cfg2 == cfg
    _assert_same(params, params2)
    # The checkpoint holds the source's tokenizer files: it stands on its own once the source is gone.
    (tmp_path / "hf").rename(tmp_path / "gone")
    from jaxinfer.weights import load_model

    assert path == tmp_path / "ck" and load_model(tmp_path / "ck").tokenizer.encode("hello world") == [1, 2]


def test_a_checkpoint_converted_from_a_checkpoint_keeps_the_tokenizer(tmp_path):
    """convert ckpt -> ckpt2 wrote no tokenizer.gguf and named ckpt an "hf" source: once ckpt moved, ckpt2 failed
    to load (TokenizerNotFoundError)."""
    from jaxinfer.weights import load_model
    from jaxinfer.weights.checkpoint import read_meta
    from tests.tiny_model import write_tiny_model

    write_tiny_model(tmp_path / "tiny")  # its tokenizer is its source GGUF's
    convert(str(tmp_path / "tiny"), tmp_path / "a")  # writes the tokenizer (save_pretrained) beside the weights
    assert (tmp_path / "a" / "tokenizer.json").is_file() and not (tmp_path / "a" / "tokenizer.gguf").exists()
    convert(str(tmp_path / "a"), tmp_path / "b")
    assert read_meta(tmp_path / "b")["source"]["kind"] == "checkpoint"
    (tmp_path / "a").rename(tmp_path / "gone")
    assert load_model(tmp_path / "b").tokenizer.encode("Hello world") == load_model(tmp_path / "tiny").tokenizer.encode(
        "Hello world"
    )


def test_convert_never_overwrites_what_is_not_a_checkpoint(tmp_path):
    build("qwen3", tmp_path / "hf")
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="exists and is not a jaxinfer checkpoint"):
        convert(str(tmp_path / "hf"), tmp_path / "dst")
    with pytest.raises(CheckpointError, match="is the source"):
        convert(str(tmp_path / "hf"), tmp_path / "hf")
    assert (tmp_path / "dst" / "notes.txt").read_text() == "mine" and (tmp_path / "hf" / "config.json").exists()
    convert(str(tmp_path / "hf"), tmp_path / "ck")
    convert(str(tmp_path / "hf"), tmp_path / "ck")  # a checkpoint is replaced


@pytest.fixture(scope="module")
def smol_converted(tmp_path_factory):
    """A conversion cache holding SmolLM2's conversion, made once for this module (a conversion dequantizes and
    saves 540 MB: ~9 s on the CI machine class), and the params that first load returned."""
    from jaxinfer.model_files import smollm2_gguf

    cache_dir = tmp_path_factory.mktemp("converted")
    cfg, params, _ = load_weights(smollm2_gguf(), cache_dir=cache_dir)
    return cache_dir, cfg, params


def test_read_model_config_is_what_loading_reads(smol_converted, tmp_path, monkeypatch):
    """The config read from metadata alone equals the loaded one for an HF directory, a checkpoint and a GGUF file
    (whose tied output head, decided by its tensors, is the one field it leaves at the default, unless the default
    conversion cache holds the file's conversion: then that conversion's config, without reading the GGUF)."""
    import jaxinfer.weights as weights
    from jaxinfer.model_files import smollm2_gguf

    build("qwen3", tmp_path / "hf")
    save_checkpoint(tmp_path / "ck", TINY, init_params(TINY))
    for path in (tmp_path / "hf", tmp_path / "ck"):
        for dtype in ("auto", "bfloat16"):
            assert read_model_config(path, dtype) == load_weights(path, dtype)[0], (path, dtype)
    loaded = load_weights(smollm2_gguf(), cache_dir=smol_converted[0])[0]  # the module's conversion: no new one
    monkeypatch.setattr(weights, "default_cache_dir", lambda: tmp_path / "empty")
    assert read_model_config(smollm2_gguf()) == loaded.replace(tie_word_embeddings=False)
    assert loaded.tie_word_embeddings

    def no_header(*args, **kwargs):
        raise AssertionError("read the GGUF's header")

    monkeypatch.setattr(weights, "default_cache_dir", lambda: smol_converted[0])
    monkeypatch.setattr(weights, "read_gguf", no_header)
    assert read_model_config(smollm2_gguf()) == loaded
    with pytest.raises(AssertionError, match="header"):  # no bfloat16 conversion in that cache: the header again
        read_model_config(smollm2_gguf(), "bfloat16")
    with pytest.raises(FileNotFoundError):
        read_model_config(tmp_path / "missing.gguf")


def test_gguf_conversion_cache(smol_converted, monkeypatch):
    """A load of a converted GGUF restores the cached conversion instead of dequantizing again; the cache folder may be
    given as text, as a user passes one."""
    from jaxinfer.model_files import smollm2_gguf

    cache_dir, cfg1, p1 = smol_converted
    calls = []
    real = gguf_loader.load_gguf

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr("jaxinfer.weights.load_gguf", counting)
    cfg2, p2, _ = load_weights(smollm2_gguf(), cache_dir=str(cache_dir))
    assert not calls and cfg1 == cfg2
    _assert_same(p1, p2)


def test_gguf_conversion_cache_restores_onto_a_mesh(smol_converted):
    """The cached conversion restores straight into a mesh's shardings (a 1-device mesh runs the same path as 8)."""
    from jaxinfer.model_files import smollm2_gguf
    from jaxinfer.sharding import make_mesh

    cache_dir, cfg1, p1 = smol_converted
    cfg2, p2, _ = load_weights(smollm2_gguf(), cache_dir=cache_dir, mesh=make_mesh(1, 1))
    assert cfg1 == cfg2
    _assert_same(p1, p2)


def test_damaged_conversion_cache_is_rebuilt_once(smol_converted, tmp_path, monkeypatch, caplog):
    """A damaged cache entry is rebuilt; a restore that fails again raises instead of rebuilding forever. The
    warning says why in one line (orbax's errors quote a TensorStore spec: 3,789 lines were logged)."""
    import jaxinfer.weights as weights
    from jaxinfer.model_files import smollm2_gguf

    cache_dir = tmp_path / "converted"
    shutil.copytree(smol_converted[0], cache_dir)  # this test damages its own copy
    (params_dir,) = cache_dir.glob("*/params")
    shutil.rmtree(params_dir)
    cfg, _, _ = load_weights(smollm2_gguf(), cache_dir=cache_dir)
    assert params_dir.is_dir() and cfg.arch == "llama"

    restores = []

    def always_damaged(path, *args):
        restores.append(path)
        raise CheckpointError(f"{path} is damaged\n" + "spec: {...}\n" * 1000)

    monkeypatch.setattr(weights, "_restore", always_damaged)
    caplog.clear()
    with pytest.raises(CheckpointError, match="damaged"):
        load_weights(smollm2_gguf(), cache_dir=cache_dir)
    assert len(restores) == 2
    (warning,) = [r.getMessage() for r in caplog.records if "ignoring damaged conversion cache" in r.getMessage()]
    assert warning.endswith("is damaged") and "spec" not in warning


def test_a_gguf_tokenizer_is_kept_in_the_cache_and_rebuilt_when_damaged(tmp_path, monkeypatch, caplog):
    """The first load rebuilds a GGUF's tokenizer from its vocabulary and keeps it (`Tokenizer.save_pretrained`) in
    the cache; the next reads it back without the GGUF. A damaged entry is rebuilt and rewritten; `use_cache=False`
    neither reads nor writes one."""
    from jaxinfer.tokenizer import Tokenizer, load_tokenizer
    from jaxinfer.weights import load_model
    from tests.tiny_model import write_tiny_model

    write_tiny_model(tmp_path / "tiny")  # a checkpoint whose tokenizer is its source GGUF's
    built = []
    real = Tokenizer.from_gguf.__func__
    monkeypatch.setattr(Tokenizer, "from_gguf", classmethod(lambda cls, path: built.append(path) or real(cls, path)))
    cache = tmp_path / "cache"
    texts = ["Hello world", "<|im_start|>user\nhé 🌍<|im_end|>\n"]
    first = load_model(tmp_path / "tiny", cache_dir=cache).tokenizer
    (entry,) = cache.iterdir()
    assert len(built) == 1 and (entry / "tokenizer.json").is_file()
    second = load_model(tmp_path / "tiny", cache_dir=str(cache)).tokenizer  # a folder given as text
    assert len(built) == 1
    assert [second.encode(t) for t in texts] == [first.encode(t) for t in texts]
    assert (second.eos_token_ids, second.bos_token_id, second.chat_template) == (
        first.eos_token_ids, first.bos_token_id, first.chat_template,
    )  # fmt: skip

    (entry / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    caplog.clear()
    third = load_model(tmp_path / "tiny", cache_dir=cache).tokenizer
    assert len(built) == 2 and third.encode(texts[1]) == first.encode(texts[1])
    assert any("ignoring damaged tokenizer cache" in r.getMessage() for r in caplog.records)
    assert load_tokenizer(entry).encode(texts[1]) == first.encode(texts[1])  # written whole again

    load_model(tmp_path / "tiny", use_cache=False, cache_dir=tmp_path / "unused")
    assert len(built) == 3 and not (tmp_path / "unused").exists()


def test_the_tokenizer_cache_key_follows_the_file_and_the_code_that_rebuilds_it(tmp_path, monkeypatch):
    """A tokenizer kept by an older jaxinfer (another jaxinfer.tokenizer or GGUF reader) or tokenizers library is
    never read."""
    import os
    from pathlib import Path

    import tokenizers

    import jaxinfer.gguf_file
    import jaxinfer.tokenizer
    from jaxinfer.weights import _tokenizer_cache_key

    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    key = _tokenizer_cache_key(src)
    assert _tokenizer_cache_key(src) == key
    monkeypatch.setattr(tokenizers, "__version__", "0.0.1")
    assert _tokenizer_cache_key(src) != key
    monkeypatch.undo()
    edited = tmp_path / "tokenizer.py"
    edited.write_text(Path(jaxinfer.tokenizer.__file__).read_text() + "\n# a fix\n")
    monkeypatch.setattr(jaxinfer.tokenizer, "__file__", str(edited))
    assert _tokenizer_cache_key(src) != key
    monkeypatch.undo()
    reader = tmp_path / "gguf_file.py"
    reader.write_text(Path(jaxinfer.gguf_file.__file__).read_text() + "\n# a fix\n")
    monkeypatch.setattr(jaxinfer.gguf_file, "__file__", str(reader))
    assert _tokenizer_cache_key(src) != key
    monkeypatch.undo()
    os.utime(src, ns=(10**9, 10**9))  # the file replaced
    assert _tokenizer_cache_key(src) != key


def test_unknown_architecture_hf():
    with pytest.raises(UnsupportedConfigError, match="model_type='gpt2'"):
        from_hf_config({"model_type": "gpt2", "hidden_size": 8})


def test_a_config_json_without_a_needed_field_names_it():
    with pytest.raises(UnsupportedConfigError, match=r"config.json: 'hidden_size' is missing \(model_type='llama'\)"):
        from_hf_config({"model_type": "llama"})


def test_unknown_architecture_gguf():
    with pytest.raises(UnsupportedConfigError, match="general.architecture='falcon'"):
        from_gguf_metadata({"general.architecture": "falcon"})


@pytest.mark.parametrize(("field", "value"), [("num_layers", 0), ("num_kv_heads", 0), ("head_dim", -1),
                                             ("vocab_size", 2.5), ("hidden_size", True)])  # fmt: skip
def test_model_sizes_must_be_positive_integers(field, value):
    """A zero or fractional size is named where the config is made, not met later as a division by zero (num_kv_heads)
    or a KV pool of no layers (num_layers)."""
    with pytest.raises(UnsupportedConfigError, match=f"ModelConfig.{field} must be a positive integer"):
        TINY.replace(**{field: value}, layer_windows=())


def test_a_gguf_without_a_model_is_refused_by_name():
    """A tokenizer-only GGUF (what a checkpoint keeps as tokenizer.gguf) names an architecture and holds no model:
    loading it as one ended in `TypeError: int() argument must be ... not 'NoneType'`."""
    meta = {"general.architecture": "llama", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"]}
    with pytest.raises(UnsupportedConfigError, match="llama.embedding_length.*not a model file"):
        from_gguf_metadata(meta)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "dynamic"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "longrope"),
        ({"hidden_act": "relu"}, "hidden_act"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"num_key_value_heads": 3}, "num_kv_heads"),
        ({"num_local_experts": 8}, "mixture-of-experts"),
        ({"layer_types": ["sliding_attention"], "sliding_window": None}, "sliding_window is not set"),
        # int8 / fp8 tensors read as plain weights would run without their scales
        ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}}, "'bitsandbytes'"),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "quant_method='fp8'"),
    ],
)
def test_unhonourable_config_fields(change, field):
    base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 4}  # fmt: skip
    with pytest.raises(UnsupportedConfigError, match=field):
        from_hf_config(base | change)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_sliding_window_without_layer_types(model_type):
    """Configs written before transformers 4.53 give Qwen's windows as use_sliding_window + max_window_layers."""
    cfg = from_hf_config({"model_type": model_type, "vocab_size": 10, "hidden_size": 16, "intermediate_size": 32,
                          "num_hidden_layers": 3, "num_attention_heads": 2, "head_dim": 8, "use_sliding_window": True,
                          "sliding_window": 4, "max_window_layers": 1})  # fmt: skip
    assert cfg.layer_windows == (0, 4, 4)


def test_transformers4_and_5_layouts_agree():
    """Real checkpoints on disk carry the transformers 4 layout (rope_theta, rope_scaling, sliding_window_pattern)."""
    common = {"vocab_size": 10, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 6,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "sliding_window": 4,
              "query_pre_attn_scalar": 8}  # fmt: skip
    v4 = from_hf_config(
        {
            **common,
            "model_type": "gemma3_text",
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "sliding_window_pattern": 6,
        }  # fmt: skip
    )
    v5 = from_hf_config(
        {
            **common,
            "model_type": "gemma3_text",
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        }  # fmt: skip
    )
    assert v4 == v5
    assert v4.layer_windows == (4, 4, 4, 4, 4, 0)


def test_missing_tensor_is_named(tmp_path):
    build("llama", tmp_path)
    from safetensors.numpy import load_file, save_file

    f = next(tmp_path.glob("*.safetensors"))
    tensors = {k: v for k, v in load_file(f).items() if "layers.1.mlp.up_proj" not in k}
    save_file(tensors, f)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_weights(tmp_path)


def test_bad_gguf_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_weights(bad, use_cache=False)
    with pytest.raises(FileNotFoundError):
        load_weights(tmp_path / "missing.gguf")


def test_sharded_safetensors_index(tmp_path):
    """A checkpoint split over several safetensors files with an index loads the same as a single file."""
    model = build("qwen2", tmp_path / "one")
    model.save_pretrained(tmp_path / "many", max_shard_size="40KB")
    assert (tmp_path / "many" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "many").glob("*.safetensors"))) > 2
    cfg1, p1, _ = load_weights(tmp_path / "one")
    cfg2, p2, _ = load_weights(tmp_path / "many")
    assert cfg1 == cfg2
    _assert_same(p1, p2)
    shard = next((tmp_path / "many").glob("model-00003*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:5])  # truncated: the error names the file
    with pytest.raises(ValueError, match=f"{shard.name} is not a readable safetensors file"):
        load_weights(tmp_path / "many")
    index = tmp_path / "many" / "model.safetensors.index.json"
    index.write_text(index.read_text()[:40])
    with pytest.raises(ValueError, match="model.safetensors.index.json is not a safetensors index"):
        load_weights(tmp_path / "many")
    next((tmp_path / "many").glob("model-00002*.safetensors")).unlink()
    index.write_text(json.dumps({"weight_map": {"x": shard.name, "y": "model-00002-of-nothing.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="missing"):
        load_weights(tmp_path / "many")


def test_a_sparse_gemma3_text_config_takes_transformers_defaults():
    """google/gemma-3-4b-it's config.json gives its text tower's differences only; transformers fills the rest."""
    from transformers import Gemma3TextConfig

    sparse = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
              "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}  # fmt: skip
    ours = from_hf_config({"model_type": "gemma3", "text_config": sparse, "eos_token_id": [1, 106]})
    full = Gemma3TextConfig(**{k: v for k, v in sparse.items() if k != "model_type"}).to_dict()
    assert ours == from_hf_config(full)
    assert (ours.num_heads, ours.num_kv_heads, ours.head_dim, ours.vocab_size) == (8, 4, 256, 262208)
    assert (ours.rope.theta, ours.rope.kind, ours.rope.factor, ours.rope_local.theta) == (1e6, "linear", 8.0, 1e4)


def test_gguf_yarn_without_its_original_context_takes_the_training_one():
    meta = {"general.architecture": "llama", "llama.embedding_length": 16, "llama.attention.head_count": 2,
            "llama.block_count": 1, "llama.vocab_size": 10, "llama.feed_forward_length": 32,
            "llama.context_length": 4096, "llama.rope.scaling.type": "yarn",
            "llama.rope.scaling.factor": 4.0}  # fmt: skip
    rope = from_gguf_metadata(meta).rope
    assert (rope.kind, rope.factor, rope.original_max_position) == ("yarn", 4.0, 4096)


def test_generation_config_gives_the_sampling_defaults(tmp_path):
    """As vLLM's --generation-config auto: the model's recommended sampling for requests that leave it unset."""
    from jaxinfer import LLM
    from jaxinfer.model_files import smollm2_gguf
    from jaxinfer.server.protocol import ChatCompletionRequest, CompletionRequest
    from jaxinfer.server.sampling import chat_params, completion_params
    from jaxinfer.weights import sampling_defaults

    build("qwen3", tmp_path / "hf")
    gen = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 50, "repetition_penalty": 1.1, "bos": 1,
           "max_new_tokens": 24}  # fmt: skip
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps(gen))
    # top_k 50 is transformers' own default; max_new_tokens is vLLM's default max_tokens
    want = {"temperature": 0.6, "top_p": 0.95, "repetition_penalty": 1.1, "max_tokens": 24}
    assert sampling_defaults(tmp_path / "hf") == want and sampling_defaults(smollm2_gguf()) == {}
    settings = dict(tokenizer="smollm2-135m-instruct", max_model_len=64, num_kv_tokens=256, max_num_seqs=2)
    with LLM(str(tmp_path / "hf"), **settings) as llm:
        d = llm.get_default_sampling_params()
        assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty, d.max_tokens) == (0.6, 0.95, 0, 1.1, 24)
        assert llm.engine.sampling_defaults == want
    with LLM(str(tmp_path / "hf"), generation_config="vllm", **settings) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
    # The server: what a request sets wins, what it leaves unset is the model's.
    msgs = [{"role": "user", "content": "hi"}]
    unset = chat_params(ChatCompletionRequest(model="m", messages=msgs), 3, 64, want)[0]
    given = chat_params(ChatCompletionRequest(model="m", messages=msgs, temperature=0.0, top_p=1.0), 3, 64, want)[0]
    assert (unset.temperature, unset.top_p, unset.repetition_penalty) == (0.6, 0.95, 1.1)
    assert (given.temperature, given.top_p, given.repetition_penalty) == (0.0, 1.0, 1.1)
    # max_new_tokens caps a max_tokens the request leaves unset (chat: the rest of the context; completions: 16,
    # or the rest of the context for an explicit null); one it sets is what it gets.
    assert unset.max_tokens == 24 and given.max_tokens == 24
    asked = chat_params(ChatCompletionRequest(model="m", messages=msgs, max_completion_tokens=40), 3, 64, want)[0]
    assert asked.max_tokens == 40
    assert chat_params(ChatCompletionRequest(model="m", messages=msgs), 3, 64, {})[0].max_tokens == 61
    assert completion_params(CompletionRequest(model="m", prompt="hi"), 3, 64, want).max_tokens == 16
    assert completion_params(CompletionRequest(model="m", prompt="hi", max_tokens=None), 3, 64, want).max_tokens == 24
    assert completion_params(CompletionRequest(model="m", prompt="hi", max_tokens=50), 3, 64, want).max_tokens == 50
    small = {**want, "max_tokens": 8}
    assert completion_params(CompletionRequest(model="m", prompt="hi"), 3, 64, small).max_tokens == 8


def test_gemma3_in_float16_is_refused_and_auto_takes_bfloat16(tmp_path, monkeypatch):
    """Gemma 3's activations overflow float16: every token came out <pad> (NaN logits) with a 200. Asked for, it is
    an error (vLLM's too); a float16 checkpoint under "auto" on an accelerator runs in bfloat16 instead."""
    from jaxinfer import weights
    from jaxinfer.model_files import gemma3_270m_gguf

    with pytest.raises(UnsupportedConfigError, match="dtype float16: gemma3"):
        load_weights(gemma3_270m_gguf(), "float16", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()  # refused from the metadata, before any conversion
    build("gemma3", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "dtype": "float16", "torch_dtype": "float16"}))
    monkeypatch.setattr(weights.jax, "default_backend", lambda: "gpu")
    assert load_weights(tmp_path / "hf", "auto")[0].dtype == "bfloat16"
