"""Crash safety: the real app killed with SIGKILL at random moments of a reply, 20 times on the same
data; a calibration killed midway. After every kill the chat file passes PRAGMA integrity_check,
every message saved before the reply is intact, the next start opens the same chat, and a reply
cut off mid-stream keeps its text (as "interrupted"). The test counts the kills that landed
mid-stream and requires enough of them. The moments are random on every run; their seed is printed
(and named in every failure) so a failing run can be replayed with TANDEM_CRASH_SEED=<seed>. A killed
calibration leaves the previous profile in use."""

import json
import os
import random
import sqlite3
import subprocess
import time
from pathlib import Path

from helpers import kill_hard
from reliability_helpers import PYTHON, ROOT, subprocess_env

from app.conversation import DB_FLUSH_S
from app.db import ChatStore
from app.paths import DB_NAME

KILLS = 20


def moment_seed() -> int:
    """TANDEM_CRASH_SEED to replay a run; otherwise a fresh seed, printed (pytest shows it on failure)."""
    seed = int(os.environ.get("TANDEM_CRASH_SEED") or random.SystemRandom().randrange(2**32))
    print(f"kill moments: TANDEM_CRASH_SEED={seed}")
    return seed
DRIVER = Path(__file__).with_name("crash_driver.py")


def start_app(data: Path, model: Path, text: str) -> subprocess.Popen:
    return subprocess.Popen([PYTHON, str(DRIVER), text], env=subprocess_env(data, TANDEM_TEST_MODEL=model),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)


def read_until(proc: subprocess.Popen, prefix: str, timeout_s: float = 90) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.strip())
        if line.startswith(prefix):
            return lines
    raise AssertionError(f"no {prefix} from the app: {lines}")


def saved_rows(db: Path) -> list[tuple]:
    """Every message as the next start sees it (a reply cut off by the kill becomes 'interrupted')."""
    store = ChatStore(db)
    rows = store.conn.execute("SELECT id, chat_id, role, content, status FROM messages ORDER BY id").fetchall()
    store.close()
    return [tuple(r) for r in rows]


def test_kill_9_at_random_moments_of_a_reply(tmp_path, chat_model):
    """Even kills strike anywhere after the message is sent (from the first writes on); odd kills
    strike once text is streaming and at least one flush of it is due (DB_FLUSH_S), where the
    interrupted reply must keep its text."""
    seed = moment_seed()
    data, rng = tmp_path / "data", random.Random(seed)
    db = data / DB_NAME
    before: list[tuple] = []
    chat_id = None
    mid_stream = 0  # kills that landed while the reply was streaming (text seen, not finished)
    for i in range(KILLS):
        replay = f"kill {i}, TANDEM_CRASH_SEED={seed}"
        proc = start_app(data, chat_model, f"Question number {i}: tell me a long story.")
        opened, seen = [], []
        into_stream = i % 2 == 1

        def until_the_moment():
            opened.extend(read_until(proc, "OPENED")[-1].split())
            if chat_id is not None:  # the restart opens the chat it was killed in, with every message
                assert opened[1] == chat_id and int(opened[2]) == len(before), (replay, opened)
            seen.extend(read_until(proc, "SENT"))
            if into_stream:
                seen.extend(read_until(proc, "STREAMING"))
                time.sleep(rng.uniform(DB_FLUSH_S + 0.3, 1.5))  # past the first flush of the streamed text
            else:
                time.sleep(rng.uniform(0.0, 1.5))  # anywhere from the first writes to well into the stream

        kill_hard(proc, until_the_moment)
        seen.extend(line.strip() for line in proc.stdout.read().splitlines())  # printed before the kill
        streaming = "STREAMING" in seen
        finished = any(line.startswith("FINISHED") for line in seen)
        mid_stream += streaming and not finished
        chat_id = opened[1]
        conn = sqlite3.connect(db)  # as the next start opens it, WAL and all
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok", replay
        conn.close()
        after = saved_rows(db)
        assert after[:len(before)] == before, f"{replay} changed messages saved before the reply"
        new = after[len(before):]
        assert len(new) <= 2 and all(r[1] == chat_id for r in new), (replay, new)
        if new:
            assert new[0][2:4] == ("user", f"Question number {i}: tell me a long story."), replay
        if len(new) == 2:
            assert new[1][2] == "assistant" and new[1][4] in ("interrupted", "done"), (replay, new[1])
        if into_stream and streaming and not finished:  # cut off mid-stream after a flush: its text is kept
            # ("done" too: the kill can fall between the reply's last save and the FINISHED line it prints)
            assert len(new) == 2 and new[1][4] in ("interrupted", "done") and new[1][3].strip(), (replay, new)
        before = after
    assert len(before) >= KILLS  # the user messages went in
    assert mid_stream >= KILLS // 4, f"only {mid_stream} of {KILLS} kills landed mid-stream (seed {seed})"


def calibrate_cli(path: Path, model: Path) -> subprocess.Popen:
    return subprocess.Popen([PYTHON, "-m", "engine.cli", "calibrate", "--quick", "--profile-path", str(path),
                             "--model", str(model)], env=subprocess_env(), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _read_progress_lines(proc: subprocess.Popen, n: int) -> None:
    seen = 0
    while seen < n:
        line = proc.stderr.readline()
        if not line:
            return  # it ended first: the caller finds out from the profile
        seen += line.startswith("[")


def test_kill_9_during_calibration_keeps_the_previous_profile(tmp_path, chat_model):
    from engine.api import load_profile

    profile = tmp_path / "profile" / "machine.json"
    first = calibrate_cli(profile, chat_model)  # the profile in use; also counts the measuring steps
    _, err = first.communicate(timeout=240)
    assert first.returncode == 0, err
    steps = sum(line.startswith("[") for line in err.splitlines())  # one progress line per measuring step
    assert steps >= 3, err
    assert profile.stat().st_mode & 0o077 == 0  # owner-only
    original = profile.read_bytes()
    rng = random.Random(moment_seed())
    alive_when_killed = 0
    for _ in range(3):
        proc = calibrate_cli(profile, chat_model)
        # after a random progress line that leaves at least two steps to measure: inside the measuring
        # whatever the machine's speed now (a moment timed from the first run misses on a busy machine)
        kill_hard(proc, lambda: _read_progress_lines(proc, rng.randint(1, steps - 2)))
        now = profile.read_bytes()
        if proc.returncode == -9 and now == original:
            alive_when_killed += 1
        else:  # it wrote its profile before the kill landed: then the profile is the new one, whole —
            # the strict load below would refuse a torn file
            original = now
        loaded = load_profile(str(profile), strict=True)
        assert loaded is not None and loaded["created_utc"] == json.loads(original)["created_utc"]
    assert alive_when_killed >= 2, f"only {alive_when_killed} of 3 calibrations were still running when killed"
