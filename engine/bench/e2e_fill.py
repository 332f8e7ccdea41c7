"""What `tandem bench e2e` writes before it decodes: each chat's context as random KV, through the
backend's own prefill path, and what one point of (chats, context) costs in memory.

The fill is one step per chat over its whole context (`fill_session`): a sequence's first step
attends only to its own new rows, so no layer reads back KV already routed to host memory, and the
hybrid policies place every row in its final region at write time exactly as a prefill would. The
attention shape follows the model's KV:

    per-head K, V      q (1, nh, T, hs), k = v (1, n_kv, T, hs): every query of the step, through the
                       backends' fused causal kernels (memory O(T) on CUDA)
    latent rows (MLA)  q (1, nh, 1, r + dr), k (1, 1, T, r + dr), v None, the model's softmax scale:
                       only the last query. The latent backends' prefill attention materialises the
                       scores (nh, T, S) in fp32 (engine/kernels/attention_mla.py): 16 heads at 32K are
                       68 GB, twice over with the probabilities, which no 24 GB budget holds. The fill
                       reads no attention output, and the rows written and routed are the same T.

Only the layers that store KV are filled (a hybrid model's full-attention layers, args.kv_layer_ids();
their recurrent layers start each chat from a zero state). KV bytes per token come from the planner's
own count (engine/models/sizes.py: one row of r + dr for latent models, K and V otherwise, KV layers only).

Host memory: a point's KV lives on the host under every policy but resident (the hybrid's spilled
share, monolithic's host copy; in the simulated hybrid the "GPU" is the host too). `host_shortfall`
compares that with what the host has available now, so a point that would swap is refused with a
row that says so instead of taking the machine down.
"""

from __future__ import annotations

import psutil
import torch

from engine.models.sizes import model_parts

# Of the host memory available when a point starts, the share its KV may take: the rest is for the
# fill's transient q/k/v, the staging rings, the allocator's slack and the OS page cache.
HOST_KV_SHARE = 0.85


def kv_token_bytes(args, dtype: torch.dtype, model: str = "") -> int:
    """KV bytes of one token of one chat over every layer that stores KV (latent: r + dr values a layer)."""
    return model_parts(args, torch.empty((), dtype=dtype).element_size(), model).kv_bytes_per_token


def host_shortfall(policy: str, device: torch.device, chats: int, context: int, token_bytes: int) -> str | None:
    """Why a point cannot be run in this host's memory, or None when its KV fits."""
    if policy == "resident" and device.type == "cuda":
        return None  # the KV is on the device, sized against the VRAM budget when the policy is built
    need = chats * context * token_bytes
    available = psutil.virtual_memory().available
    if need <= available * HOST_KV_SHARE:
        return None
    return (f"host memory: {chats} chats x {context} tokens need {need / 2**30:.1f} GiB of KV, "
            f"{available / 2**30:.1f} GiB available ({HOST_KV_SHARE:.0%} may be taken)")


@torch.inference_mode()
def fill_session(engine, key: str, context: int, gen: torch.Generator) -> list[int]:
    """Write `context` tokens of random KV into a new session through the real prefill path; the
    session then believes it holds those (random) token ids."""
    parts, generator = engine.backend.parts, engine.backend.generator
    a, kv = parts.args, parts.kv
    session = generator.session(key)
    mla = getattr(a, "mla", None)
    like = {"device": parts.device, "dtype": parts.dtype}
    kv.begin_step([session.seq_id], context)  # a failure leaves the step open: the caller rebuilds the KV
    for layer in range(len(a.kv_layer_ids())):  # the backend's layers: the KV-storing ones, in order
        if mla is None:
            q = torch.randn((1, a.n_heads, context, a.head_dim), **like)
            k = torch.randn((1, a.n_kv_heads, context, a.head_dim), **like)
            kv.attend(layer, q, k, torch.randn_like(k))
        else:
            q = torch.randn((1, a.n_heads, 1, mla.row_width), **like)  # the last query only (see above)
            k = torch.randn((1, 1, context, mla.row_width), **like)
            kv.attend(layer, q, k, None, scale=mla.softmax_scale)
    kv.end_step()
    session.cached = torch.randint(0, a.vocab_size, (context,), generator=gen).tolist()
    return session.cached
