"""Eager launches of the decode GEMVs over blocks at Qwen3-30B-A3B's shapes, for Nsight Compute."""
import torch
from engine.bench.quant_gpu import random_blocks, H, I, TOP_K, SLOTS
from engine.experts.store import QuantLayout
from engine.kernels import quant_moe_gpu, quant_linear_gpu
from engine.quant.blocks import QuantTensor
gen = torch.Generator().manual_seed(0)
dev = torch.device("cuda")
layout = QuantLayout((12, 12, 14), H, I)
pool = torch.cat([random_blocks(SLOTS * rows, cols, code, gen, dev).view(SLOTS, -1)
                  for code, rows, cols, _, _ in layout.parts], dim=1)
x = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
ids = torch.randperm(SLOTS, generator=gen)[:TOP_K].view(1, TOP_K).to(dev)
w = torch.softmax(torch.randn(1, TOP_K, generator=gen), -1).to(dev, torch.bfloat16)
qw = QuantTensor(random_blocks(4096, H, 12, gen, dev), 12, (4096, H), "q")
for _ in range(4):
    quant_moe_gpu.moe_decode_quant(x, ids, w, pool, layout.kernel_parts, I)
    quant_linear_gpu.linear(x, qw)
torch.cuda.synchronize()
print("done")
