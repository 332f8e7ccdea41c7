"""An F32 GGUF rewritten with its matrices in blocks by gguf-py's own quantiser (no llama.cpp needed,
so the GPU machine's CUDA tests can make quantised files too): the routed experts' stacks in one type
per role, the other 2-D matrices whose rows are whole 32-weight blocks in another; norms, biases and
the metadata as they were."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def requantise(src: Path, dst: Path, experts: dict, dense) -> Path:
    """experts: {"gate": type, "up": type, "down": type} for `ffn_{role}_exps.weight`; dense: the type
    of every other matrix (gguf.GGMLQuantizationType members; None: left F32)."""
    import gguf
    from gguf.quants import quantize

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the header's own fields, and the one the writer sets
        main = field.types[0]
        sub = field.types[-1] if main == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), main, sub_type=sub)
    for t in reader.tensors:
        data = np.array(t.data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])  # (…, cols)
        role = next((r for r in ("gate_up", "gate", "up", "down") if t.name.endswith(f"ffn_{r}_exps.weight")), None)
        qtype = experts.get(role) if role else (dense if data.ndim == 2 else None)
        if qtype is not None and data.shape[-1] % 32 == 0:
            w.add_tensor(t.name, quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
