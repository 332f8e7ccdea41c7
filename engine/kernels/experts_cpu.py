"""Routed-expert FFN on the CPU, reading the weights in place from host memory.

    expert_ffn(x (n, H), gate_up (2I, H), down (H, I), form=None, expert=0) -> y (n, H) in x's dtype

SwiGLU, or with `form` (experts_torch.ClampedSwiGLU: gpt-oss) its biased, clamped form: the native
kernel adds the biases to its fp32 accumulators and applies the clamped activation in the same pass.

The fused layout of transformers 5.x (gate rows first; see experts_torch.py, the reference). The
native kernel reads each weight once per call, splits the rows over the threads, and does bf16
dot products with AVX512_BF16 where the CPU has it; with bf16 weights the activations are rounded to
bf16 (as torch's bf16 path does), with fp32 weights everything stays fp32.

Which kernel runs is a measured choice per token count: the native one streams weights faster at
decode sizes, while torch's oneDNN (AMX on CPUs that have it) wins once enough tokens make the
product compute-bound. `set_native_max_tokens` moves the crossover (calibration measures it with
`tandem bench cpu-kernels`); above it, and without the extension, torch runs.

    moe_ffn(x (N, H), experts [(gate_up, down)], tokens [idx], weights [w]) -> out (N, H) fp32

One MoE layer's CPU-side experts in one native call: out[t] = Σ over expert j and its pairs i with
tokens[j][i] = t of weights[j][i] · expert_j(x[t]). One fork of the thread team per layer instead of
one per expert, no torch op per expert, the GIL released throughout (it runs in a worker thread
next to the GPU-driving one). Experts with more tokens than native_max_tokens go through torch.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.errors import KernelInputError
from engine.kernels import native
from engine.kernels.experts_torch import ClampedSwiGLU
from engine.kernels.experts_torch import expert_ffn as expert_ffn_torch

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Largest token count sent to the native kernel; above it torch runs. The default is the crossover
# of an AMD Zen 4 core (AVX512_BF16, no AMX, one thread): native ahead up to 16 tokens, torch from
# 64. `tandem bench cpu-kernels` reports each machine's crossover (experts.crossover_tokens);
# calibration sets it with set_native_max_tokens.
_native_max_tokens = 16


def set_native_max_tokens(n: int) -> None:
    global _native_max_tokens
    _native_max_tokens = int(n)


def native_max_tokens() -> int:
    return _native_max_tokens


def implementation(n_tokens: int = 1) -> str:
    """Which kernel expert_ffn runs for n_tokens: 'native-<isa>' or 'torch'."""
    isa = native.isa()
    return f"native-{isa}" if isa and n_tokens <= _native_max_tokens else "torch"


# The native call's code for an expert activation (native/common.h ExpertAct).
_CLAMPED_SWIGLU = 1


def _check_form(form, H: int, inter: int) -> None:
    """A ClampedSwiGLU whose biases fit (E, 2I) and (E, H), CPU tensors of one supported dtype with unit
    stride along a row; else KernelInputError."""
    if not isinstance(form, ClampedSwiGLU):
        raise KernelInputError(f"form must be an experts_torch.ClampedSwiGLU, got {type(form).__name__}")
    gub, db = form.gate_up_bias, form.down_bias
    if gub.dim() != 2 or db.dim() != 2 or gub.shape[1] != 2 * inter or db.shape != (gub.shape[0], H):
        raise KernelInputError(f"the form's biases do not fit: gate_up_bias {tuple(gub.shape)} (want (E, {2 * inter})), "
                               f"down_bias {tuple(db.shape)} (want (E, {H}))")
    if (not gub.is_cpu or not db.is_cpu or gub.dtype not in _DTYPES or db.dtype != gub.dtype
            or gub.stride(1) != 1 or db.stride(1) != 1):
        raise KernelInputError(f"the form's biases must be CPU tensors of one fp32/bf16/fp16 dtype with unit stride "
                               f"per row, got {gub.dtype} on {gub.device} and {db.dtype} on {db.device}")


def _check_ids(form: ClampedSwiGLU, lo: int, hi: int) -> None:
    if lo < 0 or hi >= form.gate_up_bias.shape[0]:
        raise KernelInputError(f"expert ids {lo}…{hi} outside the form's {form.gate_up_bias.shape[0]} experts")


def _bias_addresses(form: ClampedSwiGLU, ids: np.ndarray) -> np.ndarray:
    """ids (J,) int64 → (J, 2) int64: each expert's gate_up and down bias addresses."""
    gub, db = form.gate_up_bias, form.down_bias
    biases = np.empty((len(ids), 2), dtype=np.int64)
    biases[:, 0] = gub.data_ptr() + ids * (gub.stride(0) * gub.element_size())
    biases[:, 1] = db.data_ptr() + ids * (db.stride(0) * db.element_size())
    return biases


