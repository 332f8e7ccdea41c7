"""Incremental detokenisation with stop strings, on a real tokenizer."""

from engine.runtime.textstream import TextStream


def feed(stream, ids):
    return "".join(piece for i in ids for piece in stream.add(i)) + "".join(stream.finish())


def test_stream_reassembles_text(dense_engine):
    tok = dense_engine.tokenizer
    text = "Héllo wörld — 東京 🚀 done."
    ids = tok.encode(text, add_special_tokens=False)
    assert feed(TextStream(tok), ids) == tok.decode(ids)


def test_stop_string_across_tokens_is_never_emitted(dense_engine):
    tok = dense_engine.tokenizer
    ids = tok.encode("one two three END four five", add_special_tokens=False)
    s = TextStream(tok, ["END"])
    out = "".join(piece for i in ids if not s.stopped for piece in s.add(i)) + "".join(s.finish())
    assert s.stopped and out == "one two three " and "END" not in out
