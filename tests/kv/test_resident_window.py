"""Resident KV under a sliding window: a chunk after earlier ones reads only the keys some query of it
can see (the rest is left unread, not masked), with and without attention sinks, and attends as the
windowed softmax written out over every key so far."""
import pytest
import torch

from engine.kernels import attention_gpu
from engine.kv.resident import ResidentKV

NH, NKV, HS, WINDOW = 4, 2, 16, 8


def reference(q, k, v, window, sinks=None):
    """q (1, nh, T, hs) at the last T positions of k, v (1, n_kv, S, hs): the windowed causal softmax."""
    T, S = q.shape[2], k.shape[2]
    qpos = (S - T + torch.arange(T))[:, None]
    kpos = torch.arange(S)[None, :]
    visible = (kpos <= qpos) & (kpos > qpos - window)  # (T, S)
    kk, vv = (t.repeat_interleave(NH // NKV, dim=1) for t in (k, v))
    scores = (q @ kk.transpose(-1, -2) * HS ** -0.5).masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat((sinks[None, :, None, None].expand(1, NH, T, 1), scores), dim=-1)
        return scores.softmax(-1)[..., 1:] @ vv
    return scores.softmax(-1) @ vv


@pytest.mark.parametrize("with_sinks", [False, True])
def test_window_layers_read_only_the_keys_their_queries_see(monkeypatch, with_sinks):
    read = []
    real = attention_gpu.sdpa
    monkeypatch.setattr(attention_gpu, "sdpa", lambda q, k, v, *a, **kw: read.append(k.shape[2]) or real(q, k, v, *a, **kw))
    kv = ResidentKV(1, NKV, HS, max_context=64, max_batch=1, block_size=4, device=torch.device("cpu"),
                    dtype=torch.float32, sliding_window=WINDOW)
    sid = kv.new_sequence()
    g = torch.Generator().manual_seed(0)
    sinks = torch.randn(NH, generator=g) if with_sinks else None
    ks, vs = [], []
    for T in (10, 7, 9, 1, 1):  # a prompt in three chunks, then two decode steps
        q = torch.randn(1, NH, T, HS, generator=g)
        k, v = torch.randn(1, NKV, T, HS, generator=g), torch.randn(1, NKV, T, HS, generator=g)
        ks.append(k), vs.append(v)
        kv.begin_step([sid], T)
        got = kv.attend(0, q, k, v, sinks=sinks)
        kv.end_step()
        want = reference(q, torch.cat(ks, dim=2), torch.cat(vs, dim=2), WINDOW, sinks)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # keys read: the first chunk its own 10; then T + window − 1 at most (with the sink key in front)
    assert read == [n + with_sinks for n in (10, 7 + WINDOW - 1, 9 + WINDOW - 1, WINDOW, WINDOW)]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("chunks", [(300,), (40, 300, 200)], ids=["fresh", "after-earlier"])
@pytest.mark.cuda
@needs_cuda
def test_a_cuda_window_layer_attends_through_flash_as_the_written_out_softmax(with_sinks, chunks):
    """bf16 on CUDA: a window layer's chunk goes through flash's sliding window (no mask is built), for a
    prompt's first chunk longer than the window and for chunks after earlier ones; decode as before."""
    dev, window = torch.device("cuda"), 128
    nh, n_kv, hs = 8, 2, 64
    kv = ResidentKV(1, n_kv, hs, max_context=1024, max_batch=1, block_size=16, device=dev, dtype=torch.bfloat16)
    sid = kv.new_sequence()
    g = torch.Generator().manual_seed(1)
    sinks = torch.randn(nh, generator=g).to(dev) if with_sinks else None
    ks, vs = [], []
    for T in (*chunks, 1):
        q = torch.randn(1, nh, T, hs, generator=g).to(dev, torch.bfloat16)
        k, v = (torch.randn(1, n_kv, T, hs, generator=g).to(dev, torch.bfloat16) for _ in range(2))
        ks.append(k), vs.append(v)
        kv.begin_step([sid], T)
        got = kv.attend(0, q, k, v, sinks=sinks, window=window).float()
        assert T == 1 or window not in kv._masks  # flash: no mask for the window
        kv.end_step()
        K, V = torch.cat(ks, dim=2).float(), torch.cat(vs, dim=2).float()
        S = K.shape[2]
        qpos = (S - T + torch.arange(T, device=dev))[:, None]
        kpos = torch.arange(S, device=dev)[None, :]
        visible = (kpos <= qpos) & (kpos > qpos - window)
        scores = (q.float() @ K.repeat_interleave(nh // n_kv, 1).transpose(-1, -2) * hs ** -0.5)
        scores = scores.masked_fill(~visible, float("-inf"))
        if with_sinks:
            scores = torch.cat((sinks.float()[None, :, None, None].expand(1, nh, T, 1), scores), dim=-1)
            want = scores.softmax(-1)[..., 1:] @ V.repeat_interleave(nh // n_kv, 1)
        else:
            want = scores.softmax(-1) @ V.repeat_interleave(nh // n_kv, 1)
        assert (got - want).abs().max() <= 2e-2
