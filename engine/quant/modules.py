"""Linear and embedding layers over quantised blocks, and their installation in a placed model.

A `QuantLinear` keeps its weight as a `QuantTensor`; the block bytes are also registered as a uint8
parameter so that `model.parameters()` counts the bytes the model really holds (one parameter per
block tensor: the tied embedding and output head share it).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.quant.blocks import QuantTensor
from engine.quant.matmul import embedding, quant_linear


def _blocks_parameter(w: QuantTensor) -> nn.Parameter:
    return nn.Parameter(w.blocks, requires_grad=False)


class QuantLinear(nn.Module):
    """y = x · Wᵀ (+ bias) with W (out_features, in_features) in blocks; y in x's dtype."""

    def __init__(self, weight: QuantTensor, bias: torch.Tensor | None = None, blocks: nn.Parameter | None = None):
        super().__init__()
        self.qweight = weight
        self.out_features, self.in_features = weight.shape
        self.blocks = blocks if blocks is not None else _blocks_parameter(weight)
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self.qweight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features} → {self.out_features}, {self.qweight.qtype.name}"


class QuantEmbedding(nn.Module):
    """Rows of W (num_embeddings, embedding_dim) in blocks, dequantised per looked-up token to fp32."""

    def __init__(self, weight: QuantTensor, blocks: nn.Parameter | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.qweight, self.dtype = weight, dtype
        self.num_embeddings, self.embedding_dim = weight.shape
        self.blocks = blocks if blocks is not None else _blocks_parameter(weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return embedding(ids, self.qweight, self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} × {self.embedding_dim}, {self.qweight.qtype.name}"


def install(model: nn.Module, quantised: dict[str, QuantTensor], dtype: torch.dtype) -> None:
    """Replace each module whose `<path>.weight` is in `quantised` (an nn.Linear or nn.Embedding whose
    other tensors are loaded) by its quantised form; one block parameter per QuantTensor."""
    params: dict[int, nn.Parameter] = {}
    for name, w in quantised.items():
        path = name.removesuffix(".weight")
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        old = getattr(parent, attr)
        blocks = params.setdefault(id(w), _blocks_parameter(w))
        if isinstance(old, nn.Embedding):
            setattr(parent, attr, QuantEmbedding(w, blocks, dtype))
        elif isinstance(old, nn.Linear):
            setattr(parent, attr, QuantLinear(w, old.bias, blocks))
        else:
            raise TypeError(f"{name}: a {type(old).__name__} has no quantised form")
