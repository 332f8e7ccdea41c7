"""InplaceKVCache + WriteScope against full attention over the same K/V, and the format's invariants.

Random q/k/v drive the KV backends directly through the model-facing interface (begin_step /
attend / end_step, crop, free), with small blocks, D-window and extents so that flushes, multi-extent
runs, ping-pong streaming and partial blocks all happen within a few dozen steps.
"""

import pytest
import torch

from engine.kv.inplace import PartitionSpec
from engine.kv.monolithic import MonolithicKV
from engine.kv.writescope import WriteScopeKV
from engine.sched.roofline import RooflineParams

LAYERS, NH, NKV, HS = 2, 6, 2, 8
BLOCK, D, E = 4, 8, 24


def make(policy, device="cpu", dtype=torch.float32, max_batch=4, params=RooflineParams(30.0, 10.0, 0.0)):
    kw = dict(max_context=400, max_batch=max_batch, device=torch.device(device), dtype=dtype)
    if policy == "monolithic":
        return MonolithicKV(LAYERS, NKV, HS, **kw)
    spec = PartitionSpec(block_size=BLOCK, d_window=D, pingpong_tokens=E, roofline=params)
    return WriteScopeKV(LAYERS, NKV, HS, spec=spec, policy=policy, **kw)


class Mirror:
    """The same K/V kept whole per sequence and layer; every attend is checked against it."""

    def __init__(self, kv, seed=0, device="cpu", dtype=torch.float32, tol=1e-5):
        self.kv, self.device, self.dtype, self.tol = kv, device, dtype, tol
        self.gen = torch.Generator().manual_seed(seed)
        self.k, self.v = {}, {}  # seq → per layer (n_kv, S, hs) fp64
        self.worst = 0.0

    def new(self):
        sid = self.kv.new_sequence()
        self.k[sid] = [torch.zeros(NKV, 0, HS, dtype=torch.float64) for _ in range(LAYERS)]
        self.v[sid] = [torch.zeros(NKV, 0, HS, dtype=torch.float64) for _ in range(LAYERS)]
        return sid

    def rand(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(self.device, self.dtype)

    def step(self, seq_ids, T):
        B = len(seq_ids)
        pos = self.kv.begin_step(seq_ids, T)
        assert pos.tolist() == [[self.k[s][0].shape[1] + t for t in range(T)] for s in seq_ids]
        for layer in range(LAYERS):
            q, k, v = self.rand(B, NH, T, HS), self.rand(B, NKV, T, HS), self.rand(B, NKV, T, HS)
            out = self.kv.attend(layer, q, k, v)
            assert out.shape == q.shape and out.dtype == q.dtype
            for b, s in enumerate(seq_ids):
                K = self.k[s][layer] = torch.cat([self.k[s][layer], k[b].double().cpu()], dim=1)
                V = self.v[s][layer] = torch.cat([self.v[s][layer], v[b].double().cpu()], dim=1)
                S = K.shape[1]
                g = NH // NKV
                scores = q[b].double().cpu() @ K.repeat_interleave(g, 0).transpose(1, 2) * HS ** -0.5  # (nh, T, S)
                causal = torch.ones(T, S, dtype=torch.bool).tril(S - T)
                ref = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ V.repeat_interleave(g, 0)
                err = ((out[b].double().cpu() - ref).abs().max() / ref.abs().max()).item()
                self.worst = max(self.worst, err)
                assert err <= self.tol, f"layer {layer} seq {s}: relative error {err:.2e}"
        self.kv.end_step()

    def crop(self, sid, n):
        self.kv.crop(sid, n)
        self.k[sid] = [t[:, :n] for t in self.k[sid]]
        self.v[sid] = [t[:, :n] for t in self.v[sid]]

    def free(self, sid):
        self.kv.free(sid)
        del self.k[sid], self.v[sid]


def scenario(m: Mirror, check=lambda: None, decode_steps=40):
    """Prompts of lengths that are not block multiples, batched decode with unequal D-windows,
    a crop into the placed regions, a chat-turn prefill over history, a free and a new sequence."""
    a, b, c = m.new(), m.new(), m.new()
    for sid, n in ((a, 37), (b, 5), (c, 22)):
        m.step([sid], n)
        check()
    for _ in range(decode_steps):
        m.step([a, b, c], 1)
        check()
    m.crop(a, 30)  # back into the placed regions: the tail extents are freed
    check()
    m.crop(c, m.kv.length(c) - 3)  # only inside the D-window
    for _ in range(13):
        m.step([c, a], 1)  # another row order: the D-window rows are gathered, not sliced
        check()
    m.step([b], 13)  # a chat turn: prefill over a history spread over every region
    check()
    m.step([c, b], 3)  # two sequences' turns in one step: unequal D-windows, several queries each
    check()
    m.free(a)
    check()
    d = m.new()
    m.step([d], 41)
    for _ in range(11):
        m.step([b, c, d], 1)
        check()


@pytest.mark.parametrize("policy", ["writescope", "gpu-centric", "cpu-centric", "fixed:0.23", "fixed:0.81",
                                    "monolithic"])
def test_hybrid_attention_equals_full_attention(policy):
    kv = make(policy)
    m = Mirror(kv, seed=hash(policy) % 1000)
    scenario(m)
    tel = kv.telemetry()
    assert tel["policy"] == policy
    if policy != "monolithic":
        tokens = tel["tokens"]
        assert tokens["dwindow"] + tokens["pinned"] + tokens["unpinned"] == sum(kv.length(s) for s in m.k)
        if policy == "gpu-centric":
            assert tokens["unpinned"] == 0 and tokens["pinned"] > 0
        if policy == "cpu-centric":
            assert tokens["pinned"] == 0 and tokens["unpinned"] > 0
    kv.close()


def test_a_staging_ring_of_one_layer_still_gives_exact_attention(monkeypatch):
    """CPU-bound tokens stage in a ring of R layer slots; layer l's copies wait until the CPU side's
    thread has laid out layer l − R. With R = 1 every layer waits for the one before it."""
    from engine.kv import staging

    monkeypatch.setattr(staging, "STAGING_LAYERS", 1)
    kv = make("fixed:0.5")
    m = Mirror(kv, seed=51)
    scenario(m)
    assert kv.cache.staging.buffer.tensor.shape[0] == 1
    kv.close()


def test_random_roofline_parameters_give_exact_attention():
    gen = torch.Generator().manual_seed(7)
    for trial in range(3):
        A, B = (float(x) for x in torch.rand(2, generator=gen) * 200 + 1)
        delta = float(torch.randn(1, generator=gen)) * 0.01
        kv = make("writescope", params=RooflineParams(A, B, delta))
        scenario(Mirror(kv, seed=trial), decode_steps=25)
        kv.close()


def run_positions(run):
    """Positions held by a RegionRun, in the order its tokens sit in its extents."""
    return [p for first, count in run.segments for p in range(first, first + count)]


def invariants(kv):
    cache = kv.cache
    owned = {"unpinned": [], "pinned": []}
    for sid, s in cache.seqs.items():
        assert 0 <= s.window <= D  # the D-window never exceeds D
        held = run_positions(s.unpinned) + run_positions(s.pinned)
        assert len(held) == s.unpinned.fill + s.pinned.fill
        assert sorted(held) == list(range(s.placed))  # every placed token in exactly one host region
        for name, run in (("unpinned", s.unpinned), ("pinned", s.pinned)):
            assert len(run.extents) == -(-run.fill // E)
            owned[name] += run.extents
    for name, region in (("unpinned", cache.unpinned.pool._free), ("pinned", cache.pinned._free)):
        assert len(set(owned[name])) == len(owned[name])  # no extent belongs to two sequences…
        assert not set(owned[name]) & set(region)  # …or is both owned and free


def token_address(cache, s, pos, layer):
    """(data_ptr, K of head 0) of the placed token at `pos`."""
    for name, run in (("unpinned", s.unpinned), ("pinned", s.pinned)):
        positions = run_positions(run)
        if pos in positions:
            i = positions.index(pos)
            ext, off = run.extents[i // E], i % E
            if name == "unpinned":
                row = cache.unpinned.layers[layer][0, 0, ext * E + off]
            else:
                row = cache.pinned.buffers[ext].tensor[layer, off, 0, 0]
            return row.data_ptr(), row.clone()
    raise AssertionError(f"position {pos} is not placed")


def test_format_invariants_and_placed_tokens_never_move():
    kv = make("fixed:0.4")
    m = Mirror(kv, seed=11)
    cache = kv.cache
    a, b = m.new(), m.new()
    m.step([a], 37)
    m.step([b], 10)
    snapshot = {}
    for step in range(60):
        m.step([a, b], 1)
        invariants(kv)
        kv.synchronize()  # write-backs to the CPU region land on its thread, after the step
        for sid in (a, b):  # record every newly placed token's address and bytes; later check them
            s = cache.seqs[sid]
            for pos in range(s.placed):
                for layer in (0, LAYERS - 1):
                    key = (sid, pos, layer)
                    ptr, row = token_address(cache, s, pos, layer)
                    if key in snapshot:
                        assert snapshot[key][0] == ptr, f"placed token {key} moved"
                        assert torch.equal(snapshot[key][1], row), f"placed token {key} changed"
                    else:
                        snapshot[key] = (ptr, row)
    assert kv.telemetry()["r_deployed"] == pytest.approx(0.4, abs=D / cache.seqs[a].placed)
    # crop and free give every extent and slot back
    unp_free, pin_free = cache.unpinned.pool.n_free, len(cache.pinned._free)
    held = sum(len(s.unpinned.extents) for s in cache.seqs.values())
    m.crop(a, 9)
    invariants(kv)
    assert cache.unpinned.pool.n_free + len(cache.pinned._free) > unp_free + pin_free
    m.free(a)
    m.free(b)
    assert cache.unpinned.pool.n_free == unp_free + held
    assert len(cache.pinned._free) == len(cache.pinned.buffers)
    assert sorted(cache._free_slots) == list(range(4))
    kv.close()


def test_deployed_share_tracks_the_roofline_target():
    kv = make("writescope", params=RooflineParams(300.0, 100.0, 0.0))  # converges to r = 0.25
    m = Mirror(kv, seed=5)
    a = m.new()
    m.step([a], 9)
    for _ in range(120):
        m.step([a], 1)
    tel = kv.telemetry()
    placed = kv.cache.seqs[a].placed
    assert 0 < tel["r_target"] < 1
    assert abs(tel["r_deployed"] - tel["r_target"]) <= D / placed + 0.02
    assert tel["A_ns_per_token"] > 0 and tel["B_ns_per_token"] > 0
    kv.close()


def test_prefill_chunks_leave_the_decode_costs_alone_and_a_prompt_is_placed_by_them():
    """A and B are a decode step's costs a placed token. Prefill chunks, whose query rows make every
    placed token cost many times more on the CPU, neither feed them nor bend the share they place the
    prompt with: the prompt lands at the decode target of the calibrated costs; decode steps then
    measure."""
    kv = make("writescope", params=RooflineParams(300.0, 100.0, 0.0))  # decode target 0.25
    m = Mirror(kv, seed=6)
    a = m.new()
    for _ in range(6):  # a 96-token prompt in chunks, each attending over the placed part of the last
        m.step([a], 16)
    tel = kv.telemetry()
    assert (tel["A_ns_per_token"], tel["B_ns_per_token"]) == (300.0, 100.0)
    placed = kv.cache.seqs[a].placed
    assert tel["r_target"] == pytest.approx(0.25) and abs(tel["r_deployed"] - 0.25) <= BLOCK / placed
    for _ in range(3 * D):
        m.step([a], 1)
    tel = kv.telemetry()
    assert (tel["A_ns_per_token"], tel["B_ns_per_token"]) != (300.0, 100.0)  # decode steps measured
    kv.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["writescope", "fixed:0.5", "monolithic"])
def test_cuda_hybrid_attention_in_bf16_and_page_locked_load_region(policy):
    kv = make(policy, device="cuda", dtype=torch.bfloat16)
    m = Mirror(kv, seed=3, device="cuda", dtype=torch.bfloat16, tol=2e-2)
    scenario(m, decode_steps=20)
    if policy != "monolithic":
        buffers = [b for b in kv.cache.pinned.buffers if b is not None]
        assert buffers and all(b.pinned and b.tensor.is_pinned() for b in buffers)
        assert not kv.cache.unpinned.layers[0].is_pinned()
    kv.close()


@pytest.mark.parametrize("policy", ["fixed:0.5", "monolithic"])
def test_a_step_that_fails_midway_leaves_the_cache_consistent(policy):
    """As the generator does on an exception: end_step, then crop the step's tokens away. A failed
    step that evicted a full D-window must still have written every layer's copy of it."""
    kv = make(policy)
    m = Mirror(kv, seed=21)
    a = m.new()
    m.step([a], 11)

    def fail(seq_ids, T):
        before = [kv.length(s) for s in seq_ids]
        kv.begin_step(seq_ids, T)
        kv.attend(0, m.rand(len(seq_ids), NH, T, HS), m.rand(len(seq_ids), NKV, T, HS),
                  m.rand(len(seq_ids), NKV, T, HS))  # layer 1 never runs
        kv.end_step()
        for s, n in zip(seq_ids, before):
            kv.crop(s, n)

    for i in range(3 * D):
        if policy != "monolithic" and kv.cache.seqs[a].window == D - 1:
            fail([a], 1)  # this step would evict the full D-window
        m.step([a], 1)
    fail([a], 2 * D + 3)  # a long turn that would move the D-window out and place new tokens
    m.step([a], 5)
    for _ in range(D + 2):
        m.step([a], 1)
    kv.close()


def test_staging_is_sized_for_a_whole_step_so_a_larger_share_does_not_repin():
    """A prefill routes its CPU share through a page-locked staging buffer. A later prefill of the
    same length with a larger CPU share must find it big enough: page-locking again costs ~0.5 s/GB."""
    from engine.sched.roofline import SharePolicy

    spec = PartitionSpec(block_size=BLOCK, d_window=D, pingpong_tokens=E, roofline=RooflineParams(30.0, 10.0, 0.0))
    kv = WriteScopeKV(LAYERS, NKV, HS, spec=spec, policy="fixed:0.25", max_context=2000, max_batch=2,
                      device=torch.device("cpu"), dtype=torch.float32)
    m = Mirror(kv, seed=31)
    m.step([m.new()], 1100)  # past the buffer's floor of D + 512 tokens
    stage = kv.cache.staging.buffer
    assert stage is not None and stage.tensor.shape[1] >= 1100  # every placed token of the step, not a quarter
    kv.share = SharePolicy.from_name("fixed:1", spec.roofline, spec.cost_window)
    m.step([m.new()], 1100)
    assert kv.cache.staging.buffer is stage  # reused, not re-pinned
    assert kv.telemetry()["bytes"]["kv_staging"] == (stage.nbytes if stage.pinned else 0)  # page-locked only
    kv.close()


def test_streamed_loads_pair_extents_and_cpu_writebacks_start_per_layer():
    """A ping-pong load holds up to PINGPONG_EXTENTS extent-layers of one row (one attention call per
    load), and a prefill hands each layer's CPU-bound tokens to the CPU side's thread as soon as that
    layer is flushed, not at the step's end."""
    from engine.kv.partition import PINGPONG_EXTENTS

    kv = make("fixed:0.5", max_batch=3)
    m = Mirror(kv, seed=41)
    a, b = m.new(), m.new()
    m.step([a, b], 5 * E + 3)  # several extents per row in each region
    plan_rows = []
    kv.begin_step([a, b], 1)
    for row, pieces, n in kv.plan.chunks:
        assert 1 <= len(pieces) <= PINGPONG_EXTENTS and n == sum(k for _, k in pieces) <= PINGPONG_EXTENTS * E
        plan_rows.append(row)
    assert plan_rows == sorted(plan_rows)  # one row's loads together, in token order
    assert any(len(pieces) == PINGPONG_EXTENTS for _, pieces, _ in kv.plan.chunks)
    assert kv.plan.stream_tokens == sum(n for _, _, n in kv.plan.chunks)
    kv.end_step()  # as after a failed step: end it, then crop its token away
    for s in (a, b):
        kv.crop(s, 5 * E + 3)
    c = m.new()
    kv.begin_step([c], 3 * E)
    q, k, v = m.rand(1, NH, 3 * E, HS), m.rand(1, NKV, 3 * E, HS), m.rand(1, NKV, 3 * E, HS)
    before = dict(kv.cache.staging.jobs)
    kv.attend(0, q, k, v)
    jobs = kv.cache.staging.jobs  # ring slot → its latest write-back
    assert jobs.get(0) is not None and jobs[0] is not before.get(0)  # layer 0's is queued before layer 1 runs
    assert jobs.get(1) is before.get(1)
    kv.attend(1, q, k, v)
    assert jobs.get(1) is not None and jobs[1] is not before.get(1)
    kv.end_step()
    kv.synchronize()
    kv.close()


def test_stream_graphs_capture_a_load_list_on_its_second_step_and_drop_it_when_it_changes():
    """The bookkeeping behind the CUDA graphs of the streamed loads (no capture here)."""
    from engine.kv.stream_graph import StreamGraphs, _Graph

    g = StreamGraphs(torch.device("cpu"))
    a, b = (1, ((0, ((3, 24),), 24),)), (1, ((0, ((3, 24), (4, 8)), 32),))
    assert g.find(0, a) is None and g.ready_to_capture(0, a) is None  # first sight: run eagerly
    g.seen(0, a, torch.bfloat16)
    assert g.ready_to_capture(0, a) is torch.bfloat16 and g.ready_to_capture(1, a) is None  # per layer
    assert g.ready_to_capture(0, b) is None
    g._graphs[0] = _Graph(a, None, None, None, None)  # as a capture leaves it
    assert g.find(0, a) is not None and g.find(0, b) is None
    g.seen(0, b, torch.bfloat16)  # a flush changed the list: the old graph goes
    assert g.find(0, a) is None
    g.failed = "capture refused"
    assert g.ready_to_capture(0, b) is None  # after a failure every step streams eagerly


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["gpu-centric", "fixed:0.5"])
def test_cuda_streamed_loads_replay_as_graphs_and_stay_exact(policy):
    """Decode replays each layer's loads as a graph between flushes; every flush, crop, free and
    new row changes the load list, so graphs are captured again and stale ones never run."""
    kv = make(policy, device="cuda", dtype=torch.bfloat16)
    m = Mirror(kv, seed=13, device="cuda", dtype=torch.bfloat16, tol=2e-2)
    scenario(m, decode_steps=40)
    graphs = kv.telemetry()["stream_graphs"]
    assert graphs["failed"] is None
    assert graphs["captures"] >= 4 and graphs["replays"] > graphs["captures"]
    kv.close()



@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_a_load_list_that_cannot_be_captured_streams_eagerly(monkeypatch):
    """A call that syncs with the host cannot be captured: the capture fails once and is reported,
    every step streams eagerly with exact results, and random draws on the device still work after
    it (a failed capture leaves torch's default generator in capture mode unless it is restored)."""
    from engine.kv import writescope

    real = writescope.attend_dense

    def syncing(q, k, v, scale, **kw):
        q.sum().item()  # a host sync: illegal while a stream is captured
        return real(q, k, v, scale, **kw)

    monkeypatch.setattr(writescope, "attend_dense", syncing)
    kv = make("gpu-centric", device="cuda", dtype=torch.bfloat16)
    m = Mirror(kv, seed=17, device="cuda", dtype=torch.bfloat16, tol=2e-2)
    scenario(m, decode_steps=20)
    graphs = kv.telemetry()["stream_graphs"]
    assert graphs["failed"] and graphs["captures"] == 0 and graphs["replays"] == 0
    kv.close()
    assert torch.isfinite(torch.randn(1000, device="cuda")).all()
