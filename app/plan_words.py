"""The engine's placement plan in words: a badge per model in the model list, a line on the model page
and in the memory panel. The plan itself comes from engine.api.plan_placement (headers only, no
weights read); this module only words it, so the app says what the engine will do, not a guess."""

from __future__ import annotations

import logging

log = logging.getLogger("tandem.app")


def plan_for(config: dict) -> dict | None:
    """The plan of an EngineConfig's fields, or None when the model cannot be planned (a file the
    engine cannot read says so when it is loaded; a badge is no place for that). Call off the GUI
    thread: the first call imports the engine."""
    if config.get("backend") == "remote" or not config.get("model"):
        return None
    from engine.api import EngineConfig, plan_placement

    try:
        return plan_placement(EngineConfig(**{k: v for k, v in config.items() if v is not None}))
    except Exception as e:  # noqa: BLE001 - any failure only costs the badge
        log.debug("no plan for %s: %s", config.get("model"), e)
        return None


def _speed(plan: dict) -> str:
    tok_s = plan.get("decode_tok_s")
    return f"about {tok_s:.0f} tok/s" if tok_s else ""


def fit_badge(plan: dict | None) -> str:
    """A few words for the model list: "fits on the GPU", "experts in RAM, about 60 tok/s", …"""
    if plan is None:
        return ""
    if not plan["fits"]:
        return "too large for this machine"
    if plan["device"] == "cpu":
        where = "runs on the CPU"
    elif plan["kv_policy"] == "resident" and plan["expert_policy"] == "resident":
        return "fits on the GPU"
    elif plan["expert_policy"] != "resident":
        where = "experts in RAM"
    else:
        where = "KV spills to RAM"
    return ", ".join(s for s in (where, _speed(plan)) if s)


def plan_line(plan: dict | None) -> str:
    """One sentence for the model page and the memory panel."""
    if plan is None:
        return ""
    if not plan["fits"]:
        return f"Does not fit: {plan['problem']}. To run it, {plan['remedy']}."
    return plan["summary"][0].upper() + plan["summary"][1:] + "."
