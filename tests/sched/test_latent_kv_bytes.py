"""The planner and calibration count latent KV (DeepSeek-V2's MLA) as the engine holds it: one row of
r + dr values per token and layer (V2-Lite: 576 × 2 B × 27 layers), not per-head K and V; the
calibration shape is the one kv_setup asks the profile for, so calibrated A and B are not scaled by
a wrong ratio of bytes."""

import torch

from engine.api import EngineConfig
from engine.errors import TandemError
from engine.hw.shapes import KVShape
from engine.models.shape import model_args, model_shape
from engine.models.sizes import model_parts
from engine.runtime import planning

V2_LITE = "synthetic:deepseek-v2-lite"


def test_kv_bytes_per_token_of_latent_and_per_head_models():
    assert model_parts(model_args(V2_LITE), 2, V2_LITE).kv_bytes_per_token == 576 * 2 * 27
    qwen = "synthetic:qwen3-30b-a3b"  # GQA: K and V of 4 heads × 128 over 48 layers, 96 KiB
    assert model_parts(model_args(qwen), 2, qwen).kv_bytes_per_token == 2 * 4 * 128 * 2 * 48 == 96 * 2**10


def test_calibration_shape_is_the_hybrid_format_of_latent_rows():
    kv = model_shape(V2_LITE, torch.bfloat16).kv
    assert (kv.n_heads, kv.n_kv_heads, kv.head_dim) == (16, 1, 288)  # two planes of (512 + 64) / 2
    assert kv.bytes_per_token == 576 * 2  # one layer's row, bf16
    assert model_shape("synthetic:qwen3-30b-a3b", torch.bfloat16).kv.key == "q32-kv4x128-bfloat16"


class _Profile:
    """A profile without measurements that records the KV shape it is asked for."""

    name, data = "recording", {}

    def __init__(self):
        self.asked = []

    def kv_costs(self, shape, batch):
        self.asked.append(shape)
        raise TandemError("no KV costs for this shape")

    def expert_costs(self, shape):
        raise TandemError("no expert costs")


def test_planner_asks_the_profile_for_the_calibrated_latent_shape():
    profile = _Profile()
    config = EngineConfig(model=V2_LITE, device="cpu", simulate_hybrid=True)
    planning.machine_costs(config, model_args(V2_LITE), profile, 2)
    assert profile.asked == [KVShape(16, 1, 288, "bfloat16")] == [model_shape(V2_LITE, torch.bfloat16).kv]
