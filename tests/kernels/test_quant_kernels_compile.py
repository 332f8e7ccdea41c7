"""The Triton kernels over GGUF blocks compile for the GPU machine's target (sm_90) on a machine with no
GPU: the CPU tests run them only in Triton's interpreter, which accepts code a device compile refuses."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


def test_quant_kernels_compile_for_sm90():
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this Triton ships no ptxas to compile for CUDA with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the decoding's roundings assume fused multiply-adds (dequant_gpu)
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("compile_for_cuda.py"))], env=env,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert done.stdout.strip().endswith("0 failed")
