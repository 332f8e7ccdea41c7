"""`tandem …` as a user runs it."""

import json
import subprocess
import sys


def tandem(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_generate_answers_paris(tmp_path):
    stats = tmp_path / "stats.json"
    p = tandem("generate", "--model", "builtin:smollm2-135m", "--prompt", "What is the capital of France?",
               "--max-new-tokens", "24", "--greedy", "--stats-json", str(stats))
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout
    assert "ready" in p.stderr and "ready" not in p.stdout  # logs on stderr only
    assert json.loads(stats.read_text())["speed"]["decode_tok_s"] > 0


def test_models_lists_builtins():
    p = tandem("models")
    assert p.returncode == 0
    assert "builtin:smollm2-135m " in p.stdout and "builtin:smollm2-135m-moe" in p.stdout


def test_bad_model_gives_clear_error_without_traceback(tmp_path):
    p = tandem("generate", "--model", str(tmp_path / "missing.gguf"), "--prompt", "hi")
    assert p.returncode == 2
    assert "model not found" in p.stderr and "what to do" in p.stderr
    assert "Traceback" not in p.stderr


def test_generate_and_chat_hold_the_kv_of_their_own_sequences():
    """A one-shot command plans the KV of the sequences it runs, not of four chats (which, under a VRAM
    budget, can push experts out of VRAM); --max-batch still says otherwise; plan and serve leave it to the
    plan (None)."""
    from engine.cli import _config, build_parser

    parser = build_parser()
    assert _config(parser.parse_args(["generate", "--prompt", "x"])).max_batch == 1
    assert _config(parser.parse_args(["generate", "--random-prompt", "8", "--batch", "3"])).max_batch == 3
    assert _config(parser.parse_args(["generate", "--prompt", "x", "--max-batch", "6"])).max_batch == 6
    assert _config(parser.parse_args(["chat"])).max_batch == 1
    assert _config(parser.parse_args(["plan"])).max_batch is None  # the plan chooses, as for the app
    assert _config(parser.parse_args(["serve"])).max_batch is None
    assert _config(parser.parse_args(["serve", "--max-batch", "2"])).max_batch == 2
    usage = parser._subparsers._group_actions[0].choices["generate"].format_help()
    assert "the sequences this command runs" in " ".join(usage.split())
