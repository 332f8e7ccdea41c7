"""Real, tiny model files on disk for the model-list and switch tests: GGUF files written with the
gguf library (valid headers and tensor data, a few KB), and Hugging Face folders with safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import save_file


def write_gguf(path: Path, arch: str = "llama", name: str = "Tiny", context: int = 4096,
               file_type: int = 1, rows: int = 64) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(context)
    w.add_file_type(file_type)
    w.add_tensor("token_embd.weight", np.ones((rows, 16), dtype=np.float16))
    w.add_tensor("output_norm.weight", np.ones((16,), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def truncate(path: Path, keep: float = 0.6) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])
    return path


def write_hf_folder(folder: Path, model_type: str = "qwen3_moe", context: int = 32768, dtype=np.float16) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "max_position_embeddings": context,
                                                    "architectures": ["Qwen3MoeForCausalLM"]}))
    save_file({"model.embed_tokens.weight": np.ones((32, 8), dtype=dtype)}, str(folder / "model.safetensors"))
    return folder
