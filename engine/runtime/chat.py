"""Tokenizer and chat template (through transformers), with a cache for GGUF-embedded tokenizers.

Building a tokenizer from GGUF metadata takes ~13 s on a 2-core machine; the result is saved as an
ordinary tokenizer folder in the user cache and reloaded from there in well under a second.

transformers builds a GGUF's tokenizer only after parsing the file's model config, so a family it
does not know (qwen35moe, deepseek2 in older releases) or a key it misreads (gpt-oss's YaRN keys)
loses the tokenizer with it. The last resort is a copy of the file's `tokenizer.*` fields alone
under a stand-in architecture whose tokenizer transformers builds the same way (`_STAND_INS`).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from engine.errors import ModelFileError


def cache_dir() -> Path:
    import platformdirs
    return Path(os.environ.get("TANDEM_CACHE_DIR") or platformdirs.user_cache_dir("tandem"))


def load_tokenizer(tokenizer_dir: Path, gguf_file: str | None = None):
    import transformers
    from transformers import AutoTokenizer

    transformers.logging.set_verbosity_error()
    if gguf_file is None:
        try:
            return AutoTokenizer.from_pretrained(tokenizer_dir)
        except Exception as e:
            raise ModelFileError(f"the tokenizer in {tokenizer_dir} could not be loaded ({e})",
                                 "restore tokenizer.json / tokenizer_config.json from the download") from e
    src = tokenizer_dir / gguf_file
    st = src.stat()
    cached = cache_dir() / "tokenizers" / f"{src.stem}-{st.st_size}-{st.st_mtime_ns}"
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(cached)
        except Exception:
            pass  # a damaged cache entry: rebuild it below
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir, gguf_file=gguf_file)
    except Exception as e:
        # AutoTokenizer also parses the file's model config to pick a class, and transformers 5.24 fails
        # on some families' keys (gpt-oss's rope.scaling.*); the fast tokenizer reads the tokenizer alone.
        try:
            tok = transformers.PreTrainedTokenizerFast.from_pretrained(tokenizer_dir, gguf_file=gguf_file)
        except Exception:
            tok = _from_stand_in(src, cached.with_name(cached.name + "-stand-in"), e)
    try:
        tok.save_pretrained(cached)
    except OSError:
        pass  # a read-only or full cache only costs the next start its 13 s
    return tok


@functools.lru_cache(maxsize=4)
def tokenizer_fields(path: Path) -> tuple[tuple, ...]:
    """Every `tokenizer.*` key of a GGUF as (key, value, type, array item type or None).
    Cached: decoding SmolLM2's 49152 tokens and 48900 merges takes seconds."""
    import gguf

    reader = gguf.GGUFReader(Path(path))
    out = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        out.append((key, field.contents(), vtype, sub))
    if not any(k == "tokenizer.ggml.tokens" for k, *_ in out):
        raise ModelFileError(f"{path} holds no tokenizer (no tokenizer.ggml.tokens)",
                             "borrow the tokenizer of a GGUF that has one")
    return tuple(out)


# ("gpt2" BPE, tokenizer.ggml.pre) → an architecture whose GGUF tokenizer transformers builds with that
# pre-tokenizer split in every release (older ones pick the builder by architecture): GPT-2's
# byte-level split (SmolLM2's "smollm" is that split) as gpt2's, Qwen2's as qwen2's. SentencePiece
# vocabularies ("llama") stand in as llama.
_STAND_INS = {("gpt2", "gpt2"): "gpt2", ("gpt2", "smollm"): "gpt2",
              ("gpt2", "default"): "gpt2", ("gpt2", None): "gpt2", ("gpt2", "qwen2"): "qwen2"}


def _from_stand_in(src: Path, folder: Path, first_error: Exception):
    """The tokenizer of `src` from a GGUF of its tokenizer fields alone under a stand-in architecture."""
    import gguf
    import transformers

    fields = tokenizer_fields(src)
    values = {k: v for k, v, *_ in fields}
    kind = (values.get("tokenizer.ggml.model"), values.get("tokenizer.ggml.pre"))
    stand_in = "llama" if kind[0] == "llama" else _STAND_INS.get(kind)  # SentencePiece has no split to match
    if stand_in is None:
        raise ModelFileError(f"the tokenizer in {src} could not be read ({first_error}); transformers "
                             f"{transformers.__version__} builds no '{kind[1]}' {kind[0]} tokenizer from GGUF "
                             "metadata for this file's architecture",
                             "upgrade transformers, or point Tandem at the model's folder (tokenizer.json)")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.gguf"
    writer = gguf.GGUFWriter(str(path), stand_in)
    try:
        for key, value, vtype, sub in fields:
            writer.add_key_value(key, value, vtype, sub_type=sub)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
    finally:
        writer.close()
    try:
        return transformers.PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=path.name)
    except Exception as e:
        raise ModelFileError(f"the tokenizer in {src} could not be read ({first_error}; from its fields "
                             f"alone: {e})", "the GGUF file lacks tokenizer metadata or is damaged") from e


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a message list under the model's chat template (plain concatenation without one)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    else:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant: " if add_generation_prompt else "")
    return tokenizer.encode(text, add_special_tokens=False)


def eos_ids(tokenizer, model_eos: list[int]) -> set[int]:
    ids = set(model_eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
