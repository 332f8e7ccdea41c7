"""`tandem generate` on a synthetic model: token ids in and out, a batch, stats with the load time."""

import json
import subprocess
import sys


def test_batch_of_random_prompts_writes_load_time_and_speed(tmp_path):
    stats = tmp_path / "stats.json"
    p = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "--model", "synthetic:olmoe-1b-7b-L1",
                        "--device", "cpu", "--random-prompt", "12", "--max-new-tokens", "4", "--greedy",
                        "--batch", "2", "--max-batch", "2", "--max-context", "64", "--stats-json", str(stats)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.split("\n")[:2]
    rows = [[int(t) for t in line.split()] for line in lines]
    assert [len(r) for r in rows] == [4, 4] and rows[0] != rows[1]  # two different prompts
    data = json.loads(stats.read_text())
    assert data["model"]["load_s"] > 0 and data["model"]["dtype"] == "bfloat16"
    assert data["speed"]["decode_tok_s"] > 0
    assert "loaded in" in p.stderr


def test_prompt_ids_without_tokenizer():
    p = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "--model", "synthetic:olmoe-1b-7b-L1",
                        "--device", "cpu", "--prompt-ids", "5,6,7", "--max-new-tokens", "3", "--greedy", "--quiet",
                        "--max-batch", "1", "--max-context", "32"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert len(p.stdout.split()) == 3 and p.stderr == ""
