"""The absorbed MLA kernel against the naive expanded form (every head's K and V materialised from
the latents, attention in float64), on random latents of DeepSeek-V2-Lite's widths.

Tolerance: the kernel runs in fp32 over ≤ 300 keys of O(1) scores; its error against float64 is
float rounding, observed ~1e-6; allowed 1e-4 absolute on outputs of O(0.1–1) and on LSEs of O(5).
"""

import math

import pytest
import torch

from engine.kernels import attention_mla
from engine.kernels.lse import merge_pair

NH, DN, DR, DV, R = 16, 128, 64, 128, 512  # DeepSeek-V2-Lite: heads, nope, rope, value, kv_lora_rank
SCALE = (DN + DR) ** -0.5
ATOL = 1e-4


def random_case(B, T, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_nope = torch.randn(B, NH, T, DN, generator=g)
    q_rope = torch.randn(B, NH, T, DR, generator=g)
    latents = torch.randn(B, S, R, generator=g)  # normalised latents: O(1) entries
    rope_keys = torch.randn(B, S, DR, generator=g)
    kv_b = torch.randn(NH * (DN + DV), R, generator=g) / math.sqrt(R)  # kv_b_proj.weight
    return q_nope, q_rope, latents, rope_keys, kv_b


def expanded_reference(q_nope, q_rope, latents, rope_keys, kv_b, mask=None):
    """What transformers computes: per-head K = [W_UK c, k_r], V = W_UV c, softmax(q·K·scale)·V."""
    B, S = latents.shape[:2]
    kv = (latents.double() @ kv_b.double().T).view(B, S, NH, DN + DV).transpose(1, 2)  # (B, nh, S, dn + dv)
    k = torch.cat((kv[..., :DN], rope_keys.double()[:, None].expand(B, NH, S, DR)), dim=-1)  # (B, nh, S, dn + dr)
    v = kv[..., DN:]  # (B, nh, S, dv)
    q = torch.cat((q_nope, q_rope), dim=-1).double()  # (B, nh, T, dn + dr)
    scores = q @ k.transpose(-1, -2) * SCALE  # (B, nh, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ v, lse  # (B, nh, T, dv), (B, nh, T)


def absorbed(q_nope, q_rope, latents, rope_keys, kv_b, mask=None):
    w_uk, w_uv = attention_mla.kv_b_halves(kv_b, NH, DN)
    q = torch.cat((attention_mla.absorb_queries(q_nope, w_uk), q_rope), dim=-1)  # (B, nh, T, r + dr)
    rows = torch.cat((latents, rope_keys), dim=-1)  # (B, S, r + dr): what the cache holds
    o, lse = attention_mla.latent_attention(q, rows, R, SCALE, mask)
    return o, lse, w_uv


@pytest.mark.parametrize("B,T,S", [(1, 1, 1), (2, 1, 300), (1, 3, 37)])
def test_absorbed_equals_expanded(B, T, S):
    case = random_case(B, T, S)
    o, lse, w_uv = absorbed(*case)
    out = attention_mla.expand_values(o, w_uv)
    ref_out, ref_lse = expanded_reference(*case)
    assert ref_out.abs().max() > 0.05  # a real signal, not a collapse to zero
    torch.testing.assert_close(out.double(), ref_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=ATOL, rtol=0)


def test_mask_hides_keys_and_an_empty_part_has_lse_minus_inf():
    B, T, S = 2, 1, 20
    case = random_case(B, T, S, seed=1)
    mask = torch.ones(B, 1, T, S, dtype=torch.bool)
    mask[0, ..., 12:] = False  # sequence 0 is shorter (a padded batch)
    mask[1] = False  # sequence 1 has no key in this part
    o, lse, w_uv = absorbed(*case, mask=mask)
    ref_out, ref_lse = expanded_reference(*[t[:1] for t in case[:4]], case[4], mask=mask[:1])
    torch.testing.assert_close(attention_mla.expand_values(o[:1], w_uv).double(), ref_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse[:1].double(), ref_lse, atol=ATOL, rtol=0)
    assert torch.isneginf(lse[1]).all() and (o[1] == 0).all()


@pytest.mark.parametrize("cut", [1, 150, 299])
def test_two_halves_merged_by_lse_equal_the_whole(cut):
    """WriteScope's sequence-wise split: the keys in two disjoint ranges (one per engine), each part
    attended on its own and merged by LSE rescaling, equal attention over all keys."""
    B, T, S = 2, 1, 300
    q_nope, q_rope, latents, rope_keys, kv_b = random_case(B, T, S, seed=2)
    whole, whole_lse, w_uv = absorbed(q_nope, q_rope, latents, rope_keys, kv_b)
    first, l1, _ = absorbed(q_nope, q_rope, latents[:, :cut], rope_keys[:, :cut], kv_b)
    second, l2, _ = absorbed(q_nope, q_rope, latents[:, cut:], rope_keys[:, cut:], kv_b)
    merged, merged_lse = merge_pair(first, l1, second, l2)
    torch.testing.assert_close(merged, whole, atol=ATOL, rtol=0)
    torch.testing.assert_close(merged_lse, whole_lse, atol=ATOL, rtol=0)
    ref_out, _ = expanded_reference(q_nope, q_rope, latents, rope_keys, kv_b)
    torch.testing.assert_close(attention_mla.expand_values(merged, w_uv).double(), ref_out, atol=ATOL, rtol=0)


def test_rows_read_in_place_from_a_strided_view():
    """A cache region's rows (slots, n_kv=1, r + dr) are read through a view, not copied first."""
    B, T, S = 1, 1, 50
    q_nope, q_rope, latents, rope_keys, kv_b = random_case(B, T, S, seed=3)
    pool = torch.zeros(2 * S, 1, R + DR)  # a pool with every other slot used
    pool[::2, 0] = torch.cat((latents[0], rope_keys[0]), dim=-1)
    rows = pool[::2, 0].unsqueeze(0)  # (1, S, r + dr), stride 2 rows
    assert not rows.is_contiguous()
    w_uk, w_uv = attention_mla.kv_b_halves(kv_b, NH, DN)
    q = torch.cat((attention_mla.absorb_queries(q_nope, w_uk), q_rope), dim=-1)
    o, lse = attention_mla.latent_attention(q, rows, R, SCALE)
    ref_out, ref_lse = expanded_reference(q_nope, q_rope, latents, rope_keys, kv_b)
    torch.testing.assert_close(attention_mla.expand_values(o, w_uv).double(), ref_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=ATOL, rtol=0)


@pytest.mark.parametrize("T", [1, 4])
def test_rows_held_as_two_planes(T):
    """The hybrid format keeps each row as a K and a V plane of (r + dr)/2 columns: attention over
    the two planes (the latent spans both) equals attention over whole rows; causal for a prefill's
    new tokens over themselves (query i sees keys ≤ S − T + i)."""
    B, S = 2, 40
    q_nope, q_rope, latents, rope_keys, kv_b = random_case(B, T, S, seed=4)
    w_uk, _ = attention_mla.kv_b_halves(kv_b, NH, DN)
    q = torch.cat((attention_mla.absorb_queries(q_nope, w_uk), q_rope), dim=-1)
    rows = torch.cat((latents, rope_keys), dim=-1)  # (B, S, 576)
    half = (R + DR) // 2
    planes = rows.view(B, 1, S, 2, half)  # the format's (…, 2, n_kv, hs) interleave, as views
    causal = torch.ones(T, S, dtype=torch.bool).tril(S - T)  # (T, S) visible
    o, lse = attention_mla.latent_attention_planes(q, planes[..., 0, :], planes[..., 1, :], R, SCALE, causal=True)
    ref_o, ref_lse = attention_mla.latent_attention(q, rows, R, SCALE, mask=causal)
    torch.testing.assert_close(o, ref_o, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=ATOL, rtol=0)
    assert o.shape == (B, NH, T, R)
