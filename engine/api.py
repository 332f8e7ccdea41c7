"""The only door into the engine: EngineConfig, GenerationRequest/Result, Engine, StatsSnapshot.

    engine = Engine(EngineConfig(model="builtin:smollm2-135m-moe"))
    result = engine.generate(GenerationRequest(messages=[{"role": "user", "content": "Hi"}]),
                             on_text=print)
    engine.stats().to_json()

One Engine serves one caller at a time (calls are serialised by a lock); the app keeps it in a
worker thread. Errors meant for the user are `engine.errors.TandemError`s.
"""

from __future__ import annotations

import gc
import threading
from dataclasses import dataclass, field, fields
from typing import Callable

import torch

from engine.errors import ConfigError, TandemError
from engine.models.builtin import DEFAULT_MODEL
from engine.runtime.chat import eos_ids, render_chat
from engine.runtime.generator import Generator, SeqRun
from engine.runtime.loading import load_parts
from engine.runtime.sampling import Sampler, SamplingParams
from engine.runtime.telemetry import StatsSnapshot, Telemetry
from engine.runtime.textstream import TextStream

__all__ = ["Engine", "EngineConfig", "GenerationRequest", "GenerationResult", "StatsSnapshot", "TandemError"]


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL  # builtin:…, synthetic:…, a model folder, or a .gguf path
    backend: str = "tandem"  # tandem | llamacpp
    device: str = "auto"  # auto | cuda | cpu
    dtype: str = "auto"  # auto | float32 | bfloat16 (auto: bf16 on GPU, fp32 on CPU)
    vram_budget_gb: float | None = None
    kv_policy: str = "resident"  # resident | writescope | gpu-centric | cpu-centric | fixed:<r> | monolithic
    expert_policy: str = "resident"  # resident | adaptive | cpu-only | on-demand | static
    d_window: int = 256  # tokens of newest decode KV kept on the GPU (hybrid KV policies)
    block_size: int = 64  # tokens per KV block
    max_context: int | None = None  # None: the model's own context length
    max_batch: int = 4  # sequences (chats) whose KV is held at once
    cpu_threads: int | None = None  # None: torch's default
    profile_path: str | None = None  # calibration profile; None: the default location
    simulate_hybrid: bool = False  # run hybrid paths with the "GPU side" on the CPU (tests)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass
class GenerationRequest:
    messages: list[dict] | None = None  # [{"role": "user", "content": "…"}, …] through the chat template
    prompt: str | None = None  # one user message (or raw text when raw=True)
    prompt_ids: list[int] | None = None  # token ids as they are
    raw: bool = False
    max_new_tokens: int = 256
    greedy: bool = False
    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    session_id: str | None = None  # a chat's id: its KV is kept between calls

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.greedy, self.temperature, self.top_k, self.top_p, self.repetition_penalty, self.seed)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | stopped | context_full
    prompt_tokens: int
    prefilled_tokens: int  # prompt tokens computed this call (the rest were already in the session's KV)
    completion_tokens: int
    ttft_s: float | None
    prefill_tok_s: float | None
    decode_tok_s: float | None


