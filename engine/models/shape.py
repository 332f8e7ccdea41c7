"""A model's shape without its weights: what calibration needs to measure the machine for it.

Reads GGUF metadata or config.json only (no tensor is dequantised), applies the built-in MoE's
upcycling recipe, and knows the synthetic presets' shapes from their published configs.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from engine.errors import ModelFileError
from engine.hw.shapes import ModelShape
from engine.kv.latent import format_shape
from engine.models import builtin, families, synthetic


def _gguf_meta(path: Path) -> dict:
    """The metadata fields, and under "tensors.names" the tensor names (the header: no data read)."""
    from engine.models.loader import gguf_reader

    try:
        reader = gguf_reader(path)  # the vocabulary's arrays stepped over: seconds saved per read
    except Exception as e:
        raise ModelFileError(f"{path} could not be read as GGUF ({type(e).__name__}: {e})",
                             "the file is truncated or corrupt: download or copy it again") from e
    meta: dict = {"tensors.names": {t.name for t in reader.tensors}}
    for key, fld in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and not key.endswith("_id"):
            continue  # vocabularies: large, and no part of the shape
        try:
            meta[key] = fld.contents()
        except Exception:
            continue
    return meta


def model_args(model: str):
    """ModelArgs of `model` (builtin:…, synthetic:…, a .gguf file or a model folder) from its metadata
    only (a synthetic preset from its published config)."""
    if model.startswith("synthetic:"):
        config = synthetic.config_for(model)
        return families.for_model_type(config["model_type"], Path(model)).args_from_config(config)
    upcycle = None
    if model.startswith("builtin:"):
        path, upcycle = builtin.resolve(model)
    else:
        path = Path(model).expanduser()
    if not path.exists():
        raise ModelFileError(f"model not found: {path}", "check the path, or run `tandem models`")
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelFileError(f"{path} has no config.json", "point at a Hugging Face model folder")
        config = json.loads(config_file.read_text())
        family = families.for_model_type(config.get("model_type"), path)
        args = family.args_from_config(config)
    else:
        meta = _gguf_meta(path)
        family = families.for_gguf_arch(meta.get("general.architecture"), path)
        config = family.config_from_gguf(meta)
        args = family.args_from_config(config)
        if "output.weight" not in meta["tensors.names"]:  # no output layer: the embeddings serve (assemble)
            args = replace(args, tie_embeddings=True)
    if upcycle is not None:  # the same recipe builtin.upcycle_to_moe applies to the weights
        args = replace(args, n_experts=upcycle.n_experts, top_k=upcycle.top_k, expert_ffn_dim=args.ffn_dim)
    return args


def model_shape(model: str, dtype) -> ModelShape:
    """The calibration shape of `model` computing in `dtype` (synthetic:… from published configs). Its
    KV is the format's as the hybrid KV holds it (engine/kv/latent.py format_shape): latent rows as one
    head of half a row, r + dr values a token, the shape kv_setup asks the profile for."""
    args = model_args(model)
    n_kv, head_dim = format_shape(args)
    return ModelShape.of(replace(args, n_kv_heads=n_kv, head_dim=head_dim), dtype, model)
