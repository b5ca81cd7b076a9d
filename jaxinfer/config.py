"""Model configuration: one frozen dataclass for every supported decoder family.

A config is read from an HF `config.json` dict or from GGUF metadata. Anything we cannot honour exactly raises
`UnsupportedConfigError` naming the field: a silently different model is worse than no model.
Configs are hashable so they can be static arguments of jitted functions.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
# Families whose activations overflow float16 (Gemma 3's: NaN in the first layers); vLLM refuses float16 for them.
FLOAT16_UNSTABLE = frozenset({"gemma3"})
# A user's own nnx.Module (jaxinfer.model.protocol): its config describes the KV cache, the module does the rest.
CUSTOM_ARCH = "custom"

# HF `model_type` -> our family. Mistral is the Llama block with an optional sliding window.
_HF_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
}

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


class UnsupportedConfigError(ValueError):
    """The checkpoint asks for something this engine does not implement."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding frequencies. `kind` follows HF's rope_type names."""

    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True
    # Per-frequency divisors of the inverse frequencies (head_dim // 2 of them), after `kind`'s rule: how llama.cpp
    # stores Llama 3's scaling (a GGUF's rope_freqs.weight tensor, its rope.scaling.type left at none).
    freq_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.freq_factors is not None:  # a list when read back from JSON; the config is hashed
            object.__setattr__(self, "freq_factors", tuple(float(x) for x in self.freq_factors))


_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    # Gemma 3 sliding layers use their own RoPE base; None means every layer uses `rope`.
    rope_local: RopeConfig | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    activation: str = "silu"  # silu | gelu_tanh | gelu
    # Gemma stores RMSNorm weights as w and scales by (1 + w).
    norm_offset: float = 0.0
    # Gemma multiplies embeddings by sqrt(hidden_size).
    embed_scale: bool = False
    # Gemma 2/3: extra norms after attention and after the MLP.
    sandwich_norm: bool = False
    # Per layer: sliding window length, or 0 for full attention.
    layer_windows: tuple[int, ...] = ()
    query_scale: float | None = None  # default head_dim ** -0.5
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.arch not in ARCHS and self.arch != CUSTOM_ARCH:
            raise UnsupportedConfigError(f"unknown architecture {self.arch!r}; supported: {', '.join(ARCHS)}")
        for name in _SIZES:  # a 0 (an own model's config, a damaged file) failed much later, in pool sizing
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise UnsupportedConfigError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.activation not in ("silu", "gelu_tanh", "gelu"):
            raise UnsupportedConfigError(f"unsupported activation {self.activation!r}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (0,) * self.num_layers)
        if len(self.layer_windows) != self.num_layers:
            raise UnsupportedConfigError(
                f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers"
            )

    @property
    def scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise UnsupportedConfigError(f"unknown ModelConfig fields: {sorted(unknown)}")
        for key in ("rope", "rope_local"):
            if isinstance(d.get(key), dict):
                d[key] = RopeConfig(**d[key])
        if "layer_windows" in d:
            d["layer_windows"] = tuple(d["layer_windows"])
        return cls(**d)


# ---------------------------------------------------------------------------------------------- HF config.json


def _rope_from_hf(params: dict[str, Any] | None, theta: float, max_pos: int) -> RopeConfig:
    params = dict(params or {})
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", theta))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeConfig(
            theta=theta,
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(params["original_max_position_embeddings"]),
        )
    if kind == "yarn":
        orig = params.get("original_max_position_embeddings")
        orig = int(orig) if orig else max_pos
        # No factor: the context's growth over the original (transformers' reading, DeepSeek-V3's configs).
        factor = float(params["factor"]) if params.get("factor") is not None else max_pos / orig
        attention_factor = params.get("attention_factor")
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if attention_factor is None and mscale and mscale_all_dim:  # both or neither, as transformers reads them
            attention_factor = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
        return RopeConfig(
            theta=theta,
            kind="yarn",
            factor=factor,
            original_max_position=orig,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=attention_factor,
            truncate=bool(params.get("truncate", True)),
        )
    raise UnsupportedConfigError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3, yarn)")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context grown `factor` times (the paper's 0.1 ln(s) + 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


# transformers' Gemma3TextConfig defaults, in its 4.x layout (rope_theta, rope_local_base_freq, sliding_window_pattern).
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window": 4096, "sliding_window_pattern": 6,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
}  # fmt: skip


class _RequiredFields(dict):
    """A config.json whose `cfg[name]` names the field it lacks (it was a bare KeyError: 'hidden_size')."""

    def __missing__(self, key: str) -> Any:
        raise UnsupportedConfigError(f"config.json: {key!r} is missing (model_type={self.get('model_type')!r})")


