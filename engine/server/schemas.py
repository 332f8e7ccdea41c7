"""The OpenAI request bodies the server accepts, and how each becomes a GenerationRequest.

Fields follow the OpenAI API; `top_k`, `repetition_penalty` (alias `repeat_penalty`) and
`ignore_eos` are extensions other local servers accept too. Unknown fields are ignored, as OpenAI
clients send some (`user`, `metadata`, …); fields whose meaning Tandem cannot honour (n > 1,
logprobs, penalties other than 0, echo, suffix, tools, tool_choice, functions, response_format other
than text, logit_bias, best_of > 1, audio output) are refused with a 400 rather than silently ignored.

Every value is checked here, before the request can join a batch, against what the sampler accepts
(engine/runtime/sampling.py): a temperature below MIN_TEMPERATURE is greedy, a seed is in [0, 2^64)
(-1: a random one, as llama.cpp's server reads it), repetition_penalty in REPETITION_PENALTY_RANGE.
Token ids are checked against the model's vocabulary by the app (it knows the model).
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from engine.api import GenerationRequest
from engine.runtime.sampling import MIN_TEMPERATURE, REPETITION_PENALTY_RANGE, SEED_LIMIT

MAX_STOP_STRINGS = 4


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)
    repetition_penalty: float | None = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1],
                                             allow_inf_nan=False,
                                             validation_alias=AliasChoices("repetition_penalty", "repeat_penalty"))
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-1, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    ignore_eos: bool = False
    response_format: dict | None = None
    logit_bias: dict | None = None
    modalities: list | None = None
    audio: dict | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) of the first requested feature Tandem cannot honour, else None."""
        if (self.n or 1) != 1:
            return "n", "one choice per request (n=1)"
        if self.logprobs or self.top_logprobs:
            return ("logprobs" if self.logprobs else "top_logprobs"), "log-probabilities are not returned"
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            return "response_format", (f"response_format {self.response_format.get('type')!r} is not supported "
                                       "(no constrained decoding): only {\"type\": \"text\"}")
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.audio is not None or any(m != "text" for m in self.modalities or []):
            return ("audio" if self.audio is not None else "modalities"), "text output only"
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                return name, f"{name} is not supported; use repetition_penalty"
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            return "stop", f"at most {MAX_STOP_STRINGS} stop strings"
        return None

    def generation_fields(self, default_max_tokens: int) -> dict:
        temperature = 1.0 if self.temperature is None else self.temperature
        greedy = temperature < MIN_TEMPERATURE  # 0, and the values the sampler could not temper finitely
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return dict(max_new_tokens=self.max_completion_tokens or self.max_tokens or default_max_tokens,
                    greedy=greedy, temperature=1.0 if greedy else temperature,
                    top_k=self.top_k or 0, top_p=1.0 if self.top_p is None else self.top_p,
                    repetition_penalty=self.repetition_penalty or 1.0,
                    seed=None if self.seed == -1 else self.seed, stop=stop, ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    parallel_tool_calls: bool | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools", "tool calls are not supported"
        if self.tool_choice not in (None, "none"):
            return "tool_choice", "tool calls are not supported (only tool_choice \"none\")"
        if self.functions or self.function_call not in (None, "none"):
            return ("functions" if self.functions else "function_call"), "function calls are not supported"
        return super().unsupported()

    def to_generation(self, default_max_tokens: int) -> GenerationRequest:
        # "developer" is the newer name of "system"; chat templates know only the latter.
        msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]
        return GenerationRequest(messages=msgs, **self.generation_fields(default_max_tokens))


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if (self.best_of or 1) != 1:
            return "best_of", "one candidate per request (best_of=1)"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) > 1:
            return "prompt", "one prompt per request"
        return super().unsupported()

    def token_ids(self) -> list[int] | None:
        p = self.prompt
        return list(p) if isinstance(p, list) and p and isinstance(p[0], int) else None

    def to_generation(self, default_max_tokens: int) -> GenerationRequest:
        fields = self.generation_fields(default_max_tokens)
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], int):
            return GenerationRequest(prompt_ids=list(p), raw=True, **fields)  # the caller's own tokens: no channels
        text = p[0] if isinstance(p, list) and p else (p if isinstance(p, str) else "")
        return GenerationRequest(prompt=text, raw=True, **fields)  # completions: the text as it is, no template
