"""A GGUF's tokenizer when transformers cannot parse the file's model config (an architecture its
release does not know, a key it misreads): built from the file's tokenizer fields alone."""

from __future__ import annotations

import gguf
import pytest
import transformers

from engine.errors import ModelFileError
from engine.models.builtin import smollm2_gguf
from engine.runtime import chat

TEXT = "The capital of France is Paris."


def _tokenizer_only_gguf(path, arch: str, replace: dict | None = None):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", 2)
    for key, value, vtype, sub in chat.tokenizer_fields(smollm2_gguf()):
        w.add_key_value(key, (replace or {}).get(key, value), vtype, sub_type=sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


def _refuse_the_file(monkeypatch, name: str):
    """transformers failing on the file itself (as older releases do on qwen35moe or gpt-oss keys)."""
    for cls in (transformers.AutoTokenizer, transformers.PreTrainedTokenizerFast):
        original = cls.from_pretrained.__func__

        def refuse(c, folder, *a, _original=original, **kw):
            if kw.get("gguf_file") == name:
                raise ValueError("GGUF model with architecture qwen35moe is not supported yet.")
            return _original(c, folder, *a, **kw)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(refuse))


def test_a_file_transformers_refuses_gets_its_tokenizer_from_the_fields_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    reference = chat.load_tokenizer(smollm2_gguf().parent, smollm2_gguf().name)
    path = _tokenizer_only_gguf(tmp_path / "qwen35moe.gguf", "qwen35moe")
    _refuse_the_file(monkeypatch, path.name)
    tok = chat.load_tokenizer(tmp_path, path.name)
    assert tok.encode(TEXT, add_special_tokens=False) == reference.encode(TEXT, add_special_tokens=False)
    assert tok.decode(tok.encode(TEXT, add_special_tokens=False)) == TEXT
    assert tok.chat_template  # the file's template came along
    assert list((tmp_path / "cache").glob("tokenizers/qwen35moe-*-stand-in/tokenizer.gguf"))  # built that way


def test_a_pre_tokenizer_without_a_stand_in_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    path = _tokenizer_only_gguf(tmp_path / "gpt-oss.gguf", "gpt-oss", {"tokenizer.ggml.pre": "gpt-4o"})
    _refuse_the_file(monkeypatch, path.name)
    with pytest.raises(ModelFileError, match="gpt-4o") as err:
        chat.load_tokenizer(tmp_path, path.name)
    assert "upgrade transformers" in str(err.value)