def expert_ffn(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, *, out: torch.Tensor | None = None,
               threads: int | None = None, form: ClampedSwiGLU | None = None, expert: int = 0) -> torch.Tensor:
    """x: (n, H); gate_up: (2·I, H); down: (H, I) → y (n, H) in x's dtype (written into `out` if given).
    form: the experts' biases and clamped activation (gpt-oss), of which this is expert `expert`."""
    for name, t in (("x", x), ("gate_up", gate_up), ("down", down)):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dtype not in _DTYPES or t.dim() != 2:
            raise KernelInputError(f"{name} must be a 2-D fp32/bf16/fp16 CPU tensor, got "
                                   f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    n, H = x.shape
    two_i = gate_up.shape[0]
    if gate_up.shape[1] != H or two_i % 2 or down.shape != (H, two_i // 2):
        raise KernelInputError(f"expert shapes do not fit: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)} "
                               f"(want (2I, {H})), down {tuple(down.shape)} (want ({H}, I))")
    if gate_up.dtype != down.dtype:
        raise KernelInputError(f"gate_up is {gate_up.dtype} but down is {down.dtype}")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device.type != "cpu"
                            or out.stride(1) != 1):
        raise KernelInputError(f"out must be a CPU {x.dtype} tensor of shape {tuple(x.shape)} with unit stride per row")
    inter = two_i // 2
    if form is not None:
        _check_form(form, H, inter)
        _check_ids(form, expert, expert)
    nat = native.module()
    if (nat is None or n > _native_max_tokens or H % 16 or inter % 16
            or gate_up.stride(1) != 1 or down.stride(1) != 1):
        xw = x.to(gate_up.dtype)
        y = (expert_ffn_torch(xw, gate_up, down) if form is None else form.ffn(xw, expert, gate_up, down)).to(x.dtype)
        return out.copy_(y) if out is not None else y
    if x.stride(1) != 1:
        x = x.contiguous()  # (n, H): activations are small; weights are never copied
    y = out if out is not None else torch.empty_like(x, memory_format=torch.contiguous_format)
    code = native.DTYPE_CODES
    args = (x.data_ptr(), code[x.dtype], n, H, inter, x.stride(0), gate_up.data_ptr(), down.data_ptr(),
            code[gate_up.dtype], gate_up.stride(0), down.stride(0), y.data_ptr(), code[y.dtype], y.stride(0),
            threads or native.threads())
    if form is None:
        nat.expert_ffn(*args)
    else:
        gub, db = form.gate_up_bias, form.down_bias
        nat.expert_ffn(*args, _CLAMPED_SWIGLU, form.alpha, form.limit,
                       gub.data_ptr() + expert * gub.stride(0) * gub.element_size(),
                       db.data_ptr() + expert * db.stride(0) * db.element_size(), code[gub.dtype])
    return y


def _pair_array(name: str, j: int, value, dtype: np.dtype, kind: str) -> np.ndarray:
    """tokens[j] / weights[j] (a 1-D CPU tensor, array or sequence) as a contiguous numpy array."""
    if type(value) is np.ndarray and value.dtype == dtype and value.ndim == 1 and value.flags.c_contiguous:
        return value  # the common case, without numpy's conversion calls
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise KernelInputError(f"{name}[{j}] must be on the CPU, got {value.device}")
        value = value.detach()
        value = value.to(torch.float32) if kind == "f" and value.is_floating_point() else value
        value = value.numpy()
    arr = np.asarray(value)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in (("i", "u") if kind == "i" else ("f",))):
        raise KernelInputError(f"{name}[{j}] must be a 1-D {'integer' if kind == 'i' else 'float'} array, "
                               f"got {arr.dtype} of shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype=dtype)


def moe_ffn(x: torch.Tensor, experts, tokens, weights, *, threads: int | None = None,
            out: torch.Tensor | None = None, form: ClampedSwiGLU | None = None, expert_ids=None) -> torch.Tensor:
    """x: (N, H); experts: J pairs (gate_up (2I, H), down (H, I)) of one dtype; tokens[j]: int rows of x
    routed to expert j; weights[j]: their routing weights (same length) → out (N, H) float32 with
    out[t] = Σ_j Σ_{i: tokens[j][i] = t} weights[j][i] · expert_j(x[t]); rows no pair names are 0.
    form: the layer's expert biases and clamped activation (gpt-oss), expert j being expert_ids[j] of it."""
    return prepare_moe(x, experts, tokens, weights, threads=threads, out=out, form=form, expert_ids=expert_ids)()


def prepare_moe(x: torch.Tensor, experts, tokens, weights, *, threads: int | None = None,
                out: torch.Tensor | None = None, form: ClampedSwiGLU | None = None,
                expert_ids=None) -> "PreparedMoe":
    """moe_ffn in two halves: the checks and the native call's tables now, on this thread; the compute
    when the returned PreparedMoe is called (from a worker: the native call holds the GIL only to
    start, so a worker that only computes does not contend with the thread that prepared it), or
    handed to a MoeWorker."""
    if not isinstance(x, torch.Tensor) or not x.is_cpu or x.dtype not in _DTYPES or x.dim() != 2:
        raise KernelInputError(f"x must be a 2-D fp32/bf16/fp16 CPU tensor, got "
                               f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    N, H = x.shape
    J = len(experts)
    if len(tokens) != J or len(weights) != J:
        raise KernelInputError(f"{J} experts but {len(tokens)} token lists and {len(weights)} weight lists")
    if out is None:
        out = torch.empty(N, H, dtype=torch.float32)
    elif (not isinstance(out, torch.Tensor) or out.shape != (N, H) or out.dtype != torch.float32
          or not out.is_cpu or out.stride(1) != 1):
        raise KernelInputError(f"out must be a CPU float32 tensor of shape {(N, H)} with unit stride per row")
    if form is not None and (expert_ids is None or len(expert_ids) != J):
        raise KernelInputError(f"a form needs the id of each of the {J} experts (expert_ids)")
    if J == 0:
        return PreparedMoe(out, None, [], x, experts, [], [], None)
    first = experts[0][0]  # experts[0]'s gate_up sets the shapes and dtype every expert must have
    two_i, w_dtype = (first.shape[0], first.dtype) if isinstance(first, torch.Tensor) else (0, None)
    inter = two_i // 2
    # Checked per expert on every layer of every step: cheap attribute reads only (t.device costs 0.4 µs).
    rows, unit_stride = [], True  # rows: the native table (gate_up ptr, down ptr, row strides)
    for j, pair in enumerate(experts):
        gate_up, down = pair
        for name, t in (("gate_up", gate_up), ("down", down)):
            if not isinstance(t, torch.Tensor) or not t.is_cpu or t.dtype not in _DTYPES or t.dim() != 2:
                raise KernelInputError(f"experts[{j}] {name} must be a 2-D fp32/bf16/fp16 CPU tensor, got "
                                       f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        if gate_up.shape != (two_i, H) or down.shape != (H, inter) or two_i == 0 or two_i % 2:
            raise KernelInputError(f"experts[{j}] shapes do not fit: gate_up {tuple(gate_up.shape)} (want "
                                   f"(2I, {H}) with experts[0]'s 2I = {two_i}), down {tuple(down.shape)} "
                                   f"(want ({H}, {inter}))")
        if gate_up.dtype != w_dtype or down.dtype != w_dtype:
            raise KernelInputError(f"experts[{j}] is {gate_up.dtype}/{down.dtype} but experts[0] is {w_dtype}")
        (gu_row, gu_col), (dn_row, dn_col) = gate_up.stride(), down.stride()
        unit_stride = unit_stride and gu_col == 1 and dn_col == 1
        rows.append((gate_up.data_ptr(), down.data_ptr(), gu_row, dn_row))
    if form is not None:
        _check_form(form, H, inter)
        ids = np.asarray(expert_ids, dtype=np.int64)  # (J,)
        if J:
            _check_ids(form, int(ids.min()), int(ids.max()))
    tok = [_pair_array("tokens", j, t, np.int64, "i") for j, t in enumerate(tokens)]
    wts = [_pair_array("weights", j, w, np.float32, "f") for j, w in enumerate(weights)]
    sizes = [t.size for t in tok]
    for j, (n, w) in enumerate(zip(sizes, wts)):
        if n != w.size:
            raise KernelInputError(f"expert {j} has {n} tokens but {w.size} weights")
    flat_tok = np.concatenate(tok)  # (pairs,): one range check for all (per-expert numpy calls cost µs each)
    if flat_tok.size and (flat_tok.min() < 0 or flat_tok.max() >= N):
        j = next(j for j, t in enumerate(tok) if t.size and (t.min() < 0 or t.max() >= N))
        raise KernelInputError(f"tokens[{j}] has a row outside [0, {N}): {tok[j].min()}…{tok[j].max()}")

    nat = native.module()
    use_native = nat is not None and unit_stride and H % 16 == 0 and inter % 16 == 0
    # The native call takes the experts with at most native_max_tokens tokens (above it torch's kernel wins).
    on_native = [use_native and n <= _native_max_tokens for n in sizes]
    native_args = None
    if any(on_native):
        if all(on_native):
            sel, flat_w = range(J), np.concatenate(wts)
        else:
            sel = [j for j in range(J) if on_native[j]]
            flat_tok, flat_w = np.concatenate([tok[j] for j in sel]), np.concatenate([wts[j] for j in sel])
        table = np.array([rows[j] + (sizes[j],) for j in sel], dtype=np.int64)  # (J', 5)
        if x.stride(1) != 1:
            x = x.contiguous()  # (N, H): activations are small; weights are never copied
        code = native.DTYPE_CODES
        native_args = (x.data_ptr(), code[x.dtype], N, H, inter, x.stride(0), code[w_dtype], table, flat_tok, flat_w,
                       out.data_ptr(), out.stride(0), threads or native.threads())
        if form is not None:  # + (biases (J', 2), act, alpha, limit, bias dtype)
            native_args += (_bias_addresses(form, ids if len(sel) == J else ids[sel]), _CLAMPED_SWIGLU,
                            form.alpha, form.limit, code[form.gate_up_bias.dtype])
    on_torch = [j for j in range(J) if not on_native[j] and tok[j].size]  # the reference kernel per expert
    return PreparedMoe(out, native_args, on_torch, x, experts, tok, wts, w_dtype, form, expert_ids)


def prepare_moe_table(x: torch.Tensor, table: np.ndarray, tokens: np.ndarray, weights: np.ndarray, inter: int,
                      w_dtype: torch.dtype, *, out: torch.Tensor, threads: int | None = None) -> "PreparedMoe | None":
    """prepare_moe for experts given as the native call's table: int64 (J, 5) rows (gate_up address,
    down address, their row strides in elements, pairs), with the pairs grouped by expert in `tokens`
    (int64) and `weights` (fp32). For a caller that owns the weights' memory (the expert store) and
    builds the table without a tensor view per expert. None when the native kernel does not take
    this set (no extension, shapes it does not cover, an expert above native_max_tokens): then use
    prepare_moe. The native binding checks the table, counts and token rows."""
    nat = native.module()
    if (nat is None or x.dim() != 2 or not x.is_cpu or x.dtype not in _DTYPES or x.stride(1) != 1
            or w_dtype not in _DTYPES or table.ndim != 2 or table.shape[1] != 5 or not len(table)
            or int(table[:, 4].max()) > _native_max_tokens):
        return None
    N, H = x.shape
    if H % 16 or inter % 16:
        return None
    if out.shape != (N, H) or out.dtype != torch.float32 or not out.is_cpu or out.stride(1) != 1:
        raise KernelInputError(f"out must be a CPU float32 tensor of shape {(N, H)} with unit stride per row")
    code = native.DTYPE_CODES
    args = (x.data_ptr(), code[x.dtype], N, H, inter, x.stride(0), code[w_dtype], table, tokens, weights,
            out.data_ptr(), out.stride(0), threads or native.threads())
    return PreparedMoe(out, args, [], x, None, [], [], w_dtype)


def prepare_routed(x: torch.Tensor, rows: np.ndarray, chosen: np.ndarray, ids: np.ndarray, route_weights: torch.Tensor,
                   inter: int, w_dtype: torch.dtype, *, out: torch.Tensor,
                   threads: int | None = None) -> "RoutedMoe | None":
    """A decode layer's CPU set for the native worker, given as the layer's routing: rows (E, 5) int64,
    the table rows of every expert of the layer (addresses, strides); chosen (J,) int64, the experts
    the CPU computes; ids (N, k) int64 and route_weights (N, k) the routing. The worker's module groups
    the pairs in C++ (native/routed_set.h) instead of numpy here; the result equals prepare_moe_table's
    bit for bit. None where that path does not take the set (no extension or worker, shapes it does
    not cover, more tokens than native_max_tokens): then use prepare_moe_table."""
    nat = native.module()
    if (nat is None or not hasattr(nat, "MoeWorker") or not hasattr(nat.MoeWorker, "submit_routed")
            or x.dim() != 2 or not x.is_cpu or x.dtype not in _DTYPES or x.stride(1) != 1
            or w_dtype not in _DTYPES or route_weights.dtype not in _DTYPES or not route_weights.is_cpu):
        return None
    N, H = x.shape
    if H % 16 or inter % 16 or N > _native_max_tokens or not len(chosen) or ids.shape[0] != N:
        return None  # an expert has at most N pairs (top-k choices are distinct): N bounds its tokens
    if out.shape != (N, H) or out.dtype != torch.float32 or not out.is_cpu or out.stride(1) != 1:
        raise KernelInputError(f"out must be a CPU float32 tensor of shape {(N, H)} with unit stride per row")
    route_weights = route_weights.contiguous()  # (N, k), read through its address
    code = native.DTYPE_CODES
    args = (x.data_ptr(), code[x.dtype], N, H, inter, x.stride(0), code[w_dtype], rows, chosen, ids,
            route_weights.data_ptr(), code[route_weights.dtype], out.data_ptr(), out.stride(0),
            threads or native.threads())
    return RoutedMoe(out, args, x, route_weights)


class PreparedMoe:
    """One MoE layer's CPU set, checked and built (prepare_moe, prepare_moe_table); calling it computes
    the set on the calling thread and returns `out` (N, H) fp32. `one_native_call`: the whole set is
    one native call, which `MoeWorker` can run on a thread with no Python on it."""

    def __init__(self, out, native_args, on_torch, x, experts, tokens, weights, w_dtype, form=None, expert_ids=None):
        # the args hold x, the table, the pair arrays and the bias addresses alive; the form holds the biases
        self.out, self.native_args = out, native_args
        self._on_torch, self._x, self._experts = on_torch, x, experts
        self._tokens, self._weights, self._w_dtype = tokens, weights, w_dtype
        self._form, self._expert_ids = form, expert_ids

    @property
    def one_native_call(self) -> bool:
        return self.native_args is not None and not self._on_torch

    def __call__(self) -> torch.Tensor:
        if self.native_args is not None:
            native.module().moe_ffn(*self.native_args)
        else:
            self.out.zero_()
        self._add_torch_part()
        return self.out

    def start(self, worker) -> None:
        """Hand the set to the native worker (native/moe_worker.h)."""
        worker.submit(*self.native_args)

    def _add_torch_part(self) -> None:
        """Experts above native_max_tokens, through the reference kernel, added into out."""
        for j in self._on_torch:
            gate_up, down = self._experts[j]
            idx = torch.from_numpy(self._tokens[j])
            xj = self._x[idx].to(self._w_dtype)
            y = (expert_ffn_torch(xj, gate_up, down) if self._form is None
                 else self._form.ffn(xj, int(self._expert_ids[j]), gate_up, down)).float()  # (n, H)
            self.out.index_add_(0, idx, y * torch.from_numpy(self._weights[j]).unsqueeze(1))


class RoutedMoe:
    """A CPU set given as the layer's routing (prepare_routed): one native call that only the native
    worker runs (`MoeWorker.submit` hands it over with `submit_routed`)."""

    one_native_call = True

    def __init__(self, out, routed_args, x, route_weights):
        self.out, self.routed_args = out, routed_args
        # read through their addresses: x until the worker is done, the weights until the submit copies them
        self._keep = (x, route_weights)

    def __call__(self) -> torch.Tensor:
        raise RuntimeError("a routed CPU set runs on the native worker (MoeWorker.submit)")

    def start(self, worker) -> None:
        """Hand the set to the native worker (native/moe_worker.h)."""
        worker.submit_routed(*self.routed_args)


class MoeWorker:
    """The native worker thread (native/moe_worker.h): runs a PreparedMoe that is one native call with
    no Python on its thread, so handing it over and collecting it moves no GIL. `create()` is None
    without the extension."""

    def __init__(self, worker):
        self._worker, self._job = worker, None

    @classmethod
    def create(cls) -> "MoeWorker | None":
        nat = native.module()
        return cls(nat.MoeWorker()) if nat is not None and hasattr(nat, "MoeWorker") else None

    def submit(self, prepared) -> None:
        """prepared: a set that is one native call (PreparedMoe, RoutedMoe, quant.moe.QuantMoe): its
        `start` hands it to the worker."""
        if not prepared.one_native_call:
            raise ValueError("the native worker runs sets that are one native call (PreparedMoe.one_native_call)")
        prepared.start(self._worker)
        self._job = prepared  # keeps x, the table and the pair arrays alive while the worker reads them

    def wait(self) -> tuple[torch.Tensor, float, float]:
        """→ (out, seconds from submit to start, seconds computing)."""
        try:
            queue_s, compute_s = self._worker.wait()
        finally:
            job, self._job = self._job, None
        return job.out, queue_s, compute_s

    def close(self) -> None:
        if self._job is not None:  # the worker may still read the job's arrays
            self.wait()
        self._worker = None


def __getattr__(name: str):
    # IMPLEMENTATION: the kernel at decode sizes, as a plain name for stats (read when asked, so it
    # stays true if the extension is hidden or the crossover moves).
    if name == "IMPLEMENTATION":
        return implementation(1)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
