"""What vLLM's KV cache tensors look like to kvflow: the layout a rank's handshake offers, read
from the tensors' shapes and strides (and, where those cannot tell, the attention backend's
name), and the memory each layer's tensor holds, registered in place.

The shapes kvflow describes, per layer (``nb`` blocks of ``bs`` tokens, ``h`` KV heads of
this rank, ``d`` elements a head):

- vLLM's CPU attention: ``(nb, h, bs, 2 * d)`` in host memory, each head's K (transposed) then
  its V inside a block: kvflow's ``FusedKv``, moved in whole blocks.
- vLLM 0.33's caches on a GPU: a layer's view ``(nb, h, bs, 2 * d)``, each head's token its K
  then its V, in the physical order vLLM's KV cache layout gives: ``PackedKv``, ``Hnd`` for
  ``HND`` (``LBHNC``), ``Nhd`` for ``NHD`` (``LBNHC``); layouts whose blocks interleave the
  layers are refused.
- FlashAttention (and the backends that share its shape): ``(2, nb, bs, h, d)``, every
  block's K then every block's V: ``SplitKv`` in ``LayerPlaneMajor`` placement, ``Nhd`` as
  allocated, ``Hnd`` when vLLM's KV cache layout is HND (a permuted view, whose strides say so).
- FlashInfer: ``(nb, 2, bs, h, d)``, each block's K then its V: ``SplitKv``, ``LayerMajor``,
  ``Nhd`` or ``Hnd`` by the strides.
- MLA: ``(nb, bs, d)``, or vLLM 0.33's ``(nb, 1, bs, d)``, one latent plane replicated on every
  rank: ``Mla`` (``mla`` says so).

Anything else is refused with an error that names the shape, strides and backend.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

DTYPES = {
    "torch.float32": "float32",
    "torch.bfloat16": "bfloat16",
    "torch.float16": "float16",
    "torch.float8_e4m3fn": "fp8_e4m3",
    "torch.float8_e5m2": "fp8_e5m2",
}


@dataclasses.dataclass
class Described:
    """A rank's pool as kvflow's native ``Rank`` takes it."""

    layout: dict[str, Any]
    num_blocks: int
    # (address, bytes) of each layer's tensor, in layer order.
    regions: list[tuple[int, int]]
    # The GPU ordinal of CUDA tensors; None for host memory.
    device: int | None


def _contiguous(shape) -> list[int]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return list(reversed(strides))


def _order(shape, stride, what: str) -> str:
    """``Nhd`` or ``Hnd`` for a block's ``(bs, h, d)`` dims (the last three), by their strides."""
    bs, h, d = shape[-3:]
    s_token, s_head, s_dim = stride[-3:]
    if s_dim == 1 and s_head == d and s_token == h * d:
        return "Nhd"
    if s_dim == 1 and s_token == d and s_head == bs * d:
        return "Hnd"
    raise ValueError(f"{what}: its tokens, heads and elements are neither NHD nor HND in memory")


