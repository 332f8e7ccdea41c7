"""Tandem's own backend: the placed model, its KV and experts, the generator, the counters."""

from __future__ import annotations

import gc
import logging
import threading
from typing import Callable

import torch

from engine.errors import ComputeError, ConfigError, OutOfMemoryError, TandemError
from engine.hw import profile as hw_profile
from engine.runtime.chat import eos_ids, render_chat
from engine.runtime.generator import Generator, SeqRun
from engine.runtime.loading import load_parts
from engine.runtime.planning import apply_plan, placement_plan
from engine.runtime.requests import GenerationRequest, GenerationResult, prompt_ids_of
from engine.runtime.sampling import Sampler
from engine.runtime.telemetry import StatsSnapshot, Telemetry
from engine.runtime.textstream import TextStream

log = logging.getLogger("tandem")


class TandemBackend:
    name = "tandem"

    def __init__(self, config, progress: Callable[[str, float], None] | None = None):
        self.telemetry = Telemetry()
        self.profile = hw_profile.load(config.profile_path)  # None: not calibrated (or another machine's)
        self.plan = _plan_or_none(config, self.profile)
        # the engine's config describes what runs: `auto` resolved by the plan (refused if nothing fits)
        self.config = config = apply_plan(config, self.plan)
        self.parts = load_parts(config, progress, self.profile)
        p = self.parts
        self.generator = Generator(p.model, p.kv, p.device, p.max_context, config.max_batch, self.telemetry)
        self.graphs_off: str | None = None  # why decode steps run eagerly (None: graphs are on)
        self.cpu_decode_off: str | None = None  # on a CPU: why decode steps run as modules, not native layer calls
        self._setup_graphs()
        self._setup_threads()

    def _setup_threads(self) -> None:
        """On a CPU device with the thread count left to Tandem, decode steps measure it (a core busy
        with another program makes every thread wait: engine/runtime/thread_chooser.py)."""
        from engine.kernels import native
        from engine.runtime.thread_chooser import ThreadChooser

        cores = native.available_cores()
        if self.parts.device.type != "cpu" or self.config.cpu_threads or self.config.simulate_hybrid or cores < 2:
            return

        def apply(n: int) -> None:
            torch.set_num_threads(n)
            native.set_threads(n)

        # process-wide settings: close() puts back what was there (the probe, another engine read them)
        self._threads_before = (torch.get_num_threads(), native.threads_setting())
        self.generator.threads = ThreadChooser.from_free_cores(cores, apply)

    def _restore_threads(self) -> None:
        from engine.kernels import native

        if self.generator.threads is not None:
            torch.set_num_threads(self._threads_before[0])
            native.set_threads(self._threads_before[1])
            self.generator.threads = None

    def _setup_graphs(self) -> None:
        """Decode steps as CUDA graphs when the config asks and the KV and experts allow; re-run after
        a policy switch (a graph holds the addresses of the KV it was captured with)."""
        from engine.runtime import cpu_decode
        from engine.runtime.decode_graph import DecodeGraphs, unsupported_reason

        p, g = self.parts, self.generator
        self._drop_graphs()
        reason = "off in the config" if not self.config.cuda_graphs else \
            unsupported_reason(p.kv, p.experts, p.device, self.config.max_batch)
        self.graphs_off = reason
        if reason is None:
            g.graphs = DecodeGraphs(p.model, p.kv, p.experts, p.device, self.config.max_batch)
        elif p.device.type == "cpu":  # the CPU's counterpart, a native call per layer, in the same place
            self.cpu_decode_off = cpu_decode.unsupported_reason(p.model, p.kv, p.device)
            if self.cpu_decode_off is None:
                g.graphs = cpu_decode.CPUDecodeSteps(p.model, p.kv)

    def _drop_graphs(self) -> None:
        """Before the KV or experts they were captured over go (and to free their memory pool)."""
        if self.generator.graphs is not None:
            self.generator.graphs.close()
            self.generator.graphs = None

    @property
    def tokenizer(self):
        return self.parts.tokenizer

    @property
    def max_context(self) -> int:
        return self.parts.max_context

    def info(self) -> dict:
        p = self.parts
        return {"backend": self.name, "model": self.config.model, "family": p.family, "layers": p.args.n_layers,
                "experts": p.args.n_experts or None, "top_k": p.args.top_k or None,
                "device": str(p.device), "dtype": str(p.dtype).removeprefix("torch."),
                "weight_types": self.weight_types(),
                "max_context": p.max_context, "kv_policy": p.kv.policy,
                "expert_policy": p.experts.policy if p.experts else None,
                "load_s": p.load_s, "vocab_size": p.args.vocab_size,
                "plan": self.plan.to_dict() | {"summary": self.plan.summary()} if self.plan else None,
                "cuda_graphs": {"off": self.graphs_off} if self.graphs_off else self.generator.graphs.telemetry(),
                **({"cpu_decode": self.generator.graphs.telemetry() if self.cpu_decode_off is None
                    else {"off": self.cpu_decode_off}} if p.device.type == "cpu" else {}),
                **(self.generator.threads.telemetry() if self.generator.threads else {})}

    def weight_types(self) -> list[str] | None:
        """The GGUF block types the weights are held in, dense layers and experts (None: all tensors)."""
        types = {m.qweight.qtype.name for m in self.parts.model.modules() if hasattr(m, "qweight")}
        if self.parts.experts is not None:
            types.update(self.parts.experts.block_types())
        return sorted(types) or None

    def _need_tokenizer(self):
        if self.parts.tokenizer is None:
            raise ConfigError(f"{self.config.model} has no tokenizer files", "pass token ids (generate_ids) or add a tokenizer")
        return self.parts.tokenizer

    def tokenize(self, text: str) -> list[int]:
        return self._need_tokenizer().encode(text, add_special_tokens=False)

    def render(self, messages: list[dict]) -> list[int]:
        return render_chat(self._need_tokenizer(), messages)

    def prompt_ids(self, req: GenerationRequest) -> list[int]:
        return prompt_ids_of(req, self.tokenize, self.render)

    def generate_batch(self, requests: list[GenerationRequest], on_text: Callable[[int, str], None] | None,
                       stop_event: threading.Event | None) -> list[GenerationResult]:
        runs = []
        tok = self.parts.tokenizer
        eos = eos_ids(tok, self.parts.args.eos_token_ids)
        try:
            for i, req in enumerate(requests):
                stream = TextStream.for_request(tok, req) if tok is not None else None
                run = SeqRun(self.prompt_ids(req), req.max_new_tokens, Sampler(req.sampling()),
                             set() if req.ignore_eos else eos, stream,
                             (lambda t, i=i: on_text(i, t)) if on_text else None)
                run.session = self.generator.session(req.session_id)
                runs.append(run)
            try:
                timer = self.generator.run(runs, stop_event)
            except TandemError:
                raise
            except Exception as e:  # a kernel or the device failed mid-step: say so, keep the engine usable
                raise compute_failure(e, self.parts.device) from e
        finally:  # throwaway sequences give their blocks back, whatever happened
            for req, run in zip(requests, runs):
                if req.session_id is None and run.session is not None:
                    self.parts.kv.free(run.session.seq_id)
                elif req.session_id is not None and run.finish_reason is None:
                    self.generator.end_session(req.session_id)  # failed mid-way: its KV is suspect
        return [GenerationResult(
            text=r.stream.text if r.stream else "", reasoning=r.stream.reasoning if r.stream else "",
            token_ids=r.generated, finish_reason=r.finish_reason,
            prompt_tokens=len(r.prompt), prefilled_tokens=r.prefilled, completion_tokens=len(r.generated),
            ttft_s=timer.ttft_s, prefill_tok_s=timer.prefill_tok_s, decode_tok_s=timer.decode_tok_s)
            for r in runs]

    def end_session(self, session_id: str) -> None:
        self.generator.end_session(session_id)

    def set_expert_policy(self, policy: str) -> None:
        from dataclasses import replace

        from engine.runtime.expert_placement import switch_expert_policy

        self._drop_graphs()
        switch_expert_policy(self.parts, replace(self.config, expert_policy=policy), policy)
        self.config.expert_policy = policy  # the engine's config describes what runs
        self._setup_graphs()

    def set_kv_policy(self, policy: str) -> None:
        """Replace the KV backend by one of another policy (benchmarks compare policies this way).
        Every session's KV goes with the old backend; an offloaded expert cache is re-sized for the
        VRAM the new KV leaves, as at load."""
        from dataclasses import replace

        from engine.runtime.kv_setup import build_kv
        from engine.runtime.loading import check_policies

        check_policies(policy, self.config.expert_policy)
        p = self.parts
        for key in list(self.generator.sessions):
            self.generator.end_session(key)
        self._drop_graphs()
        if hasattr(p.kv, "close"):
            p.kv.close()
        p.kv = self.generator.kv = None
        gc.collect()
        if p.device.type == "cuda":
            torch.cuda.empty_cache()
        config = replace(self.config, kv_policy=policy)
        window = p.args.sliding_window if p.args.sliding_window and p.args.sliding_window < p.max_context else None
        p.kv = self.generator.kv = build_kv(config, p.args, p.model, p.experts, p.device, p.dtype, p.max_context,
                                           sliding_window=window, profile=self.profile)
        self.config.kv_policy = policy
        if p.experts is not None and p.experts.policy != "resident":
            self.set_expert_policy(p.experts.policy)  # re-size the slot pool after the new KV
        self._setup_graphs()

    def stats(self) -> StatsSnapshot:
        p = self.parts
        budget = int(self.config.vram_budget_gb * 2**30) if self.config.vram_budget_gb else None
        experts_tel = p.experts.telemetry() if p.experts else None
        weights = p.weights_bytes + (experts_tel or {}).get("bytes", 0)
        return self.telemetry.snapshot(device=p.device, weights_bytes=weights, kv_tel=p.kv.telemetry(),
                                       experts_tel=experts_tel, vram_budget_bytes=budget, model_info=self.info(),
                                       profile=self.profile.name if self.profile else None)

    def close(self) -> None:
        """Free the KV, the weights and cached GPU memory, in reverse order of creation."""
        if self.parts is None:
            return
        for key in list(self.generator.sessions):
            self.generator.end_session(key)
        self._restore_threads()  # set up last: put back first
        self._drop_graphs()  # they point into the KV and the experts
        if hasattr(self.parts.experts, "close"):  # offloaded experts: copies done, worker stopped, store unpinned
            self.parts.experts.close()
        if hasattr(self.parts.kv, "close"):  # hybrid KV: copies done, CPU-side thread stopped, host regions unpinned
            self.parts.kv.close()
        self.generator = self.parts = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _plan_or_none(config, profile):
    """The placement plan, or None when the planner cannot size this model (a planner fault must not
    cost the user a model that loads: `auto` then means the resident defaults)."""
    try:
        return placement_plan(config, profile)
    except TandemError:
        raise  # the model file itself is unreadable: loading would say the same
    except Exception as e:
        log.warning("no placement plan for %s (%s: %s)", config.model, type(e).__name__, e)
        return None


