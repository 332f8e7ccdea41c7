"""What a model is, in the words people know it by: its architecture family ("gpt-oss", "Qwen3.5-MoE")
and its size in parameters ("20.9B, 3.6B active"), from what app/model_files.py read of its headers.

The names here are for people; the engine's own registry (engine/models/families.py) decides what
runs, and pulls in torch, which the app does not import.
"""

from __future__ import annotations

from app.model_files import ModelFileError, ModelInfo, inspect_model, is_model_path

# GGUF `general.architecture` (llama.cpp's names) and config.json `model_type` → the family's name
FAMILY_NAMES = {
    "gpt-oss": "gpt-oss", "gpt_oss": "gpt-oss",
    "qwen35moe": "Qwen3.5-MoE", "qwen3_5_moe": "Qwen3.5-MoE", "qwen3_5_moe_text": "Qwen3.5-MoE",
    "qwen3moe": "Qwen3-MoE", "qwen3_moe": "Qwen3-MoE",
    "glm4moe": "GLM-4.5", "glm4_moe": "GLM-4.5",
    "deepseek2": "DeepSeek-V2", "deepseek_v2": "DeepSeek-V2",
    "olmoe": "OLMoE", "mixtral": "Mixtral", "llama": "Llama",
}


def family_name(info: ModelInfo) -> str:
    arch = info.architecture
    if not arch:
        return "unknown architecture"
    return FAMILY_NAMES.get(arch, arch)


def params_text(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def describe(info: ModelInfo) -> str:
    """One line: "gpt-oss · 20.9B parameters, 3.6B active" (what is not known is left out)."""
    text = family_name(info)
    if info.params:
        text += f" · {params_text(info.params)} parameters"
        if info.active_params:
            text += f", {params_text(info.active_params)} active"
    return text


def describe_model(model: str | None) -> str | None:
    """describe() of a model given as a file or folder; None for built-in and remote models, or a
    file whose header cannot be read (its load says why)."""
    if not is_model_path(model):
        return None
    try:
        return describe(inspect_model(model))
    except (ModelFileError, OSError):
        return None
