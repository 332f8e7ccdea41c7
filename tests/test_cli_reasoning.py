"""`tandem generate` on a harmony model (a tiny gpt-oss, its sampler scripted to write a harmony
reply): the reasoning and the answer are printed apart, headed, with no channel markup."""

import pytest

pytest.importorskip("transformers").GptOssConfig  # noqa: B018 — this transformers has gpt-oss

from harmony_helpers import REPLY, harmony_tokenizer, script_replies, tiny_gpt_oss_folder

from engine import cli


def test_generate_prints_reasoning_then_answer_marked_apart(tmp_path, monkeypatch, capsys):
    folder = tiny_gpt_oss_folder(tmp_path / "m")
    script_replies(monkeypatch, REPLY, harmony_tokenizer())
    rc = cli.main(["generate", "--model", str(folder), "--backend", "tandem", "--device", "cpu", "--dtype", "float32",
                   "--prompt", "Hi", "--max-new-tokens", "200", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out == "[reasoning]\nThe user greets; answer briefly.\n[answer]\nHello there!\n"


def test_a_plain_reply_prints_without_headings(capsys):
    printer = cli.ReplyPrinter()
    for piece in ("Just ", "text."):
        printer(piece)
    assert capsys.readouterr().out == "Just text."
