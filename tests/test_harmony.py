"""gpt-oss's harmony replies split into reasoning and answer: the streaming parser on pieces of any
size, and the text stream over a real tokenizer whose special tokens mark the channels."""

import pytest
from harmony_helpers import REPLY, harmony_tokenizer

from engine.runtime.harmony import HarmonyParser, Reasoning, uses_harmony
from engine.runtime.requests import GenerationRequest
from engine.runtime.textstream import TextStream

TWO_CHANNELS = ("<|channel|>analysis<|message|>Think: 2+2.<|end|>"
                "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>")


def parse_in_pieces(text: str, size: int) -> tuple[HarmonyParser, list[str]]:
    p = HarmonyParser()
    out = []
    for i in range(0, len(text), size):
        out += p.feed(text[i:i + size])
    return p, out + p.finish()


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_markers_split_across_pieces_are_still_markers(size):
    p, out = parse_in_pieces(TWO_CHANNELS, size)
    assert p.reasoning == "Think: 2+2." and p.answer == "It is 4." and p.done
    assert "".join(x for x in out if isinstance(x, Reasoning)) == "Think: 2+2."
    assert "".join(x for x in out if not isinstance(x, Reasoning)) == "It is 4."
    assert not any("<|" in x or "|>" in x for x in out)
    kinds = [isinstance(x, Reasoning) for x in out]
    assert kinds == sorted(kinds, reverse=True)  # all the reasoning came before the answer


def test_commentary_is_reasoning_and_a_tool_call_ends_the_reply():
    text = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
            "to=functions.weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}<|call|>"
            "<|start|>assistant<|channel|>final<|message|>never seen")
    p, out = parse_in_pieces(text, 4)
    assert p.reasoning == "Need the weather.{\"city\": \"Oslo\"}" and p.answer == "" and p.done
    assert all(isinstance(x, Reasoning) for x in out)


def test_a_message_without_a_channel_is_the_answer():
    p, _ = parse_in_pieces("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|message|>Done.", 2)
    assert (p.reasoning, p.answer) == ("Hmm.", "Done.")


def test_nothing_after_return_is_taken():
    p = HarmonyParser()
    p.feed("<|channel|>final<|message|>Yes.<|return|>")
    assert p.feed("<|start|>assistant<|channel|>final<|message|>more") == [] and p.answer == "Yes."


def test_text_without_markup_is_the_answer():
    p, out = parse_in_pieces("Just an answer, <| not a marker.", 5)
    assert p.answer == "Just an answer, <| not a marker." and p.reasoning == "" and not p.done
    assert out == ["Just an answer, <| not a marker."] and not isinstance(out[0], Reasoning)


def test_a_reply_cut_off_mid_marker_keeps_its_text():
    p, _ = parse_in_pieces("<|channel|>final<|message|>Half <|ret", 3)
    assert p.answer == "Half <|ret" and not p.done


def test_only_harmony_templates_are_detected():
    class Plain:
        chat_template = "{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}"

    assert uses_harmony(harmony_tokenizer()) and not uses_harmony(Plain()) and not uses_harmony(object())


def test_stream_keeps_the_markers_a_harmony_tokenizer_would_drop():
    tok = harmony_tokenizer()
    ids = tok.encode(REPLY, add_special_tokens=False)
    stream = TextStream.for_request(tok, GenerationRequest(prompt="Hi"))
    pieces = [x for i in ids if not stream.stopped for x in stream.add(i)] + stream.finish()
    assert stream.reasoning == "The user greets; answer briefly." and stream.text == "Hello there!"
    assert "".join(x for x in pieces if not isinstance(x, Reasoning)) == "Hello there!"
    assert stream.stopped  # <|return|> ended it


def test_raw_requests_and_plain_models_stream_as_before():
    tok = harmony_tokenizer()
    ids = tok.encode("abc<|end|>def", add_special_tokens=False)
    raw = TextStream.for_request(tok, GenerationRequest(prompt="x", raw=True))
    out = [x for i in ids for x in raw.add(i)] + raw.finish()
    assert "".join(out) == "abcdef" == raw.text and raw.reasoning == "" and raw.parser is None
