"""The only door into the engine: EngineConfig, GenerationRequest/Result, Engine, StatsSnapshot.

    engine = Engine(EngineConfig(model="builtin:smollm2-135m-moe"))
    result = engine.generate(GenerationRequest(messages=[{"role": "user", "content": "Hi"}]),
                             on_text=print)
    engine.stats().to_json()

One Engine serves one caller at a time (calls are serialised by a lock); the app keeps it in a
worker thread. Errors meant for the user are `engine.errors.TandemError`s.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Callable

from engine.errors import ConfigError, TandemError
from engine.models.builtin import DEFAULT_MODEL
from engine.runtime.harmony import Reasoning
from engine.runtime.requests import GenerationRequest, GenerationResult
from engine.runtime.telemetry import StatsSnapshot

__all__ = ["Engine", "EngineConfig", "GenerationRequest", "GenerationResult", "Reasoning", "StatsSnapshot", "TandemError",
           "probe_hardware", "calibrate", "load_profile", "plan_placement"]


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL  # builtin:…, synthetic:…, a model folder, or a .gguf path
    backend: str = "auto"  # auto | tandem | llamacpp | remote (auto: see choose_backend)
    device: str = "auto"  # auto | cuda | cpu
    dtype: str = "auto"  # auto | float32 | bfloat16 (auto: bf16 on GPU; fp32 on CPU with an fp16 KV cache)
    vram_budget_gb: float | None = None
    # auto: the placement plan chooses (runtime/planning.py); the others are for comparisons
    kv_policy: str = "auto"  # auto | resident | writescope | gpu-centric | cpu-centric | fixed:<r> | monolithic
    expert_policy: str = "auto"  # auto | resident | adaptive | cpu-only | on-demand | static
    d_window: int = 256  # tokens of newest decode KV kept on the GPU (hybrid KV policies)
    block_size: int = 64  # tokens per KV block
    max_context: int | None = None  # None: the model's own context length
    max_batch: int | None = None  # sequences (chats) whose KV is held at once; None: the plan's (≤ 4)
    cpu_threads: int | None = None  # None: torch's default
    profile_path: str | None = None  # calibration profile; None: the default location
    simulate_hybrid: bool = False  # run hybrid paths with the "GPU side" on the CPU (tests)
    expert_cache_slots: int | None = None  # GPU expert slots; None: what vram_budget_gb leaves (offload policies)
    remote_url: str | None = None  # backend remote: an OpenAI-compatible server, e.g. http://host:8000/v1
    remote_api_key: str | None = None  # backend remote: its key (sent as a Bearer token)
    cuda_graphs: bool = True  # replay decode steps as CUDA graphs where KV and experts allow (resident, CUDA)


def choose_backend(config: EngineConfig) -> str:
    """`auto`: llama.cpp for GGUF files on machines without CUDA when llama-cpp-python is installed,
    except files Tandem computes over in blocks on a CPU where its quantised kernels lead (AVX2 or
    AVX-512); else Tandem. What the rule follows (benchmarks/RESULTS.md, decode tok/s in the same run):

    - MoE files whose routed experts Tandem keeps in blocks (models/loader.EXPERT_BLOCK_FAMILIES): a
      Q4_K_M Qwen3-30B-A3B cut to 8 layers decoded at 56.1 tok/s against llama.cpp's 41.3 with AVX2 on
      two threads (Zen 3; prefill 115 against 87.4: benchmarks/dev-2core-avx2/ab-cpu-moe-q4km-L8-19e31a4.json)
      and at 67.2 against 40.9 with AVX-512 (a Xeon, prefill 230 against 155:
      benchmarks/dev-2core/2026-12-07-avx512-int8-kquants/).
    - Dense files of a family Tandem runs (llama) whose matrices are all of the kept block types
      (models/loader.matrices_in_blocks): Llama-3.2-1B's shapes as Q4_K_M decoded at 35.6 against 21.3
      on the 2-core AVX-512 Xeon, prefill 124 against 126 (benchmarks/dev-2core/cpu-dense-q4km-2026-12-07.json),
      and at 31.7 against 20.9 with Tandem's kernels pinned to AVX2 there (…-avx2-pinned-2026-12-07.json);
      the built-in Q4_1 file at 152 against 125 on an AVX2 machine (Zen 3, benchmarks/dev-2core-avx2/
      ab-cpu-builtin-d956ab8.json).
    - The rest go to llama.cpp: a CPU without AVX2 runs Tandem's portable kernels, which nothing has
      measured beside llama.cpp; llama.cpp runs every dense architecture and quant type, Tandem the
      families it names, and a dense layer it would dequantise runs float GEMMs that were not measured.

    The built-in models stay on Tandem: they are the reference the tests hold to transformers, and
    llama.cpp's quantised-activation kernels change the dense model's greedy answer (asked for the
    capital of France it lists Parisian landmarks instead of answering "Paris")."""
    if config.backend != "auto":
        return config.backend
    if config.remote_url:
        return "remote"
    import importlib.util

    import torch

    gguf_model = config.model.lower().endswith(".gguf")
    plain = {config.kv_policy, config.expert_policy} <= {"auto", "resident"} and not config.simulate_hybrid
    no_gpu = config.device == "cpu" or not torch.cuda.is_available()
    if gguf_model and plain and no_gpu and importlib.util.find_spec("llama_cpp") is not None \
            and not (_runs_in_blocks(config.model) and _quant_kernels_lead()):
        return "llamacpp"
    return "tandem"


def _quant_kernels_lead() -> bool:
    """Whether this CPU runs Tandem's quantised-block kernels with AVX2 or AVX-512, where its decode was
    measured ahead of llama.cpp's (choose_backend)."""
    from engine.kernels import native

    nat = native.module()
    return nat is not None and hasattr(nat, "supported_quant_isas") and \
        bool({"avx2", "avx512"} & set(nat.supported_quant_isas()))


