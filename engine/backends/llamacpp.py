"""llama.cpp (through llama-cpp-python) behind Tandem's Engine interface, for GGUF files.

It is what a CPU-only machine runs plain GGUF models with (several times faster there than
Tandem's torch path on quantised weights) and the peer in benchmarks. Prompts are rendered and
detokenised with the same transformers tokenizer Tandem uses, so both engines see the same ids.
llama.cpp keeps one sequence's KV: a follow-up turn of the same chat reuses its common prefix;
switching chats prefills again.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Callable

from engine.errors import ConfigError, ContextOverflowError, ModelFileError
from engine.hw.probe import cpu_flags
from engine.models import builtin
from engine.runtime.chat import eos_ids, load_tokenizer, render_chat
from engine.runtime.requests import GenerationRequest, GenerationResult, prompt_ids_of
from engine.runtime.telemetry import GenerationTimer, Telemetry
from engine.runtime.textstream import TextStream
from engine.runtime.thread_chooser import ThreadChooser


def gguf_path_for(model: str) -> Path:
    if model.startswith("builtin:"):
        path, upcycle = builtin.resolve(model)
        if upcycle is not None:
            raise ConfigError(f"{model} is upcycled at load time by Tandem; llama.cpp cannot run it",
                              "use backend tandem, or the dense builtin:smollm2-135m")
        return path
    path = Path(model).expanduser()
    if path.suffix.lower() != ".gguf":
        raise ConfigError(f"the llama.cpp backend reads .gguf files, not {path}", "use backend tandem for folders")
    if not path.is_file():
        raise ModelFileError(f"model not found: {path}", "check the path")
    return path


_PARAMS_LOCK = threading.Lock()  # the guard below swaps a module attribute of llama-cpp-python


@contextlib.contextmanager
def amx_repack_off(llama_cpp):
    """Models loaded inside this block skip llama.cpp's extra weight buffers (repacked layouts) on a
    CPU with AMX. There, llama-cpp-python 0.3.36 repacks Q4_1 weights for AMX tiles at load and then
    crashes the process in llama_decode (segmentation fault; the built-in SmolLM2 file, on a
    Sapphire Rapids-class CPU). Llama() has no parameter for it, so the defaults it
    asks for are adjusted while the block runs. Elsewhere nothing changes: repacking is faster there."""
    low = llama_cpp.llama_cpp
    default = low.llama_model_default_params
    if "amx_tile" not in cpu_flags() or not hasattr(default(), "use_extra_bufts"):
        yield
        return

    def without_extra_buffers():
        params = default()
        params.use_extra_bufts = False
        return params

    with _PARAMS_LOCK:
        low.llama_model_default_params = without_extra_buffers
        try:
            yield
        finally:
            low.llama_model_default_params = default


class LlamaCppBackend:
    name = "llamacpp"

    def __init__(self, config, progress: Callable[[str, float], None] | None = None):
        report = progress or (lambda step, frac: None)
        try:
            import llama_cpp
        except ImportError as e:
            raise ConfigError("llama-cpp-python is not installed",
                              "pip install llama-cpp-python (builds llama.cpp from source, ~5 min), "
                              "or use backend tandem") from e
        if {config.kv_policy, config.expert_policy} - {"auto", "resident"}:  # llama.cpp places for itself
            raise ConfigError("the llama.cpp backend has no hybrid KV or expert policies",
                              "use backend tandem for kv_policy/expert_policy other than auto or resident")
        self.config = config
        self.version = llama_cpp.__version__
        report("reading model file", 0.0)
        self.path = gguf_path_for(config.model)
        self.threads = config.cpu_threads or os.cpu_count() or 1
        try:
            with amx_repack_off(llama_cpp):
                self.llm = llama_cpp.Llama(model_path=str(self.path), n_threads=self.threads,
                                           n_threads_batch=self.threads, n_ctx=config.max_context or 4096,
                                           n_gpu_layers=0, verbose=False)
        except ValueError as e:
            raise ModelFileError(f"llama.cpp could not load {self.path} ({e})",
                                 "the file is truncated, corrupt or of an architecture llama.cpp lacks; "
                                 "for a MoE file, backend tandem may run it") from e
        report("loading tokenizer", 0.8)
        self.tokenizer = load_tokenizer(self.path.parent, self.path.name)
        self.max_context = self.llm.n_ctx()
        self.telemetry = Telemetry()
        self._session: str | None = None  # the chat whose KV llama.cpp holds now
        # llama.cpp's decode waits on a thread that shares a busy core as Tandem's kernels do: the same
        # measured count (engine/runtime/thread_chooser.py), unless the config fixes it
        self.chooser = None
        # the llama_context of llama-cpp-python's Llama (a private attribute: a release without it keeps
        # the fixed count rather than failing the load)
        ctx = getattr(getattr(self.llm, "_ctx", None), "ctx", None)
        if config.cpu_threads is None and self.threads > 1 and ctx is not None:
            def apply(n: int) -> None:  # decode steps on n threads; prompts keep every core
                llama_cpp.llama_set_n_threads(ctx, n, self.threads)

            self.chooser = ThreadChooser.from_free_cores(self.threads, apply)
        report("ready", 1.0)

    def info(self) -> dict:
        return {"backend": self.name, "model": self.config.model, "family": "gguf", "layers": None,
                "experts": None, "top_k": None, "device": "cpu", "dtype": "gguf", "max_context": self.max_context,
                "kv_policy": "llama.cpp", "expert_policy": None, "llama_cpp": self.version,
                **(self.chooser.telemetry() if self.chooser else {})}

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render(self, messages: list[dict]) -> list[int]:
        return render_chat(self.tokenizer, messages)

    def prompt_ids(self, req: GenerationRequest) -> list[int]:
        return prompt_ids_of(req, self.tokenize, self.render)

    def generate_batch(self, requests, on_text, stop_event) -> list[GenerationResult]:
        # llama.cpp's Python binding holds one sequence: requests run one after another.
        return [self._generate(i, r, on_text, stop_event) for i, r in enumerate(requests)]

    def _generate(self, index: int, req: GenerationRequest, on_text, stop_event: threading.Event | None):
        prompt = self.prompt_ids(req)
        if len(prompt) + 1 > self.max_context:
            raise ContextOverflowError(f"the prompt has {len(prompt)} tokens; the context window holds {self.max_context}",
                                       "shorten the prompt or history, start a new chat, or raise max_context")
        params = req.sampling()
        params.validate()
        if req.session_id is None or req.session_id != self._session:
            self.llm.reset()  # another chat's KV must not leak into this one
        self._session = req.session_id
        cached = self.llm.longest_token_prefix(self.llm.input_ids[: self.llm.n_tokens].tolist(), prompt)
        prefilled = len(prompt) - min(cached, len(prompt) - 1)
        self.llm.set_seed(params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little"))
        greedy = params.greedy or params.temperature == 0
        stream = TextStream.for_request(self.tokenizer, req)
        eos = set() if req.ignore_eos else eos_ids(self.tokenizer, [self.llm.token_eos()])
        timer = GenerationTimer()
        self.telemetry.last = timer
        generated, finish = [], None
        if stop_event is not None and stop_event.is_set():
            finish = "stopped"
        self.telemetry.phase = "prefill"
        last = time.perf_counter()
        tokens = self.llm.generate(prompt, temp=0.0 if greedy else params.temperature, top_k=1 if greedy else params.top_k,
                                   top_p=params.top_p, repeat_penalty=params.repetition_penalty,
                                   reset=True)  # reset=True: llama-cpp-python then reuses the common prefix
        try:
            while finish is None:
                token = next(tokens)
                now = time.perf_counter()
                if timer.ttft_s is None:
                    timer.ttft_s = now - timer.t_start
                    timer.prefill_tokens, timer.prefill_s = prefilled, now - last
                    self.telemetry.phase = "decode"
                else:
                    timer.decode_tokens += 1
                    timer.decode_s += now - last
                    if self.chooser is not None:
                        self.chooser.step(now - last)
                last = now
                generated.append(token)
                if token in eos:
                    finish = "stop"
                    break
                for piece in stream.add(token):
                    if on_text:
                        on_text(index, piece)
                if stream.stopped:
                    finish = "stop"
                elif len(generated) >= req.max_new_tokens:
                    finish = "length"
                elif self.llm.n_tokens + 1 >= self.max_context:
                    finish = "context_full"
                elif stop_event is not None and stop_event.is_set():
                    finish = "stopped"
        finally:
            tokens.close()
            self.telemetry.phase = "idle"
        for piece in stream.finish():
            if on_text:
                on_text(index, piece)
        return GenerationResult(text=stream.text, token_ids=generated, finish_reason=finish, prompt_tokens=len(prompt),
                                prefilled_tokens=prefilled, completion_tokens=len(generated), ttft_s=timer.ttft_s,
                                prefill_tok_s=timer.prefill_tok_s, decode_tok_s=timer.decode_tok_s,
                                reasoning=stream.reasoning)

    def end_session(self, session_id: str) -> None:
        if session_id == self._session:
            self.llm.reset()
            self._session = None

    def stats(self):
        import torch

        kv_tel = {"policy": "llama.cpp", "tokens": {"resident": self.llm.n_tokens}, "cpu_kernel": "llama.cpp"}
        return self.telemetry.snapshot(device=torch.device("cpu"), weights_bytes=self.path.stat().st_size, kv_tel=kv_tel,
                                       experts_tel=None, vram_budget_bytes=None, model_info=self.info(), profile=None)

    def close(self) -> None:
        if getattr(self, "llm", None) is not None:
            self.llm.close()
            self.llm = None
