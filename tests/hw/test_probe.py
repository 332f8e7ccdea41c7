"""The probe on this machine: every field present, a None always explained."""

import json

import torch

from hwcheck import unexplained_nulls
from engine.api import probe_hardware
from engine.hw.probe import fingerprint


def test_probe_reports_every_field_or_why_not():
    m = probe_hardware()
    json.dumps(m)  # plain JSON for the app
    cpu, gpu, mem = m["cpu"], m["gpu"], m["memory"]
    for key in ("model", "logical_cores", "physical_cores", "usable_cores", "torch_threads", "isa", "l3_bytes"):
        assert key in cpu
    assert cpu["logical_cores"] >= 1 and cpu["usable_cores"] >= 1
    assert set(cpu["isa"]) >= {"avx2", "avx512", "avx512_bf16", "amx"}
    assert mem["dram_total_bytes"] > 2**28 and 0 < mem["dram_available_bytes"] <= mem["dram_total_bytes"]
    for key in ("name", "vram_total_bytes", "vram_free_bytes", "pcie_gen", "pcie_width", "driver", "cuda_runtime"):
        assert key in gpu
    assert gpu["available"] == torch.cuda.is_available()
    assert m["software"]["torch"] == torch.__version__
    assert unexplained_nulls(m) == []


def test_without_cuda_gpu_fields_are_null_with_reason():
    m = probe_hardware()
    if torch.cuda.is_available():
        assert m["gpu"]["name"] and m["gpu"]["vram_total_bytes"] > 0
    else:
        assert m["gpu"]["name"] is None and "CUDA" in m["gpu"]["unavailable"]["name"]
        assert m["gpu"]["pcie_gen"] is None and m["gpu"]["unavailable"]["pcie_gen"]


def test_fingerprint_names_cpu_gpu_driver_and_torch():
    fp = fingerprint(probe_hardware())
    assert set(fp) - {"unavailable"} == {"cpu_model", "logical_cores", "physical_cores", "gpu_name", "driver", "torch"}
    assert unexplained_nulls(fp) == []
    assert fp["torch"] == torch.__version__
