"""Shared by the reliability tests and their subprocess drivers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def write_tiny_chat_model(path: Path) -> Path:
    """A 2-layer LlamaForCausalLM with random weights and the built-in SmolLM2 tokenizer (vocabulary and
    chat template), saved as a Hugging Face folder: a real chat model that loads in about a second."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.models.builtin import smollm2_gguf
    from engine.runtime.chat import load_tokenizer

    gguf = smollm2_gguf()
    tok = load_tokenizer(gguf.parent, gguf.name)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def subprocess_env(data_dir: Path | None = None, **extra) -> dict:
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    if data_dir is not None:
        env["TANDEM_DATA_DIR"] = str(data_dir)
    env.update({k: str(v) for k, v in extra.items()})
    return env


PYTHON = sys.executable