def compute_failure(e: Exception, device: torch.device) -> TandemError:
    """The user's view of an exception from a generation step. The generator has already dropped the
    failed step's KV, so the engine stays usable; the chat's text so far is the app's to keep."""
    log.debug("generation step failed", exc_info=e)  # the traceback is for the log (debug), never the user
    detail = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else 'no message'}"
    if isinstance(e, torch.OutOfMemoryError):
        return OutOfMemoryError(f"memory ran out while generating ({detail})",
                                "the reply was stopped; lower max_context, max_batch or the expert cache "
                                "(vram_budget_gb), or close other programs, then try again")
    if "CUDA" in str(e) or type(e).__name__ == "AcceleratorError":  # the device side, whatever runs the host
        return ComputeError(f"the GPU reported an error while generating ({detail})",
                            "the reply was stopped and your chat is kept; try again. If it happens again, "
                            "restart Tandem (a GPU fault can leave the device unusable) and check the driver")
    if isinstance(e, (LookupError, AssertionError, AttributeError, TypeError, NameError)):
        # Tandem's own bookkeeping, not a kernel: switching kernels would not help, so the remedy does
        # not offer TANDEM_NATIVE=0 (a KeyError from the expert cache's accounting is such a fault)
        return ComputeError(f"an internal error stopped the reply ({detail})",
                            "the reply was stopped and your chat is kept; try again. If it happens again, "
                            "restart Tandem and report the log (it holds the traceback)")
    return ComputeError(f"a compute kernel failed while generating ({detail})",
                        "the reply was stopped and your chat is kept; try again. If it happens again, restart "
                        "Tandem with TANDEM_NATIVE=0 (the torch kernels) and report the log")