def from_hf_config(cfg: dict[str, Any], dtype: str = "float32") -> ModelConfig:
    """Builds a ModelConfig from the dict of an HF `config.json` (transformers 4.x or 5.x layout)."""
    model_type = cfg.get("model_type")
    if model_type == "gemma3" and "text_config" in cfg:  # multimodal wrapper: we serve its text tower
        cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
        model_type = "gemma3_text"
    arch = _HF_MODEL_TYPES.get(model_type or "")
    if arch is None:
        raise UnsupportedConfigError(
            f"unknown architecture model_type={model_type!r}; supported: {', '.join(sorted(_HF_MODEL_TYPES))}"
        )
    if arch == "gemma3":  # released configs (google/gemma-3-4b-it's text_config) write only what differs from these
        cfg = {**_GEMMA3_TEXT_DEFAULTS, **cfg}
    cfg = _RequiredFields(cfg)
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act not in _ACTIVATIONS:
        raise UnsupportedConfigError(f"hidden_act={act!r} is not supported")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedConfigError("partial_rotary_factor != 1 is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedConfigError("use_bidirectional_attention=True is not supported")
    if cfg.get("num_experts") or cfg.get("num_local_experts"):
        raise UnsupportedConfigError("mixture-of-experts checkpoints are not supported")
    quant = cfg.get("quantization_config")
    if quant:  # read as plain weights, its int8/fp8 tensors would run without their scales: garbage, silently
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise UnsupportedConfigError(
            f"quantization_config (quant_method={method!r}) is not supported: load unquantized weights, or a GGUF"
        )

    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    layers = int(cfg["num_hidden_layers"])
    max_pos = int(cfg.get("max_position_embeddings") or 8192)
    theta = float(cfg.get("rope_theta", 10000.0))

    # transformers 5 keeps RoPE settings in `rope_parameters`; Gemma 3 nests one entry per layer type there.
    rope_params = cfg.get("rope_parameters")
    rope_local = None
    if arch == "gemma3":
        if rope_params and "full_attention" in rope_params:
            rope = _rope_from_hf(rope_params["full_attention"], theta, max_pos)
            rope_local = _rope_from_hf(rope_params.get("sliding_attention"), 10000.0, max_pos)
        else:
            rope = _rope_from_hf(cfg.get("rope_scaling") or rope_params, theta, max_pos)
            rope_local = RopeConfig(theta=float(cfg.get("rope_local_base_freq", 10000.0)))
    else:
        rope = _rope_from_hf(rope_params if rope_params is not None else cfg.get("rope_scaling"), theta, max_pos)

    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if layer_types:
        bad = set(layer_types) - {"full_attention", "sliding_attention"}
        if bad:
            raise UnsupportedConfigError(f"layer_types {sorted(bad)} are not supported")
        if "sliding_attention" in layer_types and not window:
            raise UnsupportedConfigError("layer_types has sliding_attention layers, but sliding_window is not set")
        windows = tuple(int(window) if t == "sliding_attention" else 0 for t in layer_types)
    elif arch == "gemma3":
        pattern = int(cfg.get("sliding_window_pattern", 6))
        windows = tuple(0 if (i + 1) % pattern == 0 else int(window) for i in range(layers))
    elif arch in ("qwen2", "qwen3") and cfg.get("use_sliding_window") and window:
        first = int(cfg.get("max_window_layers", layers))
        windows = tuple(int(window) if i >= first else 0 for i in range(layers))
    elif model_type == "mistral" and window:
        windows = (int(window),) * layers
    else:
        windows = (0,) * layers

    gemma = arch == "gemma3"
    bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        arch=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=rope,
        rope_local=rope_local,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        # Qwen2 always has q/k/v biases; Llama's attention_bias covers q/k/v/o.
        qkv_bias=True if arch == "qwen2" else bias,
        out_bias=bias if arch in ("llama", "qwen3", "gemma3") else False,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch in ("qwen3", "gemma3"),
        activation=_ACTIVATIONS[act],
        norm_offset=1.0 if gemma else 0.0,
        embed_scale=gemma,
        sandwich_norm=gemma,
        layer_windows=windows,
        query_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5 if gemma else None,
        # None of these families caps attention scores: Gemma 3's config still carries Gemma 2's
        # attn_logit_softcapping, which transformers and llama.cpp leave unused. (Own models may set it.)
        final_logit_softcap=cfg.get("final_logit_softcapping"),
        dtype=dtype,
    )


# ---------------------------------------------------------------------------------------------- GGUF metadata

_GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}


