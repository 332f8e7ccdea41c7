"""The suite record as a markdown table: one line per row of every cell, skipped cells with their reason."""

from __future__ import annotations


def fmt(x) -> str:
    if x is None:
        return "–"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def machine_line(record: dict) -> str:
    m = record.get("machine", {})
    gpu = m.get("gpu") or "no GPU"
    load = record.get("load_average") or {}
    shared = (f"; 1-min load average {load.get('before')} before, {load.get('after')} after (shared machine)"
              if load else "")
    return (f"{m.get('cpu', '?')}, {m.get('logical_cores', '?')} cores, {m.get('ram_gib', '?')} GiB, {gpu}; "
            f"Python {m.get('python', '?')}, torch {m.get('torch', '?')}{shared}")


def rows(record: dict) -> list[dict]:
    """Flat table rows: every measured row, then every skipped or failed cell."""
    out = []
    for cell in record["cells"]:
        if cell["status"] != "ran":
            out.append({"cell": cell["id"], "status": cell["status"], "reason": cell["reason"],
                        "target": cell["target"], "command": cell["command"]})
            continue
        for r in cell["rows"]:
            for name, ratio in r["ratio"].items():
                out.append({"cell": cell["id"], "status": "ran", "metric": r["metric"], "condition": r["condition"],
                            "routing": r.get("routing"), "system": name, "tandem": r["systems"][name],
                            "peer_name": r["peer"], "peer_kind": r["peer_kind"], "peer": r["systems"][r["peer"]],
                            "ratio": ratio, "ab": r.get("ab"), "target": r.get("target") or cell["target"],
                            "command": cell["command"]})
    return out


def _spread(s: dict) -> str:
    return f"{fmt(s['min'])}–{fmt(s['max'])}" if s.get("min") is not None else "–"


def markdown(record: dict, record_path: str | None = None) -> str:
    trees = record.get("trees", [])
    def changed(n: int) -> str:  # uncommitted edits in the tree that ran (others' work in progress)
        return f", {n} uncommitted file{'s' * (n != 1)}" if n else ""

    commits = ", ".join(f"{t['commit'][:8]} ({t['label']}{changed(t.get('files_changed') or 0)})" for t in trees)
    ab = len(trees) > 1
    lines = [f"Machine: {machine_line(record)}.",
             f"Date: {record['date']}. Commit: {commits}. Rounds per cell: {record['rounds']} (systems taking turns, "
             "the order reversed every other round); figures are medians, spread is the rounds' min–max.",
             f"Command: `{record['command']}`" + (f"; record: `{record_path}`." if record_path else "."), "",
             "| cell | measure | Tandem | peer or bound | Tandem / peer | spread Tandem; peer | "
             + ("A/B (this / against) | " if ab else "") + "target |",
             "| --- | --- | --- | --- | --- | --- | " + ("--- | " if ab else "") + "--- |"]
    for r in rows(record):
        if r["status"] != "ran":
            blank = "– | " * (5 if ab else 4)
            lines.append(f"| {r['cell']} | {r['status']}: {r['reason']} | {blank}{r['target']} |")
            continue
        routing = f", {r['routing']} routing" if r.get("routing") else ""
        who = f" ({r['system']})" if ab else ""
        peer = f"{fmt(r['peer']['median'])} {r['peer_name']}" + (" (bound)" if r["peer_kind"] == "bound" else "")
        # the A/B ratio once per measure, on this tree's line
        this_line = r.get("ab") and r["system"] == r["ab"]["this"]
        ab_cell = (f"{fmt(r['ab']['median'])} | " if this_line else "– | ") if ab else ""
        lines.append(f"| {r['cell']} | {r['metric']}{who}: {r['condition']}{routing} | {fmt(r['tandem']['median'])} | "
                     f"{peer} | {fmt(r['ratio']['median'])} | {_spread(r['tandem'])}; {_spread(r['peer'])} | "
                     f"{ab_cell}{r['target']} |")
    lines.append("")
    lines.append("Each cell re-runs alone with the command `tandem bench suite --cells CELL` (add `--quick` for the "
                 "shorter CPU runs).")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m engine.bench.suite_table RECORD.json: the table of a saved record
    import json
    import sys

    with open(sys.argv[1]) as f:
        print(markdown(json.load(f), record_path=sys.argv[1]), end="")
