"""The same products under the avx512 and avx512vnni tables, taking turns, one thread (best of 7 per turn, median of turns)."""
import sys, time, statistics, torch, gguf
from engine.kernels import native
from engine.quant import matmul as qm
from engine.quant.blocks import QuantTensor
nat = native.module(); torch.set_num_threads(1)
r = gguf.GGUFReader(sys.argv[1]); t = {x.name: x for x in r.tensors}
def expert(name, e):
    x = t[name]; return QuantTensor.from_gguf(x.data[e], int(x.tensor_type), name)
def best(f, reps=7):
    f(); ts = []
    for _ in range(reps):
        s = time.perf_counter(); f(); ts.append(time.perf_counter() - s)
    return min(ts) * 1e6
for label, w in {"gate Q4_K 768x2048": expert("blk.1.ffn_gate_exps.weight", 3), "down Q6_K 2048x768": expert("blk.0.ffn_down_exps.weight", 3)}.items():
    for n in (1, 8, 32, 64):
        x = torch.randn(n, w.shape[1]); res = {"avx512": [], "avx512vnni": []}
        for _ in range(5):
            for isa in res:
                nat.select_quant_isa(isa); res[isa].append(best(lambda: qm.quant_linear(x, w)))
        a, b = statistics.median(res["avx512"]), statistics.median(res["avx512vnni"])
        print(f"{label} n={n:3d} avx512 {a:7.0f} us  avx512vnni {b:7.0f} us  vnni/plain {b/a:.2f}", flush=True)
nat.select_quant_isa("auto")
