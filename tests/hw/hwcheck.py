"""Checks and fixtures shared by the hw tests."""

from engine.hw import profile
from engine.hw.probe import fingerprint, probe
from engine.hw.shapes import ExpertShape, KVShape


def unexplained_nulls(obj, where: str = "") -> list[str]:
    """Paths of None values whose dict does not say why in `unavailable` (the hw convention)."""
    out = []
    if isinstance(obj, dict):
        why = obj.get("unavailable") or {}
        for key, value in obj.items():
            if value is None:
                if not (isinstance(why.get(key), str) and why[key].strip()):
                    out.append(f"{where}.{key}")
            else:
                out.extend(unexplained_nulls(value, f"{where}.{key}"))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            out.extend([f"{where}[{i}]"] if value is None else unexplained_nulls(value, f"{where}[{i}]"))
    return out


KV = KVShape(n_heads=8, n_kv_heads=2, head_dim=64, dtype="bfloat16")  # 512 bytes per token
EXPERT = ExpertShape(hidden=256, ffn=128, dtype="bfloat16")


def make_profile(A=12.5, B=3.25, c_cpu=0.02, c_gpu=0.35, created="2026-01-01T00:00:00+00:00") -> dict:
    """A profile of this machine with chosen numbers (what a calibration writes, without measuring)."""
    machine = probe()
    kv_key = f"{KV.key}/{EXPERT.key}"
    return {
        "schema": profile.SCHEMA, "schema_version": profile.SCHEMA_VERSION, "fingerprint": fingerprint(machine),
        "created_utc": created, "mode": "quick", "machine": machine, "calibrated_shape": kv_key,
        "shapes": {kv_key: {
            "model": "test", "mode": "quick", "calibrated_utc": created,
            "shape": {"name": "test", "kv": vars(KV), "expert": vars(EXPERT), "n_layers": 2, "n_experts": 4, "top_k": 2},
            "kv": {"cpu_kernel": "k", "by_batch": {
                "1": {"A_ns_per_token": A, "B_ns_per_token": B, "C_cpu_ms": c_cpu, "C_gpu_ms": c_gpu,
                      "delta_ms": c_gpu - c_cpu},
                "4": {"A_ns_per_token": 2 * A, "B_ns_per_token": B, "C_cpu_ms": c_cpu, "C_gpu_ms": c_gpu,
                      "delta_ms": c_gpu - c_cpu}}},
            "experts": {"bytes_per_expert": EXPERT.bytes_per_expert, "B_H_GBps": 30.0, "B_P_GBps": 50.0,
                        "B_R_GBps": 0.0, "fill_ms": 0.2,
                        "cpu_ms": [{"tokens": 1, "ms": 0.3}, {"tokens": 16, "ms": 0.6}, {"tokens": 64, "ms": 1.2}],
                        "gpu_ms": [{"tokens": 1, "ms": 0.08}, {"tokens": 64, "ms": 0.09}],
                        "concurrent": {"B_P_GBps": 49.0, "B_H_GBps": 20.0}},
        }},
    }
