"""The PTX instructions in the main loop of a Triton kernel over GGUF blocks, compiled for sm_90 without
a GPU: a measure of the decode GEMVs' work, which is bound by instructions rather than bytes (one H100:
8 experts of Q4_K/Q6_K blocks at about 500 GB/s, BF16 over 3.5× the bytes at 1,800).

    python3 tests/kernels/ptx_loop.py linear Q6_K        # quant_linear_gpu's GEMV
    python3 tests/kernels/ptx_loop.py down Q4_K          # quant_moe_gpu's down kernel (gate_up: gate_up)

Prints the loop's instruction count, the weights a thread decodes per iteration, and the commonest
instructions. Run with Triton's interpreter off (TRITON_INTERPRET unset)."""

from __future__ import annotations

import collections
import re
import sys

from compile_for_cuda import compiled

from engine.kernels import quant_linear_gpu, quant_moe_gpu
from engine.quant.blocks import QTYPES


def loop_counts(ptx: str) -> collections.Counter:
    """Instructions between the last backward branch's target label and that branch."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^\s*(\$L__BB\d+_\d+):", line))}
    loop = None
    for i, line in enumerate(lines):
        m = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+)", line)
        if m and labels.get(m.group(1), i) < i:
            loop = (labels[m.group(1)], i)
    counts = collections.Counter()
    for line in lines[loop[0]:loop[1] + 1] if loop else lines:
        text = re.sub(r"^@!?%p\d+\s+", "", line.strip())
        if text and not text.startswith(("//", "$", ".", "{", "}")):
            counts[text.split()[0].rstrip(";")] += 1
    return counts


def main(which: str, type_name: str) -> None:
    code = next(c for c, qt in QTYPES.items() if qt.name == type_name)
    qt = QTYPES[code]
    if which == "linear":
        k = compiled(quant_linear_gpu._linear_kernel, True, QT=code, BB=qt.block_bytes, HAS_BIAS=False,
                     ROWS=quant_linear_gpu.ROWS, C=quant_linear_gpu.CHUNK)
        rows = quant_linear_gpu.ROWS
    else:
        flags = dict(HAS_OFFS=False, HAS_SPARE=False, CLAMPED=False, C=quant_moe_gpu.CHUNK, COPY=quant_moe_gpu.COPY_BYTES)
        if which == "down":
            rows = quant_moe_gpu.ROWS_DOWN
            k = compiled(quant_moe_gpu._down_kernel, True, QD=code, BD=qt.block_bytes, ROWS=rows, **flags)
        else:
            rows = quant_moe_gpu.ROWS_GATE_UP
            k = compiled(quant_moe_gpu._gate_up_kernel, True, QG=code, BG=qt.block_bytes, QU=code, BU=qt.block_bytes,
                         ROWS=rows, **flags)
    counts = loop_counts(k.asm["ptx"])
    per_thread = rows * quant_moe_gpu.CHUNK * 32 // (32 * k.metadata.num_warps)  # weights a thread an iteration
    print(f"{which} {type_name}: {sum(counts.values())} instructions a loop iteration, {per_thread} weights "
          f"a thread ({sum(counts.values()) / per_thread:.1f} a weight; gate_up's loop holds gate and up)")
    for op, n in counts.most_common(12):
        print(f"  {op:24s} {n}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
