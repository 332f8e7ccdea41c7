"""The tiny offloaded-experts model the executor's tests share: three layers of random experts, an
OffloadedExperts over them, and forward passes checked layer by layer against resident execution."""

import torch

from engine.experts.offload import OffloadedExperts
from engine.experts.predictor import GateLookahead, even_spread
from engine.experts.store import ExpertStore
from engine.kernels.experts_torch import moe_experts
from engine.models.moe_ffn import softmax_topk
from engine.sched.expert_cost import ExpertCostModel

L, E, H, I, K = 3, 6, 16, 8, 2
# Plan as for Qwen3-30B-A3B experts on the GPU machine (the tiny test experts would always go to the CPU).
QWEN3_COSTS = ExpertCostModel.from_shape(2048, 768, 2)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def tiny_experts():
    """Three layers of six random experts (H 16, I 8) and their routers: (gate_up, down, routers)."""
    g = torch.Generator().manual_seed(0)
    gate_up = [torch.randn(E, 2 * I, H, generator=g) / H**0.5 for _ in range(L)]
    down = [torch.randn(E, H, I, generator=g) / I**0.5 for _ in range(L)]
    routers = {layer: torch.randn(E, H, generator=g) for layer in range(L)}
    return gate_up, down, routers


def make(policy, model, n_slots, device="cpu", predictor=True, warm=True):
    gate_up, down, routers = model
    store = ExpertStore.from_layers(gate_up, down, dtype=torch.float32, pin=device == "cuda")
    ex = OffloadedExperts(policy, store, device=torch.device(device), n_slots=n_slots, max_decode_tokens=4,
                          costs=QWEN3_COSTS)
    if predictor and policy == "adaptive":
        route = lambda logits, k: softmax_topk(logits, k, True)  # noqa: E731
        ex.attach_predictor(GateLookahead({l: r.to(device) for l, r in routers.items()}, route, K))
    if warm:
        ex.warm(even_spread(store.layers, E, n_slots), source="even-spread")
    return ex


def forward_passes(ex, model, device, n_passes, n_tokens, seed):
    """Several forward passes over all layers; each layer's output checked against resident."""
    gate_up, down, routers = model
    g = torch.Generator().manual_seed(seed)
    for _ in range(n_passes):
        x = torch.randn(n_tokens, H, generator=g)
        for layer in range(L):
            w, ids = softmax_topk(x @ routers[layer].T, K, True)
            ref = moe_experts(x, ids, w, gate_up[layer], down[layer])
            out = ex.run(layer, x.to(device), ids.to(device), w.to(device))
            assert out.shape == (n_tokens, H) and out.dtype == x.dtype
            torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=1e-5)
            x = x + 0.3 * torch.randn(n_tokens, H, generator=g)  # the next layer's input, similar
