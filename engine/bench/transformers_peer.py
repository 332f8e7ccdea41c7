"""`tandem bench transformers`: transformers' own eager `generate` on a synthetic preset's shape.

The reference point of the MoE families issue: what a user gets from the model's modeling file with
no engine at all. The model is built from the preset's config (`synthetic.config_for`) with
transformers' random initialisation, in bf16, all on one device; the prompt is `context` random
token ids per sequence. One `generate` call per point (after a short warm-up), `do_sample=False`
and EOS disabled so it decodes exactly 1 + new_tokens tokens; a logits processor stamps the time
(after a device sync) at every step, so prefill is call start → first step and decode is first →
last step, all inside transformers' own loop.
"""

from __future__ import annotations

import time

import torch

from engine.bench.common import header

_AUTO_CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "olmoe": "OlmoeForCausalLM"}


def build(model: str, device: torch.device, dtype: torch.dtype):
    import transformers

    from engine.models import synthetic

    config = dict(synthetic.config_for(model))
    cls = getattr(transformers, _AUTO_CLASSES[config["model_type"]])
    cfg = transformers.AutoConfig.for_model(**config)
    cfg.eos_token_id = None  # run to max_new_tokens
    with torch.device(device):
        m = cls._from_config(cfg, dtype=dtype)
    return m.eval()


def _generate_stamps(m, ids: torch.Tensor, n: int) -> tuple[float, list[float]]:
    """(start, [time at each of the n steps]) of one generate call."""
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if scores.is_cuda:
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())
            return scores

    if ids.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
               logits_processor=LogitsProcessorList([Stamp()]))
    return t0, stamps


@torch.inference_mode()
def run(model: str = "synthetic:qwen3-30b-a3b-L16", contexts=(8192,), batch_sizes=(1,), new_tokens: int = 32,
        device: str = "auto", seed: int = 0) -> dict:
    import transformers

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    m = build(model, dev, dtype)
    load_s = time.perf_counter() - t0
    vocab = m.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    _generate_stamps(m, torch.randint(0, vocab, (1, 16), generator=gen).to(dev), 2)  # warm-up
    rows = []
    for context in contexts:
        for bs in batch_sizes:
            ids = torch.randint(0, vocab, (bs, context), generator=gen).to(dev)
            t0, stamps = _generate_stamps(m, ids, 1 + new_tokens)
            prefill_s, decode_s = stamps[0] - t0, stamps[-1] - stamps[0]
            rows.append({"context": context, "bs": bs, "new_tokens": new_tokens,
                         "prefill_tok_s": round(bs * context / prefill_s, 1),
                         "decode_tok_s": round(bs * new_tokens / decode_s, 3), "ttft_s": round(prefill_s, 3)})
    info = {"attn_implementation": getattr(m.config, "_attn_implementation", None),
            "experts_implementation": getattr(m.config, "_experts_implementation", None)}
    del m
    return {**header(), "bench": "transformers", "model": model, "transformers": transformers.__version__,
            "device": str(dev), "dtype": str(dtype).removeprefix("torch."), "load_s": round(load_s, 1),
            "weights": "transformers' random initialisation of the preset's config", **info, "results": rows}


def add_arguments(p) -> None:
    p.add_argument("--model", default="synthetic:qwen3-30b-a3b-L16")
    p.add_argument("--contexts", default="8192")
    p.add_argument("--batch-sizes", default="1")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--device", default="auto")
    p.add_argument("--json", default=None, help="also write the record here")


def from_args(ns) -> dict:
    ints = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    return run(model=ns.model, contexts=ints(ns.contexts), batch_sizes=ints(ns.batch_sizes),
               new_tokens=ns.new_tokens, device=ns.device)
