"""Diagnostic: WriteScope's r target, A and B through a chunked prefill and then decode, on the built-in
MoE with the hybrid KV simulated on the CPU. Before b0beaae, A went from 154 to ~16,500 ns a token
within the first 512-token chunks and r followed it; since, prefill leaves A and B alone.
    python3 benchmarks/dev-2core/prefill_costs_probe.py"""
from engine.api import Engine, EngineConfig

engine = Engine(EngineConfig(model="builtin:smollm2-135m-moe", device="cpu", simulate_hybrid=True,
                             kv_policy="writescope", max_context=8192, max_batch=1, d_window=64))
kv = engine.backend.parts.kv
begin = kv.begin_step


def reporting_begin(seq_ids, n_new, steps=[0]):
    out = begin(seq_ids, n_new)
    if n_new > 1 or steps[0] % 16 == 0:
        print(f"new tokens {n_new:5d}  r target {kv.r_target:.3f}  A {kv.share.A.per_token_ns:9.1f} ns  "
              f"B {kv.share.B.per_token_ns:9.1f} ns  r deployed {kv.telemetry()['r_deployed']}")
    steps[0] += 1
    return out


kv.begin_step = reporting_begin
engine.generate_ids(list(range(100, 3100)), 96)
