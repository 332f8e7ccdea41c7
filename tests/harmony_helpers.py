"""A tiny harmony tokenizer for tests: one token per character plus gpt-oss's special tokens, and a
chat template that writes harmony (the real one's shape: past assistant turns carry their answer
alone, the generation prompt ends with `<|start|>assistant`)."""

from __future__ import annotations

import string
from pathlib import Path

SPECIALS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>",
            "<|endoftext|>"]
TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}"
            "{% if m.role == 'assistant' %}<|channel|>final{% endif %}<|message|>{{ m.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
REPLY = ("<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
         "<|start|>assistant<|channel|>final<|message|>Hello there!<|return|>")


def harmony_tokenizer(vocab_size: int | None = None):
    """A PreTrainedTokenizerFast; `vocab_size` pads the vocabulary to a model's (ids stay below it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\x0b\x0c"))
    vocab = {c: i for i, c in enumerate(chars)}
    vocab["[UNK]"] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # every character its own token
    core.decoder = decoders.Fuse()  # and joined back without spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="<|return|>")
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.chat_template = TEMPLATE
    assert vocab_size is None or len(tok) <= vocab_size, f"the model's vocabulary must hold {len(tok)} tokens"
    return tok


def save_harmony_tokenizer(folder: Path) -> Path:
    harmony_tokenizer().save_pretrained(folder)
    return folder


def tiny_gpt_oss_folder(folder: Path) -> Path:
    """A random 2-layer gpt-oss model (transformers' own config class) with the harmony tokenizer
    beside it: an ordinary model folder the engine loads, template and all."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    tok = harmony_tokenizer()
    config = GptOssConfig(vocab_size=128, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256,
                          rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                           "beta_slow": 1.0, "truncate": False,
                                           "original_max_position_embeddings": 64},
                          tie_word_embeddings=False, eos_token_id=tok.convert_tokens_to_ids("<|return|>"),
                          bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    GptOssForCausalLM(config).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def script_replies(monkeypatch, text: str, tokenizer) -> list[int]:
    """Every sequence's sampler picks the tokens of `text` in turn (a random model's own choices
    are noise; the engine around the sampler runs as it is): the scripted reply's ids."""
    import torch

    from engine.runtime.sampling import Sampler

    ids = tokenizer.encode(text, add_special_tokens=False)

    def choose(self, logits, history):
        self.scripted = getattr(self, "scripted", 0) + 1
        return torch.tensor(ids[min(self.scripted, len(ids)) - 1], dtype=torch.int64, device=logits.device)

    monkeypatch.setattr(Sampler, "choose", choose)
    return ids
