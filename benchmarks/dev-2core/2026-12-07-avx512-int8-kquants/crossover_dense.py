import time, sys, torch, gguf
from engine.quant import matmul as qm
from engine.quant.blocks import QuantTensor
torch.set_num_threads(1)
r = gguf.GGUFReader(sys.argv[1]); t = {x.name: x for x in r.tensors}
def mat(name):
    x = t[name]; return QuantTensor.from_gguf(x.data, int(x.tensor_type), name)
def best(f, reps=5):
    f(); ts = []
    for _ in range(reps):
        s = time.perf_counter(); f(); ts.append(time.perf_counter() - s)
    return min(ts) * 1e6
for name in ("blk.1.attn_q.weight", "blk.1.attn_output.weight", "blk.0.attn_v.weight"):
    w = mat(name)
    for n in (32, 128, 512):
        x = torch.randn(n, w.shape[1])
        qm.NATIVE_MAX_TOKENS = 10**6; a = best(lambda: qm.quant_linear(x, w, tiles=torch.float32))
        qm.NATIVE_MAX_TOKENS = 0; b = best(lambda: qm.quant_linear(x, w, tiles=torch.float32))
        print(f"{name} {w.qtype.name} {w.shape} n={n} kernel {a:8.0f} us  fp32 tiles {b:8.0f} us  ratio {a/b:.2f}", flush=True)
