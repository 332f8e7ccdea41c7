"""The placement plan on the product path: the engine's defaults are planned, `tandem plan` shows
the plan without loading weights, a model that fits nowhere is refused before anything is read."""

import json
import subprocess
import sys
import time
from dataclasses import replace

import psutil
import pytest

from engine.api import Engine, EngineConfig, GenerationRequest, choose_backend, plan_placement
from engine.errors import OutOfMemoryError

MOE = "builtin:smollm2-135m-moe"
TOO_BIG = "synthetic:qwen3-30b-a3b"  # 57 GiB of bf16 weights
fits_nowhere_here = pytest.mark.skipif(psutil.virtual_memory().total > 60 * 2**30,
                                       reason="this machine could hold the 57 GiB model")


def test_the_default_config_is_planned_and_runs_on_a_cpu_only_machine():
    assert (EngineConfig().kv_policy, EngineConfig().expert_policy) == ("auto", "auto")
    engine = Engine(EngineConfig(model=MOE, max_context=512, device="cpu"))
    try:
        plan = engine.info()["plan"]
        assert plan["fits"] and plan["device"] == "cpu"
        assert (engine.backend.config.kv_policy, engine.backend.config.expert_policy) == ("resident", "resident")
        assert engine.stats().to_dict()["model"]["plan"]["summary"].startswith("runs on the CPU")
    finally:
        engine.close()


def test_experts_beyond_the_budget_are_offloaded_by_default_and_the_answer_stays():
    """The simulated hybrid stands in for a GPU of 0.5 GiB: the 2.4 GiB of experts do not fit it."""
    engine = Engine(EngineConfig(model=MOE, simulate_hybrid=True, vram_budget_gb=0.5, max_context=512, max_batch=1))
    try:
        plan = engine.info()["plan"]
        assert plan["expert_policy"] == "adaptive" and plan["expert_cache_slots"] > 0
        assert engine.info()["expert_policy"] == "adaptive"
        assert engine.parts.experts.cache.n_slots == plan["expert_cache_slots"]
        assert "experts cached" in plan["summary"]
        res = engine.generate(GenerationRequest(prompt="What is the capital of France?", max_new_tokens=12,
                                                greedy=True))
        assert "Paris" in res.text
        assert engine.stats().to_dict()["experts"]["misses"] > 0
    finally:
        engine.close()


def test_the_engine_holds_the_chats_its_plan_chose_and_a_chat_evicted_is_reread():
    """Under 3.4 GB the simulated GPU holds the built-in model's experts beside one 8K chat's KV, not
    beside four: by default the engine holds one chat and keeps its experts resident. A second chat
    evicts the first, whose next turn re-reads its history and still answers."""
    config = EngineConfig(model=MOE, simulate_hybrid=True, vram_budget_gb=3.4, max_context=8192)
    assert plan_placement(replace(config, max_batch=4))["expert_policy"] == "adaptive"
    engine = Engine(config)
    try:
        plan = engine.info()["plan"]
        assert engine.config.max_batch == plan["max_batch"] == 1 and engine.backend.config.max_batch == 1
        assert engine.info()["expert_policy"] == "resident" and "one chat's KV held" in plan["summary"]
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        first = engine.generate(GenerationRequest(messages=chat, max_new_tokens=8, greedy=True, session_id="a"))
        engine.generate(GenerationRequest(prompt="Hello", max_new_tokens=2, greedy=True, session_id="b"))
        again = chat + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And of Italy?"}]
        res = engine.generate(GenerationRequest(messages=again, max_new_tokens=8, greedy=True, session_id="a"))
        assert "Paris" in first.text and res.prefilled_tokens == res.prompt_tokens  # a's KV went to b
        assert list(engine.backend.generator.sessions) == ["a"]
    finally:
        engine.close()


def test_auto_policies_send_a_gguf_to_llamacpp_on_a_machine_without_a_gpu(tmp_path):
    pytest.importorskip("llama_cpp")
    gguf = tmp_path / "m.gguf"
    assert choose_backend(EngineConfig(model=str(gguf), device="cpu")) == "llamacpp"
    assert choose_backend(EngineConfig(model=str(gguf), device="cpu", expert_policy="adaptive",
                                       simulate_hybrid=True)) == "tandem"


@fits_nowhere_here
def test_a_model_that_fits_nowhere_is_refused_before_its_weights_are_made():
    t0 = time.perf_counter()
    with pytest.raises(OutOfMemoryError) as e:
        Engine(EngineConfig(model=TOO_BIG, device="cpu", max_context=4096))
    assert time.perf_counter() - t0 < 10  # generating 57 GiB of weights would take minutes
    assert "57.0 GiB" in e.value.what or "56.9 GiB" in e.value.what
    assert "quantised" in e.value.remedy


def test_plan_placement_reads_headers_only():
    p = plan_placement(EngineConfig(model=MOE, device="cpu"))
    assert p["fits"] and {r["where"] for r in p["rows"]} == {"RAM"}
    assert p["decode_tok_s"] > 0 and p["bottleneck"].startswith("decode:")


def _plan_cli(*args):
    return subprocess.run([sys.executable, "-m", "engine.cli", "plan", *args], capture_output=True, text=True,
                          timeout=120)


def test_tandem_plan_prints_the_table_and_json():
    table = _plan_cli("--model", MOE, "--simulate-hybrid", "--vram-budget-gb", "0.5", "--max-context", "512")
    assert table.returncode == 0, table.stderr
    for words in ("routed experts (cache)", "GPU", "RAM", "predicted", "bottleneck", "expert_policy adaptive",
                  "chats      the KV of 4 chats"):  # how many chats' KV it holds, and why
        assert words in table.stdout
    js = _plan_cli("--model", MOE, "--device", "cpu", "--json")
    assert js.returncode == 0 and json.loads(js.stdout)["device"] == "cpu"
    assert json.loads(js.stdout)["max_batch"] == 4 and json.loads(js.stdout)["chats_reason"]


@fits_nowhere_here
def test_tandem_plan_exits_non_zero_when_the_model_cannot_fit():
    out = _plan_cli("--model", TOO_BIG, "--device", "cpu")
    assert out.returncode == 1 and "does not fit" in out.stdout and "try " in out.stdout
    js = _plan_cli("--model", TOO_BIG, "--device", "cpu", "--json")
    assert js.returncode == 1 and json.loads(js.stdout)["fits"] is False
