"""Why does calibration's CPU attention cost (A) read so slowly with the engine's native kernel?

Phase CU's quick calibration timed the native kernel at A = 754 ns per KV token of one layer
(2 KB: 2.7 GB/s), where `tandem bench cpu-kernels` reads KV at 62-68 GB/s with it and calibration
once measured torch's CPU flash kernel at 172 ns. This probe times calibration's own step
(engine.hw.kv_costs.cpu_attention_points: fresh KV each step, the query coming from and the result
going back to the GPU or not) for the engine's kernel and for torch's flash kernel, 15 threads.

    python3 benchmarks/h200/probe_calib_attention.py OUT.json
"""
import json
import sys

import torch

from engine.hw.attention_kernels import ENGINE_CPU, NamedKernel
from engine.hw.kv_costs import cpu_attention_points, fit_costs
from engine.hw.shapes import KVShape
from engine.kernels import native

THREADS = 15
SHAPE = KVShape(32, 4, 128, "bfloat16")  # Qwen3-30B-A3B's attention
LENGTHS = [1024, 4096, 16384]
L3 = 300 * 2**20


def torch_flash(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
    return out, lse.reshape(q.shape[0], q.shape[1], 1).contiguous()


def main(path: str) -> None:
    torch.set_num_threads(THREADS)
    native.set_threads(THREADS)
    kernels = [ENGINE_CPU, NamedKernel("torch-flash-cpu", torch_flash)]
    rows = []
    for roundtrip in (True, False) if torch.cuda.is_available() else (False,):
        for _ in range(2):  # the two kernels alternated twice
            for kernel in kernels:
                points = cpu_attention_points(SHAPE, 1, LENGTHS, kernel, 2, 7, L3, roundtrip)
                A, C = fit_costs(points)
                row = {"kernel": kernel.name, "gpu_roundtrip": roundtrip, "points_ms": points,
                       "A_ns_per_token": round(A, 2), "kv_gbps": round(SHAPE.bytes_per_token / A, 2), "C_ms": round(C, 4)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    json.dump({"threads": THREADS, "native": native.isa(),
               "rows": rows}, open(path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
