"""Diagnostic: the Qwen file of tests/quant/test_gguf_blocks_on_gpu.py on CUDA, each position's largest
logit error against the same file dequantised to float32 on the CPU: in bf16 dequantised, in its blocks
(dtype auto), and the float32 source file in bf16 (no blocks at all). Output: route-flip.txt."""
import pathlib
import sys
import tempfile

sys.path[:0] = ["tests", "tests/quant"]
import test_gguf_blocks_on_gpu as t  # noqa: E402
from helpers import stepped_logits as logits  # noqa: E402

d = pathlib.Path(tempfile.mkdtemp())
src = t.export_f32(d, "qwen3_moe", "qwen3-30b-a3b", hidden_size=t.H, moe_intermediate_size=t.I, num_experts=t.E,
                   num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
q = t.requantise(src, d / "qwen-q.gguf", {"gate": t.T.Q4_0, "up": t.T.Q4_1, "down": t.T.Q8_0}, t.T.Q8_0)
ref = t.engine(q, "cpu", dtype="float32"); want = logits(ref, t.PROMPT, len(t.PROMPT)); ref.close()  # noqa: E702
for name, path, kw in [("q bf16 dequantised", q, dict(dtype="bfloat16", expert_policy="resident")),
                       ("q auto resident", q, dict(expert_policy="resident")),
                       ("f32 src bf16", src, dict(dtype="bfloat16", expert_policy="resident"))]:
    e = t.engine(path, "cuda", **kw)
    w = want
    if path != q:
        r = t.engine(src, "cpu", dtype="float32"); w = logits(r, t.PROMPT, len(t.PROMPT)); r.close()  # noqa: E702
    got = logits(e, t.PROMPT, len(t.PROMPT)); e.close()  # noqa: E702
    err = (got - w).abs()
    print(name, "scale", float(w.abs().max()), "max err", float(err.max()), "per row",
          [round(float(x), 3) for x in err.max(1).values], flush=True)
