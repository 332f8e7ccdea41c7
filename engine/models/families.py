"""Registry of architecture families: which file handles a GGUF `general.architecture` or a
config.json `model_type`."""

from __future__ import annotations

from pathlib import Path

from engine.errors import UnsupportedModelError
from engine.models import llama
from engine.models import deepseek_v2, glm4_moe, gpt_oss, mixtral, olmoe, qwen3_5_moe, qwen3_moe

FAMILIES = {m.NAME: m for m in (llama,)}
for _family in (qwen3_moe, mixtral, olmoe, glm4_moe, gpt_oss, qwen3_5_moe, deepseek_v2):
    FAMILIES[_family.NAME] = _family


def _supported() -> str:
    return ", ".join(sorted(FAMILIES))


def for_gguf_arch(arch: str | None, path: Path):
    for fam in FAMILIES.values():
        if arch in fam.GGUF_ARCHS:
            return fam
    raise UnsupportedModelError(f"{path}: GGUF architecture '{arch}' is not supported",
                                f"Tandem runs these families: {_supported()}")


def for_gguf_meta(meta: dict, path: Path):
    """Like for_gguf_arch, but a family may claim files of a shared architecture by their metadata
    (llama.cpp writes Mixtral as `llama` with an expert count)."""
    for fam in FAMILIES.values():
        claims = getattr(fam, "claims_gguf", None)
        if claims is not None and claims(meta):
            return fam
    return for_gguf_arch(meta.get("general.architecture"), path)


def for_model_type(model_type: str | None, path: Path):
    for fam in FAMILIES.values():
        if model_type in fam.MODEL_TYPES:
            return fam
    raise UnsupportedModelError(f"{path}: model_type '{model_type}' is not supported",
                                f"Tandem runs these families: {_supported()}")


def get(name: str):
    return FAMILIES[name]