def describe(
    kv_caches: dict[str, Any], tp: int, total_kv_heads: int | None = None, backend: str | None = None, mla: bool = False
) -> Described:
    """The layout and memory of one rank's KV cache (``kv_caches``: vLLM's tensor per layer,
    in layer order) in an engine of ``tp`` TP ranks whose model has ``total_kv_heads`` KV
    heads (the rank's heads times ``tp`` if not given) and uses MLA if ``mla``; ``backend`` is
    the attention backend's name, which decides only where the shape alone cannot. Raises
    ``ValueError`` naming what it cannot describe."""
    if not kv_caches:
        raise ValueError("kvflow: no KV cache tensors to register")
    names, layers = list(kv_caches), list(kv_caches.values())
    first = layers[0]
    shape, stride = tuple(first.shape), tuple(first.stride())
    what = f"kvflow: a KV cache of shape {shape}, strides {stride}, {first.dtype} on {first.device} (backend {backend or 'unknown'})"
    for name, tensor in zip(names[1:], layers[1:]):
        if (tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device) != (shape, stride, first.dtype, first.device):
            raise ValueError(
                f"kvflow: layer {name} is {tuple(tensor.shape)}, strides {tuple(tensor.stride())}, {tensor.dtype} on "
                f"{tensor.device}, unlike layer {names[0]}: every layer must be alike"
            )
    dtype = DTYPES.get(str(first.dtype))
    if dtype is None:
        raise ValueError(f"{what}: kvflow moves {sorted(DTYPES)} only")
    if first.device.type == "cuda":
        device = first.device.index or 0
    elif first.device.type == "cpu":
        device = None
    else:
        raise ValueError(f"{what}: kvflow registers host memory and CUDA memory only")
    name = (backend or "").upper()
    layout: dict[str, Any] = {"layers": len(layers), "dtype": dtype}
    if mla:
        # One latent plane: (nb, bs, d), or vLLM 0.33's (nb, 1, bs, d).
        if len(shape) == 4 and shape[1] == 1:
            shape, stride = (shape[0], shape[2], shape[3]), (stride[0], stride[2], stride[3])
        if len(shape) != 3 or list(stride) != _contiguous(shape):
            raise ValueError(f"{what}: an MLA cache is described as (blocks, block size, latent), contiguous")
        nb, bs, d = shape
        h = 1
        layout |= {"block_tokens": bs, "head_dim": d, "attention": "Mla", "order": "Hnd", "placement": "LayerMajor"}
    elif len(shape) == 4 and device is None:
        # vLLM's CPU attention.
        nb, h, bs, twice_d = shape
        if list(stride) != _contiguous(shape) or twice_d % 2:
            raise ValueError(f"{what}: a 4-dimensional cache in host memory is described only as vLLM's CPU attention keeps it, contiguous")
        layout |= {"block_tokens": bs, "head_dim": twice_d // 2, "attention": "FusedKv", "order": "Hnd", "placement": "LayerMajor"}
    elif len(shape) == 4:
        # vLLM 0.33: (blocks, heads, tokens, K then V), in its layout's physical order.
        nb, h, bs, c = shape
        s_block, s_head, s_token, s_content = stride
        if c % 2 or s_content != 1:
            raise ValueError(f"{what}: each head's token must hold its K then its V, contiguous")
        if s_token == c and s_head == bs * c and s_block == h * bs * c:
            order = "Hnd"
        elif s_head == c and s_token == h * c and s_block == bs * h * c:
            order = "Nhd"
        else:
            raise ValueError(
                f"{what}: its blocks are neither HND nor NHD, one after another (layouts that interleave layers are not "
                "described: set VLLM_KV_CACHE_LAYOUT=HND or NHD)"
            )
        layout |= {"block_tokens": bs, "head_dim": c // 2, "attention": "PackedKv", "order": order, "placement": "LayerMajor"}
    elif len(shape) == 5:
        flashinfer = "FLASHINFER" in name
        if shape[0] == 2 and shape[1] == 2 and not backend:
            raise ValueError(f"{what}: with 2 blocks the shape alone cannot say whether K and V or blocks come first")
        planes_outer = shape[0] == 2 and not (flashinfer and shape[1] == 2)
        if planes_outer:
            _, nb, bs, h, d = shape
            placement, s_plane, s_block = "LayerPlaneMajor", stride[0], stride[1]
            planes_ok = s_block == bs * h * d and s_plane == nb * bs * h * d
        elif shape[1] == 2:
            nb, _, bs, h, d = shape
            placement, s_plane, s_block = "LayerMajor", stride[1], stride[0]
            planes_ok = s_plane == bs * h * d and s_block == 2 * bs * h * d
        else:
            raise ValueError(f"{what}: a 5-dimensional cache has K and V (2) first or second")
        if not planes_ok:
            raise ValueError(f"{what}: its blocks and K/V planes are not laid out one after another")
        layout |= {"block_tokens": bs, "head_dim": d, "attention": "SplitKv", "order": _order(shape, stride, what), "placement": placement}
    else:
        raise ValueError(f"{what}: kvflow describes vLLM's CPU attention, FlashAttention, FlashInfer, vLLM 0.33's and MLA caches")
    layout["kv_heads"] = 1 if layout["attention"] == "Mla" else (total_kv_heads or h * tp)
    size = math.prod(first.shape) * first.element_size()
    regions = [(tensor.data_ptr(), size) for tensor in layers]
    return Described(layout=layout, num_blocks=nb, regions=regions, device=device)
