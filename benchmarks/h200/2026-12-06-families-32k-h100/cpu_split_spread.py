"""The CPU against itself on the CUDA test's baby Qwen3.5: the same 708 tokens with the prompt prefilled as one
step of 700 or as 350 + 350 (other shapes, other summation orders), and at 1 against 2 threads. Run from the
repository root."""
import sys, tempfile, pathlib, torch
sys.path[:0] = [".", "tests", "tests/models"]
from moe_helpers import engine_logits, tiny_engine
import test_qwen3_5_moe_cuda as t
class MP:
    def setitem(self, d, k, v): d[k] = v
with tempfile.TemporaryDirectory() as tmp:
    folder = t._folder(pathlib.Path(tmp), MP())
    ids = [(13 * i + 7) % 128 for i in range(708)]
    torch.set_num_threads(2)
    a = engine_logits(tiny_engine(folder, max_context=1024), ids, prefill=700)
    b = engine_logits(tiny_engine(folder, max_context=1024), ids, prefill=350)  # another split: other shapes, other orders
    torch.set_num_threads(1)
    c = engine_logits(tiny_engine(folder, max_context=1024), ids, prefill=700)
    for name, x in (("prefill 350 vs 700", b), ("1 vs 2 threads", c)):
        d = (a - x).abs(); pp = d.max(1).values
        print(name, "max", d.max().item(), "n>1e-3", int((d > 1e-3).sum()), "bad", torch.nonzero(pp > 1e-3).flatten().tolist()[:12])
