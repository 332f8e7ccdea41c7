"""Turn a checkpoint's tensors into a placed `Decoder`: shape checks, tying, device placement.

Modules are built on the meta device and take the checkpoint's tensors by assignment, so no
random initialisation is ever paid for. Routed expert tensors are not module parameters: they go
to the expert executor the caller makes (`make_experts(gate_up, down)`, lists over the MoE layers
in order — `args.moe_layer_ids()`; a model with dense layers between them passes fewer entries
than it has layers, and `MoEFeedForward.expert_layer` indexes these lists). Tensors already on the
target device in the target dtype (synthetic models generate them there) are taken as they are.
Quantised blocks (engine/quant: `QuantTensor`, `QuantStack`) stay blocks, their layers becoming
`QuantLinear`/`QuantEmbedding`: on the CPU in place, on a GPU copied there (its Triton kernels read
them; stacked routed experts reach make_experts as read, for the executor over blocks), dequantised
where no GPU kernel takes them.
"""

from __future__ import annotations

import torch

from engine.errors import ModelFileError
from engine.kernels import quant_linear_gpu
from engine.models.common import Decoder, FeedForward, ModelArgs
from engine.models.moe_ffn import MoEFeedForward
from engine.quant import modules as quant_modules
from engine.quant.blocks import QuantStack, QuantTensor


def place_tensor(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A real copy on an accelerator; on the host, keep storage (and shared views) where possible."""
    if isinstance(t, (QuantTensor, QuantStack)):
        if device.type == "cpu":
            return t  # computed over in blocks (engine/quant)
        if device.type == "cuda" and quant_linear_gpu.works(device):  # the GPU's kernels read the blocks
            # a matrix goes to the device as it is (engine/kernels/quant_linear_gpu.py); stacked experts stay
            # as read for the resident executor, which lays them out in one device pool (resident_experts)
            return t.to(device) if isinstance(t, QuantTensor) else t
        t = t.dequantize(dtype)
    same_device = t.device.type == device.type and device.index in (None, t.device.index)
    if same_device and t.dtype == dtype:
        return t  # already placed (generated in place)
    if device.type == "cpu":
        return t.to(dtype)
    return torch.empty(t.shape, device=device, dtype=dtype).copy_(t)


def assemble(args: ModelArgs, tensors: dict[str, torch.Tensor], route, *, source: str,
             device: torch.device, dtype: torch.dtype, make_experts=None, place_experts: bool = True) -> Decoder:
    """place_experts=False hands the routed expert tensors to make_experts as read (host, file dtype)
    for an executor that lays them out itself (the offloading store)."""
    moe_layers = args.moe_layer_ids()
    expert_layer = {layer: j for j, layer in enumerate(moe_layers)}  # decoder layer → executor index

    def make_mlp(i: int):
        if i in expert_layer:
            return MoEFeedForward(args, i, route, expert_layer[i])
        return FeedForward(args.dim, args.ffn_dim)

    with torch.device("meta"):
        model = decoder_class(args)(args, make_mlp)
    tensors = dict(tensors)
    tied = args.tie_embeddings or "lm_head.weight" not in tensors  # a file without an output layer ties it
    if tied:
        tensors["lm_head.weight"] = tensors.get("model.embed_tokens.weight")

    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    gate_up, down = [], []
    if args.is_moe:
        E, I, H = args.n_experts, args.expert_ffn_dim, args.dim
        for i in moe_layers:
            gu = tensors.pop(f"model.layers.{i}.mlp.experts.gate_up_proj", None)
            dn = tensors.pop(f"model.layers.{i}.mlp.experts.down_proj", None)
            _check(source, f"model.layers.{i}.mlp.experts.gate_up_proj", gu, (E, 2 * I, H))
            _check(source, f"model.layers.{i}.mlp.experts.down_proj", dn, (E, H, I))
            gate_up.append(place_tensor(gu, device, dtype) if place_experts else gu)
            down.append(place_tensor(dn, device, dtype) if place_experts else dn)

    for name, shape in expected.items():
        _check(source, name, tensors.get(name), shape)
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise ModelFileError(f"{source}: unexpected tensors {unexpected[:4]}{' …' if len(unexpected) > 4 else ''}",
                             "the file does not match its declared architecture")
    moved: dict[int, torch.Tensor] = {}  # one placed copy per tensor object: a tied head shares the embedding's

    def place(t):
        if id(t) not in moved:
            moved[id(t)] = place_tensor(t, device, dtype)
        return moved[id(t)]

    placed = {name: place(tensors[name]) for name in expected}
    blocks = {name: t for name, t in placed.items() if isinstance(t, QuantTensor)}
    model.load_state_dict({n: t for n, t in placed.items() if n not in blocks}, assign=True, strict=not blocks)
    quant_modules.install(model, blocks, dtype)  # a tied head shares the embedding's blocks
    for layer in model.model.layers:
        attn = getattr(layer, "self_attn", None)  # (a hybrid model's linear-attention layers have none)
        if attn is not None:
            attn.fuse_qkv()  # q, k, v projected by one product (views or QuantRows: no memory added)
        mlp = getattr(layer, "mlp", None)
        for ffn in (mlp, getattr(mlp, "shared_experts", None)):  # a dense FFN, or a MoE layer's shared expert
            if isinstance(ffn, FeedForward):
                ffn.fuse_gate_up()
    if tied and "model.embed_tokens.weight" not in blocks:  # one tensor, not a second copy on the device
        model.lm_head.weight = model.model.embed_tokens.weight
    model.init_rope(args.max_position, device, dtype)
    if args.is_moe:
        executor = make_experts(gate_up, down)
        for i in moe_layers:
            model.model.layers[i].mlp.experts = executor
    model.eval()
    return model


def decoder_class(args: ModelArgs):
    """The family's own decoder where it has one (`Model`: Qwen3.5's hybrid blocks), else the common one."""
    from engine.models import families  # (families imports the family files, which import this floor)

    family = families.FAMILIES.get(args.arch)
    return getattr(family, "Model", Decoder)


def _check(source: str, name: str, t: torch.Tensor | None, shape: tuple) -> None:
    if t is None:
        raise ModelFileError(f"{source}: tensor {name} is missing", "the file is incomplete or of another architecture")
    if tuple(t.shape) != tuple(shape):
        raise ModelFileError(f"{source}: tensor {name} has shape {tuple(t.shape)}, the config needs {tuple(shape)}",
                             "the weights do not match the config: re-download or re-convert the model")


def tensor_shapes(args: ModelArgs) -> dict[str, tuple]:
    """Every tensor a checkpoint of `args` must provide, with its shape (experts fused per layer,
    no lm_head when the embeddings are tied): what `assemble` checks, for generators of weights."""
    moe_layers = args.moe_layer_ids()

    def make_mlp(i: int):
        return MoEFeedForward(args, i, route=None) if i in moe_layers else FeedForward(args.dim, args.ffn_dim)

    with torch.device("meta"):
        model = decoder_class(args)(args, make_mlp)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if args.tie_embeddings:
        shapes.pop("lm_head.weight")
    E, I, H = args.n_experts, args.expert_ffn_dim, args.dim
    for i in moe_layers:
        shapes[f"model.layers.{i}.mlp.experts.gate_up_proj"] = (E, 2 * I, H)
        shapes[f"model.layers.{i}.mlp.experts.down_proj"] = (E, H, I)
    return shapes