def from_gguf_metadata(meta: dict[str, Any], dtype: str = "float32") -> ModelConfig:
    """Builds a ModelConfig from GGUF key/values (already decoded to Python values)."""
    gguf_arch = meta.get("general.architecture")
    arch = _GGUF_ARCHS.get(gguf_arch or "")
    if arch is None:
        raise UnsupportedConfigError(
            f"unknown architecture general.architecture={gguf_arch!r} in GGUF; supported: {', '.join(_GGUF_ARCHS)}"
        )

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{gguf_arch}.{key}", default)

    needed = ("embedding_length", "attention.head_count", "block_count")
    missing = [f"{gguf_arch}.{k}" for k in needed if get(k) is None]
    if missing:  # e.g. a tokenizer-only GGUF (a checkpoint's tokenizer.gguf): it names an architecture, holds no model
        raise UnsupportedConfigError(f"GGUF has no {', '.join(missing)}: not a model file (a tokenizer-only GGUF?)")
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv") or heads)
    head_dim = int(get("attention.key_length") or hidden // heads)
    if int(get("attention.value_length") or head_dim) != head_dim:
        raise UnsupportedConfigError("attention.value_length != attention.key_length is not supported")
    rot = get("rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise UnsupportedConfigError(f"rope.dimension_count={rot} != head_dim={head_dim} (partial RoPE)")
    layers = int(get("block_count"))
    vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    scaling = get("rope.scaling.type")
    theta = float(get("rope.freq_base", 10000.0))
    if scaling in (None, "none"):
        rope = RopeConfig(theta=theta)
    elif scaling == "linear":
        rope = RopeConfig(theta=theta, kind="linear", factor=float(get("rope.scaling.factor")))
    elif scaling == "yarn":
        rope = RopeConfig(
            theta=theta,
            kind="yarn",
            factor=float(get("rope.scaling.factor")),
            # llama.cpp's default too: the training context
            original_max_position=int(get("rope.scaling.original_context_length") or get("context_length") or 8192),
        )
    else:
        raise UnsupportedConfigError(f"GGUF rope.scaling.type={scaling!r} is not supported")

    gemma = arch == "gemma3"
    window = int(get("attention.sliding_window") or 0)
    if gemma:
        # llama.cpp hard-codes Gemma 3's pattern: every 6th layer is global, the rest slide.
        windows = tuple(0 if (i + 1) % 6 == 0 else window for i in range(layers))
    else:
        windows = (window,) * layers
    return ModelConfig(
        arch=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope=rope,
        rope_local=RopeConfig(theta=10000.0) if gemma else None,
        max_position_embeddings=int(get("context_length") or 8192),
        tie_word_embeddings=False,  # decided by the loader: tied when there is no output.weight
        qkv_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "gemma3"),
        activation="gelu_tanh" if gemma else "silu",
        norm_offset=1.0 if gemma else 0.0,
        embed_scale=gemma,
        sandwich_norm=gemma,
        layer_windows=windows,
        query_scale=head_dim**-0.5,
        final_logit_softcap=get("final_logit_softcapping"),  # attention's: see from_hf_config
        dtype=dtype,
    )


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[list[float], float]:
    """Inverse frequencies (head_dim // 2 of them) and the cos/sin scale, following HF's rope_type rules, then
    divided by `freq_factors` where given (llama.cpp's rope_freqs)."""
    inv_freq, scale = _scaled_inv_freq(rope, head_dim)
    if rope.freq_factors is None:
        return inv_freq, scale
    if len(rope.freq_factors) != len(inv_freq):
        raise UnsupportedConfigError(
            f"rope freq_factors: {len(rope.freq_factors)} of them for head_dim {head_dim} (expected {len(inv_freq)})"
        )
    return [f / d for f, d in zip(inv_freq, rope.freq_factors, strict=True)], scale


def _scaled_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[list[float], float]:
    half = head_dim // 2
    base = [1.0 / (rope.theta ** (2 * i / head_dim)) for i in range(half)]
    if rope.kind == "default":
        return base, 1.0
    if rope.kind == "linear":
        return [f / rope.factor for f in base], 1.0
    if rope.kind == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        out = []
        for f in base:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / rope.factor)
            else:
                smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
                    rope.high_freq_factor - rope.low_freq_factor
                )
                out.append((1 - smooth) * f / rope.factor + smooth * f)
        return out, 1.0
    if rope.kind == "yarn":

        def correction_dim(rotations: float) -> float:
            return (head_dim * math.log(rope.original_max_position / (rotations * 2 * math.pi))) / (
                2 * math.log(rope.theta)
            )

        low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        out = []
        for i, f in enumerate(base):
            ramp = min(max((i - low) / (high - low), 0.0), 1.0)
            extrapolation = 1.0 - ramp
            out.append((f / rope.factor) * (1 - extrapolation) + f * extrapolation)
        scale = _yarn_mscale(rope.factor) if rope.attention_factor is None else rope.attention_factor
        return out, float(scale)
    raise UnsupportedConfigError(f"rope kind {rope.kind!r} is not supported")
