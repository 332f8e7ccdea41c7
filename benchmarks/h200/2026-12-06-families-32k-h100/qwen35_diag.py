"""Why test_cuda_matches_the_cpu differs (run from the repository root: `python3 <this file>`): record every routing call's choices on the CPU and on CUDA,
report where they differ with the CPU's margin, where the logits differ, and the same run with every
expert chosen (top-k = all: nothing to flip)."""
import json
import sys

import torch

sys.path[:0] = [".", "tests", "tests/models"]
import engine.models.common as common  # noqa: E402
from moe_helpers import engine_logits, tiny_engine  # noqa: E402
import test_qwen3_5_moe_cuda as t  # noqa: E402

calls = []
orig = common.softmax_topk


def rec(logits, k, renormalise):
    w, ids = orig(logits, k, renormalise)
    probs = torch.softmax(logits.float(), -1).cpu()
    calls.append((ids.cpu(), probs))
    return w, ids


common.softmax_topk = rec


class MP:
    def setitem(self, d, k, v):
        d[k] = v


def run(tmp, **over):
    import pathlib
    t.SMALL.update(over)
    folder = t._folder(pathlib.Path(tmp), MP())
    ids = [(13 * i + 7) % 128 for i in range(708)]
    out = []
    for dev in ("cpu", "cuda" if torch.cuda.is_available() else "cpu"):
        calls.clear()
        e = tiny_engine(folder, device=dev, max_context=1024)
        out.append((engine_logits(e, ids, prefill=700), list(calls)))
        e.close()
    (lc, cc), (lg, cg) = out
    d = (lc - lg).abs()
    per_pos = d.max(1).values
    bad = torch.nonzero(per_pos > 1e-3).flatten().tolist()
    flips = []
    for i, ((ic, pc), (ig, pg)) in enumerate(zip(cc, cg)):
        sc, sg = ic.sort(-1).values, ig.sort(-1).values
        rows = torch.nonzero((sc != sg).any(-1)).flatten().tolist()
        for r in rows[:5]:
            p = pc[r].sort(descending=True).values
            k = ic.shape[-1]
            margin = (p[k - 1] - p[k]).item() if k < p.numel() else None
            flips.append({"call": i, "row": r, "cpu": ic[r].tolist(), "cuda": ig[r].tolist(), "cpu_margin": margin,
                          "prob_diff": (pc[r] - pg[r]).abs().max().item()})
    margins = []
    for ic, pc in cc:
        k = ic.shape[-1]
        if k < pc.shape[-1]:
            p = pc.sort(-1, descending=True).values
            margins.append((p[:, k - 1] - p[:, k]).min().item())
    return {"over": over, "max_diff": d.max().item(), "n_over": int((d > 1e-3).sum()), "bad_positions": bad[:20],
            "n_bad_positions": len(bad), "first_bad": bad[0] if bad else None, "flips": flips[:20],
            "n_calls": len(cc), "min_margin": min(margins) if margins else None,
            "max_prob_diff": max((pc - pg).abs().max().item() for (_, pc), (_, pg) in zip(cc, cg))}


if __name__ == "__main__":
    import tempfile
    res = []
    for over in ({}, {"num_experts_per_tok": 8}):
        with tempfile.TemporaryDirectory() as tmp:
            r = run(tmp, **over)
            print(json.dumps(r), flush=True)
            res.append(r)
    try:
        import fla  # noqa: F401
        res.append({"fla": True})
    except ImportError:
        res.append({"fla": False})
    print(json.dumps(res[-1]))