def _runs_in_blocks(path: str) -> bool:
    """Whether Tandem's CPU load of a GGUF computes over the file's blocks: a MoE whose routed experts it
    keeps in blocks, or a dense model of a family it runs whose matrices are all of the kept types. From
    the header; a file that cannot be read, or of an architecture Tandem lacks, answers no (its load,
    wherever it goes, says what is wrong)."""
    from engine.models.loader import keeps_expert_blocks, matrices_in_blocks
    from engine.models.shape import model_args

    try:
        args = model_args(path)
        return keeps_expert_blocks(args.arch, True) if args.is_moe else matrices_in_blocks(path)
    except Exception:  # missing, damaged, unknown architecture: the backend's load reports it
        return False


class Engine:
    """The engine behind one model. Calls are serialised: one generation at a time."""

    def __init__(self, config: EngineConfig | None = None, progress: Callable[[str, float], None] | None = None):
        self.config = config or EngineConfig()
        if self.config.max_batch is not None and self.config.max_batch < 1:
            raise ConfigError(f"max_batch must be at least 1 (got {self.config.max_batch})", "set max_batch ≥ 1")
        self._lock = threading.Lock()
        kind = choose_backend(self.config)
        if kind == "tandem":
            from engine.runtime.tandem import TandemBackend
            self.backend = TandemBackend(self.config, progress)
        elif kind == "llamacpp":
            from engine.backends.llamacpp import LlamaCppBackend
            self.backend = LlamaCppBackend(self.config, progress)
        elif kind == "remote":
            from engine.backends.remote import RemoteBackend
            self.backend = RemoteBackend(self.config, progress)
        else:
            raise ConfigError(f"unknown backend '{self.config.backend}'", "use auto, tandem, llamacpp or remote")
        if self.config.max_batch is None:  # Tandem's plan chose it; the other backends hold llama-server's slots
            from engine.sched.placement import AUTO_CHATS

            held = getattr(self.backend, "config", self.config).max_batch
            self.config = replace(self.config, max_batch=held or AUTO_CHATS)

    @property
    def tokenizer(self):
        return self.backend.tokenizer

    @property
    def parts(self):
        """The Tandem backend's placed model, KV and experts, for tests and tools (None on other backends)."""
        return getattr(self.backend, "parts", None)

    @property
    def max_context(self) -> int:
        return self.backend.max_context

    def info(self) -> dict:
        return self.backend.info()

    def tokenize(self, text: str) -> list[int]:
        return self.backend.tokenize(text)

    def render(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat under the model's template, ending with the assistant's turn."""
        return self.backend.render(messages)

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        return self.backend.prompt_ids(request)

    def generate(self, request: GenerationRequest, on_text: Callable[[str], None] | None = None,
                 stop_event: threading.Event | None = None) -> GenerationResult:
        """on_text gets the reply's text as it becomes final: answer as `str`, a reasoning model's
        reasoning as `Reasoning` (a str subclass); the result holds them apart (text, reasoning)."""
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
            return self.backend.generate_batch(requests, on_text, stop_event)

    def live_batch(self):
        """Continuous batching over this engine (engine/runtime/batching.py): requests join and leave
        the running batch between decode steps. None on backends that decode one request at a time."""
        if getattr(self.backend, "name", None) != "tandem":
            return None
        from engine.runtime.batching import LiveBatch

        return LiveBatch(self.backend, self._lock, self.config.max_batch)

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int, greedy: bool = True, **sampling) -> list[int]:
        """Token ids in, token ids out: no template, no stop strings, EOS still ends generation."""
        req = GenerationRequest(prompt_ids=list(prompt_ids), max_new_tokens=max_new_tokens, greedy=greedy, **sampling)
        return self.generate(req).token_ids

    def end_session(self, session_id: str) -> None:
        with self._lock:
            self.backend.end_session(session_id)

    def stats(self) -> StatsSnapshot:
        return self.backend.stats()

    def set_expert_policy(self, policy: str) -> None:
        """Switch between the offload expert policies (adaptive, on-demand, static, cpu-only) without
        reloading; the engine must have been loaded with one of them. The cache starts afresh."""
        if not hasattr(self.backend, "set_expert_policy"):
            raise ConfigError(f"the {self.backend.name} backend has no expert policies", "use the tandem backend")
        with self._lock:
            self.backend.set_expert_policy(policy)

    def close(self) -> None:
        with self._lock:
            self.backend.close()


# -- hardware: what the first-run wizard and `tandem calibrate` call ---------------------------------

def probe_hardware() -> dict:
    """What this machine is: {cpu, memory, gpu, software}; a missing value is None and its section's
    `unavailable` dict says why."""
    from engine.hw.probe import probe

    return probe()


def calibrate(mode: str = "quick", progress: Callable[[str, float], None] | None = None,
              profile_path: str | None = None, *, model: str | None = None, device: str = "auto",
              dtype: str = "auto", cancel: threading.Event | None = None) -> dict:
    """Measure this machine for `model`'s shape (default: the default model), write the profile
    atomically (profile_path, default: the user data dir) and return it as a dict.

    mode: "quick" (under a minute; the wizard's default) or "full". progress(step, fraction) is
    called as it goes; setting `cancel` (or raising from progress) stops it and keeps the previous
    profile. Without CUDA the profile is CPU-only, its GPU fields None with the reason.
    """
    from engine.hw import profile as hw_profile
    from engine.hw.calibrate import calibrate as measure
    from engine.models.shape import model_shape
    from engine.runtime.loading import resolve_device, resolve_dtype

    dev = resolve_device(device)
    shape = model_shape(model or DEFAULT_MODEL, resolve_dtype(dtype, dev))
    data = measure(shape, mode, progress, cancel, use_cuda=dev.type == "cuda")
    path = hw_profile.save(data, profile_path)
    return hw_profile.read(path)


def plan_placement(config: EngineConfig | None = None) -> dict:
    """Where `config`'s model would live on this machine and how fast it would run, from the model's
    headers alone (no weights read): the placement plan of DESIGN.md §4b as a dict, with `fits`,
    the policies, the rows (part, where, bytes), the predicted tok/s, the bottleneck and a one-line
    `summary` for people. A model that fits nowhere comes back with fits=False, `problem` and `remedy`."""
    from engine.hw import profile as hw_profile
    from engine.runtime.planning import placement_plan

    config = config or EngineConfig()
    p = placement_plan(config, hw_profile.load(config.profile_path))
    return p.to_dict() | {"summary": p.summary()}


def load_profile(path: str | None = None, strict: bool = False) -> dict | None:
    """The saved profile of this machine, or None when there is none. A profile from another machine
    or version is ignored with a logged warning; strict=True raises its TandemError (what + remedy)."""
    from engine.hw import profile as hw_profile

    found = hw_profile.load(path, strict=strict)
    return None if found is None else found.to_dict()


def builtin_models() -> list[dict]:
    """The built-in models for model pickers: name, one-line description, whether it is the default."""
    from engine.models.builtin import BUILTINS

    return [{"name": f"builtin:{key}", "description": b.description, "default": f"builtin:{key}" == DEFAULT_MODEL}
            for key, b in BUILTINS.items()]
