"""Tokenizer and chat template (through transformers), with a cache for GGUF-embedded tokenizers.

Building a tokenizer from GGUF metadata takes ~13 s on a 2-core machine; the result is saved as an
ordinary tokenizer folder in the user cache and reloaded from there in well under a second.
"""

from __future__ import annotations

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
            raise ModelFileError(f"the tokenizer in {src} could not be read ({e})",
                                 "the GGUF file lacks tokenizer metadata or is damaged") from e
    try:
        tok.save_pretrained(cached)
    except OSError:
        pass  # a read-only or full cache only costs the next start its 13 s
    return tok


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
