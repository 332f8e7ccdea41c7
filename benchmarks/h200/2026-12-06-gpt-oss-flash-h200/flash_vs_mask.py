"""Diagnostic: a baby gpt-oss (16-token windows, sinks) read in bf16 on CUDA through flash and through the
boolean mask, each against the fp32 CPU; per-position max |logit error|, positions above 0.3, greedy agreement.

    PYTHONPATH=TREE python3 flash_vs_mask.py   (from the repository root)"""
import sys, torch
sys.path.insert(0, "tests/models"); sys.path.insert(0, "tests")
from test_gpt_oss import tiny, saved
from moe_helpers import engine_logits, tiny_engine
from engine.kv.resident import ResidentKV
import pathlib, tempfile
tmp = pathlib.Path(tempfile.mkdtemp())
folder = saved(tmp, tiny(seed=5, sliding_window=16, max_position_embeddings=512))
ids = [(i * 37 + 11) % 96 for i in range(300)]
cpu = engine_logits(tiny_engine(folder, max_context=512), ids, forward=300)
gpu = tiny_engine(folder, device="cuda", dtype="bfloat16", max_context=512)
res = {}
for chunk in (300, 64):
    res[("flash", chunk)] = engine_logits(gpu, ids, forward=chunk)
orig = ResidentKV.flash_prefill
ResidentKV.flash_prefill = property(lambda self: False)
for chunk in (300, 64):
    res[("mask", chunk)] = engine_logits(gpu, ids, forward=chunk)
ResidentKV.flash_prefill = orig
for k, v in res.items():
    d = (v - cpu).abs().max(-1).values  # per position
    print(k, "max", round(d.max().item(), 3), "p>0.3", int((d > 0.3).sum()), "first bad", (d > 0.3).nonzero().flatten()[:8].tolist(),
          "argmax agree", round((v.argmax(-1) == cpu.argmax(-1)).float().mean().item(), 3))
f, m = res[("flash", 300)], res[("mask", 300)]
print("flash vs mask 300: max", round((f - m).abs().max().item(), 3))
f, m = res[("flash", 64)], res[("mask", 64)]
print("flash vs mask 64: max", round((f - m).abs().max().item(), 3))
