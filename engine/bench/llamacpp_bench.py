"""llama.cpp's own `llama-bench` on a GGUF, as Tandem bench records (the reference for hybrid runs).

    python -m engine.bench.llamacpp_bench --llama-bench build-llamacpp/build-cuda/bin/llama-bench \\
        --model qwen3-L16.gguf -ngl 99 -ncmoe 16 -fa 1 -d 0,8192,32768 -p 512 -n 128 -r 3 --json out.json

Every flag is passed through as llama-bench spells it; a comma list makes llama-bench run every
combination (one result row each). `-ot exps=CPU` keeps all routed experts in host memory (the
hybrid layout), `-ncmoe N` those of the first N layers, `-nkvo` the KV cache too. The record keeps
the exact command line, llama-bench's own version and device strings, and per row: the test
(pp<n>: prompt processing of n tokens; tg<n>: generating n tokens one at a time, after `n_depth`
tokens already in the cache), tokens/s (mean and stddev over the repetitions, as llama-bench
computes them) and the per-repetition samples.

Only the standard library and engine.bench.common are used.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from engine.bench.common import header

# Our flag → llama-bench's flag. Values may be lists (llama-bench's comma syntax: all combinations).
FLAGS = {
    "n_gpu_layers": "-ngl", "n_cpu_moe": "-ncmoe", "override_tensor": "-ot", "no_kv_offload": "-nkvo",
    "flash_attn": "-fa", "depth": "-d", "batch": "-b", "ubatch": "-ub", "n_prompt": "-p", "n_gen": "-n",
    "reps": "-r", "threads": "-t", "mmap": "-mmp", "cache_type_k": "-ctk", "cache_type_v": "-ctv",
}
# llama-bench row fields copied into each result row as they are.
ROW_FIELDS = ("n_prompt", "n_gen", "n_depth", "n_batch", "n_ubatch", "n_threads", "n_gpu_layers", "n_cpu_moe",
              "no_kv_offload", "flash_attn", "type_k", "type_v", "use_mmap", "tensor_buft_overrides",
              "model_type", "model_size", "model_n_params", "backends", "avg_ns", "stddev_ns")


def _value(v) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, (list, tuple)):
        return ",".join(_value(x) for x in v)
    return str(v)


def command(binary: str | Path, model: str | Path, **flags) -> list[str]:
    """The llama-bench command line: `-m model -o json` and each flag given (None: left out)."""
    cmd = [str(binary), "-m", str(model), "-o", "json"]
    for key, value in flags.items():
        if key not in FLAGS:
            raise ValueError(f"unknown llama-bench flag '{key}' (known: {', '.join(FLAGS)})")
        if value is None:
            continue
        if key == "override_tensor":  # repeatable pattern=buffer pairs, e.g. exps=CPU
            for pattern in ([value] if isinstance(value, str) else value):
                cmd += ["-ot", pattern]
            continue
        cmd += [FLAGS[key], _value(value)]
    return cmd


def test_name(row: dict) -> str:
    """llama-bench's own test label: pp512, tg128, or pp512+tg128 for combined runs."""
    p, n = int(row.get("n_prompt", 0)), int(row.get("n_gen", 0))
    return "+".join(x for x in (f"pp{p}" if p else "", f"tg{n}" if n else "") if x)


def parse(output: str) -> list[dict]:
    """llama-bench `-o json` stdout (a JSON array of test rows) → result rows."""
    start = output.find("[")
    if start < 0:
        raise ValueError("llama-bench printed no JSON array")
    rows = json.loads(output[start:])
    results = []
    for row in rows:
        r = {"test": test_name(row), "tok_s": row["avg_ts"], "tok_s_stddev": row["stddev_ts"],
             "samples_tok_s": row.get("samples_ts", [])}
        r.update({k: row[k] for k in ROW_FIELDS if k in row})
        results.append(r)
    return results


def record(cmd: list[str], output: str, note: str | None = None) -> dict:
    rows = json.loads(output[output.find("["):])
    first = rows[0] if rows else {}
    return {**header(), "bench": "llamacpp", "llama_bench_command": shlex.join(cmd),
            "llama_cpp": {k: first.get(k) for k in ("build_commit", "build_number", "cpu_info", "gpu_info",
                                                      "model_filename", "model_type")},
            "tok_s": "llama-bench's avg_ts: tokens of the test / seconds, mean over repetitions",
            "note": note, "results": parse(output)}


def run(binary: str | Path, model: str | Path, *, timeout: float | None = None, note: str | None = None,
        **flags) -> dict:
    cmd = command(binary, model, **flags)
    print("running:", shlex.join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return record(cmd, proc.stdout, note)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.llamacpp_bench", description=__doc__.split("\n")[0])
    p.add_argument("--llama-bench", required=True, help="the llama-bench binary (engine.bench.llamacpp_build)")
    p.add_argument("--model", "-m", required=True, help="the GGUF file (tandem export-gguf)")
    p.add_argument("-ngl", dest="n_gpu_layers", default=None)
    p.add_argument("-ncmoe", dest="n_cpu_moe", default=None, help="experts of the first N layers on the CPU")
    p.add_argument("-ot", dest="override_tensor", action="append", default=None, help="e.g. exps=CPU (repeatable)")
    p.add_argument("-nkvo", dest="no_kv_offload", default=None, help="0|1 (list allowed)")
    p.add_argument("-fa", dest="flash_attn", default=None, help="0|1 (list allowed)")
    p.add_argument("-d", dest="depth", default=None, help="tokens already in the KV cache, e.g. 0,8192,32768")
    p.add_argument("-b", dest="batch", default=None)
    p.add_argument("-ub", dest="ubatch", default=None)
    p.add_argument("-p", dest="n_prompt", default=None)
    p.add_argument("-n", dest="n_gen", default=None)
    p.add_argument("-r", dest="reps", default=None)
    p.add_argument("-t", dest="threads", default=None)
    p.add_argument("-mmp", dest="mmap", default=None)
    p.add_argument("-ctk", dest="cache_type_k", default=None)
    p.add_argument("-ctv", dest="cache_type_v", default=None)
    p.add_argument("--timeout", type=float, default=None, help="seconds before llama-bench is stopped")
    p.add_argument("--note", default=None, help="free text kept in the record (what the run is for)")
    p.add_argument("--json", default=None, help="also write the record here")
    ns = vars(p.parse_args(argv))
    from engine.bench.common import write_json

    binary, model, path = ns.pop("llama_bench"), ns.pop("model"), ns.pop("json")
    rec = run(binary, model, timeout=ns.pop("timeout"), note=ns.pop("note"), **ns)
    write_json(rec, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
