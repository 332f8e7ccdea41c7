"""What a caller asks for and what it gets back: the same for every backend."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.runtime.sampling import SamplingParams


@dataclass
class GenerationRequest:
    messages: list[dict] | None = None  # [{"role": "user", "content": "…"}, …] through the chat template
    prompt: str | None = None  # one user message (or raw text when raw=True)
    prompt_ids: list[int] | None = None  # token ids as they are
    raw: bool = False  # also: the reply streams as decoded text, a harmony model's channels not split
    max_new_tokens: int = 256
    greedy: bool = False
    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    session_id: str | None = None  # a chat's id: its KV is kept between calls
    ignore_eos: bool = False  # benchmarks: always produce max_new_tokens

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.greedy, self.temperature, self.top_k, self.top_p, self.repetition_penalty, self.seed)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | stopped | context_full
    prompt_tokens: int
    prefilled_tokens: int  # prompt tokens computed this call (the rest were already in the session's KV)
    completion_tokens: int
    ttft_s: float | None
    prefill_tok_s: float | None
    decode_tok_s: float | None
    reasoning: str = ""  # a harmony reply's analysis and commentary channels (`text` is its final answer)


def prompt_ids_of(req: GenerationRequest, tokenize, render) -> list[int]:
    """The request's prompt as token ids: ids as given, a chat through the template, or text."""
    from engine.errors import ConfigError

    if req.prompt_ids is not None:
        return list(req.prompt_ids)
    if req.messages is not None:
        return render(req.messages)
    if req.prompt is None:
        raise ConfigError("the request has no prompt", "give messages, prompt or prompt_ids")
    return tokenize(req.prompt) if req.raw else render([{"role": "user", "content": req.prompt}])
