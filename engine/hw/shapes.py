"""The model shapes calibration measures for: plain numbers, no weights.

The costs Tandem's schedulers need depend on the model only through these numbers: the KV bytes of
one token (heads, head size, dtype) and the bytes of one routed expert (hidden size, expert FFN
size, dtype). `ModelShape.of(args, dtype)` reads any object with ModelArgs' attribute names, so this
floor never imports the models package above it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.errors import ConfigError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_name(dtype) -> str:
    """'bfloat16' for torch.bfloat16 or 'bfloat16'; checked against the dtypes calibration knows."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ConfigError(f"calibration does not know dtype '{name}'", f"use one of {', '.join(DTYPE_BYTES)}")
    return name


@dataclass(frozen=True)
class KVShape:
    n_heads: int  # query heads
    n_kv_heads: int
    head_dim: int
    dtype: str  # "bfloat16" | "float32" | "float16"

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token of one sequence in one layer."""
        return 2 * self.n_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def key(self) -> str:
        return f"q{self.n_heads}-kv{self.n_kv_heads}x{self.head_dim}-{self.dtype}"


@dataclass(frozen=True)
class ExpertShape:
    hidden: int  # H
    ffn: int  # I of one routed expert
    dtype: str

    @property
    def bytes_per_expert(self) -> int:
        """gate_up (2I, H) plus down (H, I): one contiguous DMA in the expert store."""
        return 3 * self.hidden * self.ffn * DTYPE_BYTES[self.dtype]

    @property
    def key(self) -> str:
        return f"h{self.hidden}-i{self.ffn}-{self.dtype}"


@dataclass(frozen=True)
class ModelShape:
    name: str  # what the user called the model (for tables and messages)
    kv: KVShape
    expert: ExpertShape | None  # None: a dense model, no routed experts
    n_layers: int
    n_experts: int = 0
    top_k: int = 0

    @property
    def key(self) -> str:
        return self.kv.key + ("/" + self.expert.key if self.expert else "/dense")

    @classmethod
    def of(cls, args, dtype, name: str = "") -> "ModelShape":
        """From anything with ModelArgs' fields (n_heads, n_kv_heads, head_dim, dim, expert_ffn_dim, …)."""
        d = dtype_name(dtype)
        kv = KVShape(int(args.n_heads), int(args.n_kv_heads), int(args.head_dim), d)
        moe = int(getattr(args, "n_experts", 0) or 0) > 0
        expert = ExpertShape(int(args.dim), int(args.expert_ffn_dim or args.ffn_dim), d) if moe else None
        return cls(name, kv, expert, int(args.n_layers), int(getattr(args, "n_experts", 0) or 0),
                   int(getattr(args, "top_k", 0) or 0))

    def to_dict(self) -> dict:
        return asdict(self)
