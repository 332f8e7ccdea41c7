"""The engine on its own thread: an EngineWorker (QObject) moved to a QThread, driven by EngineHost
(app/engine_host.py).

Every Engine call — load, generate, render/tokenize for counting, stats — runs on the worker thread,
so the GUI thread never waits on the engine and the tokenizer is never used from two threads at once.
The GUI talks to the worker only through queued signals; the one exception is stop, which sets a
`threading.Event` that the engine checks between steps.

Stats sampling (the live panels): while a reply streams, the worker itself takes a snapshot from
inside the token callback at most every STATS_INTERVAL_S — it is between two decode steps there, so
the numbers are consistent and no second thread touches the engine. While idle, the host's timer
asks the worker for one snapshot at a time (never queueing more than one request), so an idle engine
is sampled at the host's IDLE_SAMPLE_HZ and a busy one never has requests piling up behind the
generation.
(This relies on `Engine.stats()` not taking the generation lock, as the engine's telemetry promises:
"readers call Engine.stats() whenever they like".)

Tokens are batched: the callback joins text and emits at most every TOKEN_BATCH_S, so a fast
engine cannot flood the GUI's event queue; the last batch is flushed before `finished`.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app.context import plan_context
from app.model_files import ModelFileError, inspect_model, is_model_path
from app.model_kind import describe_model
from app.prefill_watch import STATS_INTERVAL_S, PrefillWatch

TOKEN_BATCH_S = 0.04


class LoadCancelled(Exception):
    pass


def _unexpected(e: BaseException) -> tuple[str, str]:
    traceback.print_exception(e, file=sys.stderr)
    return f"{type(e).__name__}: {e}", "this is a bug in Tandem; your chats are kept — try again or restart the app"


def preflight(config: dict) -> tuple[str, str] | None:
    """(what, remedy) when the model file or folder is unusable by its header alone, else None."""
    model = config.get("model")
    if config.get("backend") == "remote" or not is_model_path(model):
        return None
    try:
        inspect_model(model)
    except ModelFileError as e:
        return f"{model} cannot be used: {e.what}", e.remedy
    return None


class EngineWorker(QObject):
    load_progress = Signal(str, float)
    loaded = Signal(dict)  # Engine.info() plus max_context and the built-in model's description
    load_failed = Signal(str, str)  # what, remedy (no model is loaded now)
    switch_failed = Signal(str, str)  # what, remedy: another model was asked for; the previous one stays
    tokens = Signal(str, str)  # job id, answer text since the last batch
    reasoning = Signal(str, str)  # job id, reasoning text since the last batch (a reasoning model's thinking)
    finished = Signal(str, dict)  # job id, GenerationResult fields (no token ids) plus wall_s
    failed = Signal(str, str, str)  # job id, what, remedy
    stats = Signal(dict)  # StatsSnapshot.to_dict() plus "t" (unix time)
    prefill_progress = Signal(str, int, int)  # job id, prompt tokens in the KV so far, prompt tokens
    planned = Signal(int, object)  # request id, ContextPlan (or None when no model is loaded)
    counted = Signal(int, object)  # request id, token count (or None)
    closed = Signal()

    def __init__(self, engine=None):
        super().__init__()
        self.engine = engine
        self.config: dict | None = None  # what the loaded engine was made from (None: handed in)
        self.owns_engine = engine is None  # an engine handed in belongs to its giver, who closes it
        self.cancel_load = threading.Event()  # set on quit: a load in progress gives up at its next step

    # -- model ----------------------------------------------------------------------------------
    @Slot(dict)
    def load(self, config: dict) -> None:
        """Load `config`'s model. A switch that fails keeps the model that was working: a damaged file is
        found from its header before anything is unloaded; a load that fails later puts the previous
        model back. Either way `switch_failed` says why, then `loaded` announces the model in use."""
        try:
            from engine.api import builtin_models
        except ImportError as e:
            self.load_failed.emit(f"the engine cannot be imported ({e})", "reinstall Tandem: pip install -e .")
            return
        previous, previous_config, owned = self.engine, self.config, self.owns_engine
        if previous is not None:
            problem = preflight(config)
            if problem is not None:
                self.switch_failed.emit(*problem)
                self.loaded.emit(self._info(builtin_models()))
                return
            if owned:  # one model in memory at a time: a GPU rarely holds two
                previous.close()
            self.engine = None
        engine, failure = self._open(config)
        if engine is not None:
            self.engine, self.owns_engine, self.config = engine, True, dict(config)
            self.loaded.emit(self._info(builtin_models()))
            return
        if previous is None or failure[0] == "loading was cancelled":
            self.load_failed.emit(*failure)
            return
        if not owned:  # an engine handed in was never closed: it is still whole
            self.engine = previous
        else:
            self.engine, again = self._open(previous_config)
            if self.engine is None:
                self.load_failed.emit(failure[0], f"{failure[1]} (the previous model could not be loaded again "
                                                  f"either: {again[0]})".strip())
                return
        self.switch_failed.emit(*failure)
        self.loaded.emit(self._info(builtin_models()))

    def _open(self, config: dict):
        """(Engine, None) or (None, (what, remedy))."""
        from engine.api import Engine, EngineConfig, TandemError

        def progress(step: str, frac: float) -> None:
            if self.cancel_load.is_set():
                raise LoadCancelled()
            self.load_progress.emit(step, frac)

        try:
            engine = Engine(EngineConfig(**config), progress=progress)
        except LoadCancelled:
            return None, ("loading was cancelled", "")
        except TandemError as e:
            return None, (e.what, e.remedy)
        except Exception as e:  # noqa: BLE001 — a failed load must leave the app usable
            return None, _unexpected(e)
        if engine.tokenizer is None:  # weights only: fine for token-id tools, but a chat needs text
            engine.close()
            return None, (f"{config.get('model')} has no tokenizer, so chat text cannot be turned into tokens",
                          "add the model's tokenizer.json (and tokenizer_config.json) next to its weights, or "
                          "choose a model that includes one")
        return engine, None

    @Slot()
    def adopt(self) -> None:
        """Announce an engine handed in at construction (already loaded)."""
        from engine.api import builtin_models

        self.loaded.emit(self._info(builtin_models()))

    def _info(self, builtins: list[dict]) -> dict:
        info = dict(self.engine.info())
        info["max_context"] = self.engine.max_context
        info["description"] = next((b["description"] for b in builtins if b["name"] == info["model"]), None)
        info["kind"] = describe_model(info["model"]) if info.get("backend") != "remote" else None
        return info

    def _drop_engine(self) -> None:
        if self.engine is not None and self.owns_engine:
            self.engine.close()
        self.engine = None

    # -- generation -----------------------------------------------------------------------------
    @Slot(str, dict, object)
    def generate(self, job_id: str, request: dict, stop_event: threading.Event) -> None:
        from engine.api import GenerationRequest, TandemError

        if self.engine is None:
            self.failed.emit(job_id, "no model is loaded", "load a model (Settings → Model and memory)")
            return
        buf: list[str] = []  # answer and reasoning pieces in the order they came
        last = {"tokens": time.monotonic(), "stats": time.monotonic()}
        first_text = threading.Event()
        watcher = self._watch_prefill(job_id, first_text)

        def on_text(text: str) -> None:
            first_text.set()
            buf.append(text)
            now = time.monotonic()
            if now - last["tokens"] >= TOKEN_BATCH_S:
                self._flush(job_id, buf)
                last["tokens"] = now
            if now - last["stats"] >= STATS_INTERVAL_S:
                self._emit_stats()
                last["stats"] = now

        t0 = time.monotonic()
        try:
            result = self.engine.generate(GenerationRequest(**request), on_text=on_text, stop_event=stop_event)
        except TandemError as e:
            self._flush(job_id, buf)
            self.failed.emit(job_id, e.what, e.remedy)
            return
        except Exception as e:  # noqa: BLE001
            self._flush(job_id, buf)
            self.failed.emit(job_id, *_unexpected(e))
            return
        finally:
            first_text.set()
            watcher.finish()
        self._flush(job_id, buf)
        fields = {k: getattr(result, k) for k in ("text", "reasoning", "finish_reason", "prompt_tokens",
                                                  "prefilled_tokens", "completion_tokens", "ttft_s", "prefill_tok_s",
                                                  "decode_tok_s")}
        fields["wall_s"] = time.monotonic() - t0
        self._emit_stats()
        self.finished.emit(job_id, fields)

    def _watch_prefill(self, job_id: str, first_text: threading.Event) -> "PrefillWatch":
        """Reading a long prompt takes a while before the first token: report how far it got."""
        watch = PrefillWatch(self, job_id, first_text)
        watch.start()
        return watch

    def _flush(self, job_id: str, buf: list[str]) -> None:
        """One signal per run of one kind, in order: reasoning (Reasoning pieces) comes before its answer."""
        from engine.api import Reasoning

        run: list[str] = []
        for piece in buf:
            if run and isinstance(piece, Reasoning) != isinstance(run[0], Reasoning):
                self._emit_run(job_id, run)
                run = []
            run.append(piece)
        if run:
            self._emit_run(job_id, run)
        buf.clear()

    def _emit_run(self, job_id: str, run: list[str]) -> None:
        from engine.api import Reasoning

        (self.reasoning if isinstance(run[0], Reasoning) else self.tokens).emit(job_id, "".join(run))

    # -- counting and stats ---------------------------------------------------------------------
    @Slot(int, dict)
    def plan(self, request_id: int, args: dict) -> None:
        if self.engine is None:
            self.planned.emit(request_id, None)
            return
        try:
            plan = plan_context(self.engine.render, max_context=self.engine.max_context, **args)
        except Exception as e:  # noqa: BLE001 — a counting failure must not take the app down
            _unexpected(e)
            plan = None
        self.planned.emit(request_id, plan)

    @Slot(int, str)
    def count(self, request_id: int, text: str) -> None:
        n = None
        if self.engine is not None:
            try:
                n = len(self.engine.tokenize(text))
            except Exception as e:  # noqa: BLE001
                _unexpected(e)
        self.counted.emit(request_id, n)

    @Slot(str)
    def end_session(self, session_id: str) -> None:
        if self.engine is not None:
            self.engine.end_session(session_id)

    @Slot()
    def sample(self) -> None:
        self._emit_stats()

    def _emit_stats(self) -> None:
        if self.engine is None:
            return
        try:
            snap = self.engine.stats().to_dict()
        except Exception as e:  # noqa: BLE001 — a panel must never take a reply down with it
            _unexpected(e)
            return
        snap["t"] = time.time()
        self.stats.emit(snap)

    # -- teardown -------------------------------------------------------------------------------
    @Slot()
    def close(self) -> None:
        self._drop_engine()
        self.closed.emit()
        QThread.currentThread().quit()