class Engine:
    def __init__(self, config: EngineConfig | None = None, progress: Callable[[str, float], None] | None = None):
        self.config = config or EngineConfig()
        if self.config.backend != "tandem":
            raise ConfigError(f"backend '{self.config.backend}' is not available in this build", "use backend tandem")
        if self.config.max_batch < 1:
            raise ConfigError(f"max_batch must be at least 1 (got {self.config.max_batch})", "set max_batch ≥ 1")
        self._lock = threading.Lock()
        self.telemetry = Telemetry()
        self.parts = load_parts(self.config, progress)
        p = self.parts
        self.generator = Generator(p.model, p.kv, p.device, p.max_context, self.config.max_batch, self.telemetry)

    # -- facts ----------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.parts.tokenizer

    @property
    def max_context(self) -> int:
        return self.parts.max_context

    def info(self) -> dict:
        p = self.parts
        return {"model": self.config.model, "family": p.family, "layers": p.args.n_layers,
                "experts": p.args.n_experts or None, "top_k": p.args.top_k or None,
                "device": str(p.device), "dtype": str(p.dtype).removeprefix("torch."),
                "max_context": p.max_context, "kv_policy": p.kv.policy,
                "expert_policy": p.experts.policy if p.experts else None}

    # -- text helpers ---------------------------------------------------------------------------
    def _need_tokenizer(self):
        if self.parts.tokenizer is None:
            raise ConfigError(f"{self.config.model} has no tokenizer files", "pass token ids (generate_ids) or add a tokenizer")
        return self.parts.tokenizer

    def tokenize(self, text: str) -> list[int]:
        return self._need_tokenizer().encode(text, add_special_tokens=False)

    def render(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat under the model's template, ending with the assistant's turn."""
        return render_chat(self._need_tokenizer(), messages)

    def prompt_ids(self, req: GenerationRequest) -> list[int]:
        if req.prompt_ids is not None:
            return list(req.prompt_ids)
        if req.messages is not None:
            return self.render(req.messages)
        if req.prompt is None:
            raise ConfigError("the request has no prompt", "give messages, prompt or prompt_ids")
        return self.tokenize(req.prompt) if req.raw else self.render([{"role": "user", "content": req.prompt}])

    # -- generation -----------------------------------------------------------------------------
    def generate(self, request: GenerationRequest, on_text: Callable[[str], None] | None = None,
                 stop_event: threading.Event | None = None) -> GenerationResult:
        cb = (lambda i, t: on_text(t)) if on_text else None
        return self.generate_batch([request], cb, stop_event)[0]

    def generate_batch(self, requests: list[GenerationRequest], on_text: Callable[[int, str], None] | None = None,
                       stop_event: threading.Event | None = None) -> list[GenerationResult]:
        """Generate for several requests at once; on_text(index, text) streams each one's text."""
        if len(requests) > self.config.max_batch:
            raise ConfigError(f"{len(requests)} requests exceed max_batch={self.config.max_batch}",
                              "send fewer at once or raise max_batch")
        keys = [r.session_id for r in requests if r.session_id is not None]
        if len(keys) != len(set(keys)):
            raise ConfigError("one session appears twice in a batch", "send one request per chat")
        with self._lock:
            runs = []
            tok = self.parts.tokenizer
            eos = eos_ids(tok, self.parts.args.eos_token_ids)
            try:
                for i, req in enumerate(requests):
                    stream = TextStream(tok, req.stop) if tok is not None else None
                    run = SeqRun(self.prompt_ids(req), req.max_new_tokens, Sampler(req.sampling()), eos, stream,
                                 (lambda t, i=i: on_text(i, t)) if on_text else None)
                    run.session = self.generator.session(req.session_id)
                    runs.append(run)
                timer = self.generator.run(runs, stop_event)
            finally:  # throwaway sequences give their blocks back, whatever happened
                for req, run in zip(requests, runs):
                    if req.session_id is None and run.session is not None:
                        self.parts.kv.free(run.session.seq_id)
                    elif req.session_id is not None and run.finish_reason is None:
                        self.generator.end_session(req.session_id)  # failed mid-way: its KV is suspect
            return [GenerationResult(
                text=r.stream.text if r.stream else "", token_ids=r.generated, finish_reason=r.finish_reason,
                prompt_tokens=len(r.prompt), prefilled_tokens=r.prefilled, completion_tokens=len(r.generated),
                ttft_s=timer.ttft_s, prefill_tok_s=timer.prefill_tok_s, decode_tok_s=timer.decode_tok_s)
                for r in runs]

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int, greedy: bool = True, **sampling) -> list[int]:
        """Token ids in, token ids out: no template, no stop strings, EOS still ends generation."""
        req = GenerationRequest(prompt_ids=list(prompt_ids), max_new_tokens=max_new_tokens, greedy=greedy, **sampling)
        return self.generate(req).token_ids

    def end_session(self, session_id: str) -> None:
        with self._lock:
            self.generator.end_session(session_id)

    # -- stats and teardown ---------------------------------------------------------------------
    def stats(self) -> StatsSnapshot:
        p = self.parts
        budget = int(self.config.vram_budget_gb * 2**30) if self.config.vram_budget_gb else None
        experts_tel = p.experts.telemetry() if p.experts else None
        weights = p.weights_bytes + (experts_tel or {}).get("bytes", 0)
        return self.telemetry.snapshot(device=p.device, weights_bytes=weights, kv_tel=p.kv.telemetry(),
                                       experts_tel=experts_tel, vram_budget_bytes=budget, model_info=self.info(),
                                       profile=self.config.profile_path)

    def close(self) -> None:
        """Free the KV, the weights and cached GPU memory, in reverse order of creation."""
        with self._lock:
            if getattr(self, "parts", None) is None:
                return
            for key in list(self.generator.sessions):
                self.generator.end_session(key)
            self.parts = self.generator = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def builtin_models() -> list[dict]:
    """The built-in models for model pickers: name, one-line description, whether it is the default."""
    from engine.models.builtin import BUILTINS

    return [{"name": f"builtin:{key}", "description": b.description, "default": f"builtin:{key}" == DEFAULT_MODEL}
            for key, b in BUILTINS.items()]
