"""Integer kernel vs bf16 tiles + GEMM at prefill token counts, real expert blocks from the file, 1 thread.
    taskset -c 1 python3 crossover.py FILE.gguf [8,16,32,...]"""
import time, sys, torch
import gguf
from engine.quant import matmul as qm
from engine.quant.blocks import QuantTensor
from engine.kernels import native
native.set_threads(1) if hasattr(native, "set_threads") else None
torch.set_num_threads(1)
r = gguf.GGUFReader(sys.argv[1])
t = {x.name: x for x in r.tensors}
def expert(name, e):
    x = t[name]; return QuantTensor.from_gguf(x.data[e], int(x.tensor_type), name)
mats = {"gate Q4_K 768x2048": expert("blk.1.ffn_gate_exps.weight", 3), "down Q6_K 2048x768": expert("blk.0.ffn_down_exps.weight", 3),
        "down Q4_K 2048x768": expert("blk.1.ffn_down_exps.weight", 3)}
def best(f, reps=7):
    f(); ts = []
    for _ in range(reps):
        s = time.perf_counter(); f(); ts.append(time.perf_counter() - s)
    return min(ts) * 1e6
for label, w in mats.items():
    for n in [int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "8,16,24,32,48,64").split(",")]:
        x = torch.randn(n, w.shape[1])
        qm.NATIVE_MAX_TOKENS = 10000; a = best(lambda: qm.quant_linear(x, w, tiles=torch.bfloat16))
        qm.NATIVE_MAX_TOKENS, limit = 0, qm.native_max_tokens
        qm.native_max_tokens = lambda codes: 0  # every count to the tiles
        b = best(lambda: qm.quant_linear(x, w, tiles=torch.bfloat16))
        qm.native_max_tokens = limit
        print(f"{label} n={n:3d} kernel {a:8.0f} us  tiles {b:8.0f} us  ratio {a/b:.2f}", flush=True)
