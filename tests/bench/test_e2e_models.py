"""`tandem bench e2e` over the two KV shapes it measures on the GPU machine, simulated on the CPU:
latent rows (a tiny DeepSeek-V2: one r + dr row per token and layer) and per-head K, V (a tiny
Qwen3-MoE, GQA; a tiny Qwen3.5, whose KV covers its full-attention layers only). Every hybrid policy and monolithic gives a row per point with the KV filled and the
tokens decoded; a point that runs out of memory, a policy that cannot be built and a point the host
cannot hold are rows with their reason, and the run goes on; the aggregate search doubles the chats
until the host refuses."""

import json
import types

import psutil
import pytest
import torch

from engine.bench import e2e, e2e_fill
from engine.cli import main
from engine.models import synthetic

POLICIES = ("writescope", "gpu-centric", "cpu-centric", "monolithic")
DEEPSEEK = dict(synthetic.PRESETS["deepseek-v2-lite"], vocab_size=128, hidden_size=64, intermediate_size=96,
                moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2)
QWEN3 = dict(synthetic.PRESETS["qwen3-30b-a3b"], vocab_size=128, hidden_size=64, intermediate_size=96,
             moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
             num_experts_per_tok=2)
QWEN35 = dict(synthetic.PRESETS["qwen3.5-35b-a3b"], vocab_size=128, hidden_size=64, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, moe_intermediate_size=32,
              shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
# KV bytes of one token over all layers, bf16 (synthetic models are generated in bf16)
TOKEN_BYTES = {"tiny-deepseek": 3 * (32 + 8) * 2,  # 3 layers × one latent row of r + dr, no V
               "tiny-qwen3": 2 * 2 * 2 * 16 * 2}  # 2 layers × (K, V) × 2 KV heads × 16


@pytest.fixture(autouse=True)
def tiny_presets(monkeypatch):
    monkeypatch.setitem(synthetic.PRESETS, "tiny-deepseek", DEEPSEEK)
    monkeypatch.setitem(synthetic.PRESETS, "tiny-qwen3", QWEN3)
    monkeypatch.setitem(synthetic.PRESETS, "tiny-qwen3.5", QWEN35)


def _run(name: str, **kw) -> dict:
    layers = 3 if name == "tiny-deepseek" else 2
    args = {"model": f"synthetic:{name}-L{layers}", "kv_policies": POLICIES, "expert_policy": "resident",
            "batch_sizes": (1, 2), "contexts": (40,), "new_tokens": 3, "vram_budget_gb": None, "device": "cpu",
            "simulate_hybrid": True, "progress": lambda s: None}
    return e2e.run(**{**args, **kw})


@pytest.mark.parametrize("name", ["tiny-deepseek", "tiny-qwen3"])
def test_every_policy_fills_and_decodes(tmp_path, capsys, name):
    layers = 3 if name == "tiny-deepseek" else 2
    out = tmp_path / "e2e.json"
    rc = main(["bench", "e2e", "--model", f"synthetic:{name}-L{layers}", "--kv-policies", ",".join(POLICIES),
               "--batch-sizes", "1,2", "--contexts", "40", "--new-tokens", "3", "--vram-budget-gb", "0",
               "--device", "cpu", "--simulate-hybrid", "--expert-policy", "resident", "--json", str(out)])
    assert rc == 0
    record = json.loads(out.read_text())
    capsys.readouterr()
    assert record["complete"] and record["kv_bytes_per_token"] == TOKEN_BYTES[name]
    assert [(r["kv_policy"], r["bs"]) for r in record["results"]] == [(p, b) for p in POLICIES for b in (1, 2)]
    for r in record["results"]:
        assert "error" not in r and r["decode_tok_s"] > 0 and r["phase"] == "grid"
        assert r["prefilled_tokens"] == r["bs"]  # the filled context was reused: one token each to prefill
        assert r["kv_bytes_per_step"] == r["bs"] * 40 * TOKEN_BYTES[name]
        assert sum(r["kv_tokens"].values()) == r["bs"] * (40 + 3)  # every filled and decoded token is held
    assert record["largest"] == {p: {"bs": 2, "context": 40, "aggregate_tokens": 80,
                                     "decode_tok_s": record["results"][2 * i + 1]["decode_tok_s"]}
                                 for i, p in enumerate(POLICIES)}


def test_a_point_out_of_memory_is_a_row_and_the_policy_goes_on(monkeypatch):
    """The fill runs out of device memory on the second chat of one point (a half-filled batch, a
    step left open): that point is a row with the error, the policy's KV is rebuilt, and the next
    point and the next policies run."""
    real = e2e_fill.fill_session

    def fill(engine, key, context, gen):
        if engine.info()["kv_policy"] == "gpu-centric" and context == 40 and key.endswith("-1"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 68.00 GiB")
        return real(engine, key, context, gen)

    monkeypatch.setattr(e2e, "fill_session", fill)
    record = _run("tiny-deepseek", kv_policies=("writescope", "gpu-centric", "monolithic"), contexts=(40, 24))
    rows = {(r["kv_policy"], r["bs"], r["context"]): r for r in record["results"]}
    assert len(rows) == 12 and record["complete"]
    failed = rows[("gpu-centric", 2, 40)]
    assert failed["error"].startswith("OutOfMemoryError: CUDA out of memory") and "decode_tok_s" not in failed
    assert all(r["decode_tok_s"] > 0 for k, r in rows.items() if k != ("gpu-centric", 2, 40))
    # the points after the failure ran on the rebuilt KV: 2 × 24 is the policy's largest that ran
    assert record["largest"]["gpu-centric"]["aggregate_tokens"] == 48
    assert [k for k in rows if k[0] == "gpu-centric"] == [("gpu-centric", 1, 40), ("gpu-centric", 2, 40),
                                                          ("gpu-centric", 1, 24), ("gpu-centric", 2, 24)]


def test_a_policy_that_cannot_be_built_is_recorded():
    """Without simulate_hybrid a CPU has no GPU side: the hybrid policy's ConfigError is a row per
    point, and resident after it still runs."""
    record = _run("tiny-qwen3", kv_policies=("writescope", "resident"), simulate_hybrid=False)
    ws = [r for r in record["results"] if r["kv_policy"] == "writescope"]
    assert len(ws) == 2 and all("splits attention between a GPU and the CPU" in r["error"] for r in ws)
    assert [r["decode_tok_s"] > 0 for r in record["results"] if r["kv_policy"] == "resident"] == [True, True]
    assert list(record["largest"]) == ["resident"]


def test_aggregate_search_doubles_chats_until_the_host_refuses(monkeypatch):
    """A host that holds 5 chats' KV of 40 tokens: 4 chats run in the aggregate phase, 8 are refused
    (a row that says why) and the search stops there."""
    need = 40 * TOKEN_BYTES["tiny-qwen3"]
    fake = types.SimpleNamespace(available=int(5 * need / e2e_fill.HOST_KV_SHARE), total=psutil.virtual_memory().total)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: fake)
    record = _run("tiny-qwen3", kv_policies=("writescope",), aggregate_chats=16)
    agg = [r for r in record["results"] if r["phase"] == "aggregate"]
    assert [(r["bs"], "error" in r) for r in agg] == [(4, False), (8, True)]
    assert agg[1]["refused"] and "host memory: 8 chats x 40 tokens" in agg[1]["error"]
    assert agg[0]["decode_tok_s"] > 0 and record["largest"]["writescope"]["aggregate_tokens"] == 160
    assert record["aggregate_load_s"] is not None


def test_a_batch_whose_decode_runs_out_of_memory_is_a_row(monkeypatch):
    """A batched decode step that runs out of memory is retried one sequence at a time by the
    generator; the point is then a row with that error, not the rate of single-sequence steps."""
    from engine.kv.writescope import WriteScopeKV

    real = WriteScopeKV.attend

    def attend(self, layer, q, k, v, *args, **kw):
        if self.policy == "gpu-centric" and q.shape[2] == 1 and len(self.plan.seqs) == 2 \
                and self.plan.seqs[0].length > 30:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, layer, q, k, v, *args, **kw)

    monkeypatch.setattr(WriteScopeKV, "attend", attend)
    record = _run("tiny-qwen3", kv_policies=("gpu-centric",), contexts=(40, 24))
    rows = {(r["bs"], r["context"]): r for r in record["results"]}
    assert "a decode step of 2 sequences failed (OutOfMemoryError" in rows[(2, 40)]["error"]
    assert all(rows[p]["decode_tok_s"] > 0 for p in [(1, 40), (1, 24), (2, 24)])


def test_a_hybrid_model_fills_its_attention_layers_only():
    """Qwen3.5 (-L5: DeltaNet layers 0-2 and 4, full attention at 3): the fill writes the one KV layer,
    and the KV bytes per token count it alone; the recurrent layers start each chat from zeros."""
    record = _run("tiny-qwen3.5", model="synthetic:tiny-qwen3.5-L5", kv_policies=("writescope", "monolithic"))
    assert record["kv_bytes_per_token"] == 1 * 2 * 2 * 32 * 2  # 1 layer × (K, V) × 2 KV heads × 32, bf16
    for r in record["results"]:
        assert "error" not in r and r["decode_tok_s"] > 0
        assert sum(r["kv_tokens"].values()) == r["bs"] * (40 + 3)
