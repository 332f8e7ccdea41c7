import time, torch
from engine.api import Engine, EngineConfig
from engine.kernels import native
nat = native.module()
e = Engine(EngineConfig(model="builtin:smollm2-135m"))
m = e.backend.generator.graphs.model
a = m.args
calls = []
for layer in m.model.layers:
    at, mlp = layer.self_attn, layer.mlp
    for parts, cols in ((at.qkv_blocks.native_parts, a.dim), (at.o_proj.qweight.native_parts, a.dim),
                        (mlp.gate_up_blocks.native_parts, a.dim), (mlp.down_proj.qweight.native_parts, mlp.down_proj.qweight.shape[1])):
        rows = int(sum(p[2] for p in parts)); nbytes = int(sum(p[2] * p[3] for p in parts))
        calls.append((parts, cols, rows, torch.randn(1, cols), torch.empty(1, rows), nbytes))
tot = sum(c[5] for c in calls)
for threads in (1, 2):
    for _ in range(3):
        for parts, cols, rows, x, y, _ in calls: nat.quant_matmul(parts, cols, x.data_ptr(), 1, cols, y.data_ptr(), rows, threads)
    N = 50; t = time.perf_counter()
    for _ in range(N):
        for parts, cols, rows, x, y, _ in calls: nat.quant_matmul(parts, cols, x.data_ptr(), 1, cols, y.data_ptr(), rows, threads)
    dt = (time.perf_counter() - t) / N
    print(f"threads {threads}: all {len(calls)} layer products {dt*1e3:.2f} ms a token ({tot/1e6:.1f} MB, {tot/dt/1e9:.1f} GB/s)")
e.close()
