"""The layouts kvflow reads from vLLM's KV cache tensors (their shapes and strides), and that
the bytes land where those layouts say: FlashAttention's tensors in NHD and HND, moved between
ranks of different TP sizes by kvflow's schedulers and NIXL ranks, as the connector drives them
(host memory here: a GPU's tensors differ only in where the memory is)."""

import json

import pytest
import torch

from conftest import RANK_CONFIG, carry
from kvflow import _kvflow as native
from kvflow.layout import Described, describe

pytestmark = pytest.mark.usefixtures("nixl")

def flash(blocks, tokens, heads, dim, hnd=False, dtype=torch.float16):
    """A FlashAttention layer tensor, ``(2, blocks, tokens, heads, dim)``: as allocated (NHD),
    or a view of ``(2, blocks, heads, tokens, dim)`` memory (HND), as vLLM makes them."""
    if hnd:
        return torch.zeros(2, blocks, heads, tokens, dim, dtype=dtype).permute(0, 1, 3, 2, 4)
    return torch.zeros(2, blocks, tokens, heads, dim, dtype=dtype)


def test_layouts_are_read_from_shapes_and_strides():
    nhd = describe({"a": flash(10, 16, 2, 8), "b": flash(10, 16, 2, 8)}, tp=2, total_kv_heads=4)
    assert nhd.layout == {
        "layers": 2,
        "dtype": "float16",
        "block_tokens": 16,
        "head_dim": 8,
        "attention": "SplitKv",
        "order": "Nhd",
        "placement": "LayerPlaneMajor",
        "kv_heads": 4,
    }
    assert (nhd.num_blocks, nhd.device, [size for _, size in nhd.regions]) == (10, None, [2 * 10 * 16 * 2 * 8 * 2] * 2)
    layer = flash(10, 16, 2, 8, hnd=True)
    hnd = describe({"a": layer}, tp=1)
    assert (hnd.layout["order"], hnd.layout["placement"], hnd.layout["kv_heads"]) == ("Hnd", "LayerPlaneMajor", 2)
    assert hnd.regions == [(layer.data_ptr(), layer.numel() * 2)]
    flashinfer = describe({"a": torch.zeros(10, 2, 16, 2, 8, dtype=torch.bfloat16)}, tp=1)
    assert (flashinfer.layout["placement"], flashinfer.layout["order"], flashinfer.layout["dtype"]) == ("LayerMajor", "Nhd", "bfloat16")
    cpu = describe({"a": torch.zeros(10, 2, 128, 64)}, tp=1)
    assert (cpu.layout["attention"], cpu.layout["head_dim"], cpu.layout["block_tokens"]) == ("FusedKv", 32, 128)
    mla = describe({"a": torch.zeros(10, 64, 576, dtype=torch.bfloat16)}, tp=4, mla=True)
    assert (mla.layout["attention"], mla.layout["kv_heads"], mla.layout["head_dim"]) == ("Mla", 1, 576)
    mla = describe({"a": torch.zeros(10, 1, 64, 576, dtype=torch.bfloat16)}, tp=4, mla=True)
    assert (mla.layout["attention"], mla.layout["block_tokens"], mla.num_blocks) == ("Mla", 64, 10)
    # Two blocks: only the backend's name says which comes first.
    with pytest.raises(ValueError, match="cannot say"):
        describe({"a": flash(2, 16, 2, 8)}, tp=1)
    assert describe({"a": flash(2, 16, 2, 8)}, tp=1, backend="FLASH_ATTN").layout["placement"] == "LayerPlaneMajor"
    assert describe({"a": flash(2, 16, 2, 8)}, tp=1, backend="FLASHINFER").layout["placement"] == "LayerMajor"


class CudaView:
    """What describe reads of a CUDA tensor (none can be made without a GPU): vLLM 0.33's view
    of a layer, ``(blocks, heads, tokens, K then V)``, over memory in ``order``."""

    def __init__(self, blocks, heads, tokens, content, order):
        self.shape = (blocks, heads, tokens, content)
        inner = {"HND": (heads * tokens * content, tokens * content, content, 1), "NHD": (tokens * heads * content, content, heads * content, 1)}
        # Blocks that interleave the layers (vLLM's BLHNC): a block's stride spans every layer.
        inner["BLHNC"] = (4 * heads * tokens * content, tokens * content, content, 1)
        self._stride = inner[order]
        self.dtype = torch.bfloat16
        self.device = torch.device("cuda", 1)

    def stride(self):
        return self._stride

    def data_ptr(self):
        return 0x7F0000000000

    def element_size(self):
        return 2


def test_vllm_0_33_s_cuda_caches_are_packed_k_and_v_in_its_layout_s_order():
    hnd = describe({"a": CudaView(100, 2, 16, 256, "HND")}, tp=4, total_kv_heads=8)
    assert hnd.layout == {
        "layers": 1,
        "dtype": "bfloat16",
        "block_tokens": 16,
        "head_dim": 128,
        "attention": "PackedKv",
        "order": "Hnd",
        "placement": "LayerMajor",
        "kv_heads": 8,
    }
    assert (hnd.device, hnd.num_blocks, hnd.regions) == (1, 100, [(0x7F0000000000, 100 * 2 * 16 * 256 * 2)])
    nhd = describe({"a": CudaView(100, 2, 16, 256, "NHD")}, tp=4, total_kv_heads=8)
    assert (nhd.layout["attention"], nhd.layout["order"]) == ("PackedKv", "Nhd")
    with pytest.raises(ValueError, match="VLLM_KV_CACHE_LAYOUT=HND or NHD"):
        describe({"a": CudaView(100, 2, 16, 256, "BLHNC")}, tp=4)


def test_what_kvflow_cannot_describe_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"shape \(2, 10, 16, 2, 8\), strides .*neither NHD nor HND"):
        describe({"a": torch.zeros(2, 10, 8, 16, 2).permute(0, 1, 3, 4, 2)}, tp=1)
    with pytest.raises(ValueError, match="layer b is"):
        describe({"a": flash(10, 16, 2, 8), "b": flash(10, 16, 2, 8, hnd=True)}, tp=1)
    with pytest.raises(ValueError, match="kvflow moves"):
        describe({"a": flash(10, 16, 2, 8, dtype=torch.int8)}, tp=1)
    with pytest.raises(ValueError, match="not laid out one after another"):
        describe({"a": torch.zeros(2, 20, 16, 2, 8)[:, ::2]}, tp=1)
    with pytest.raises(ValueError, match="K and V"):
        describe({"a": torch.zeros(3, 10, 16, 2, 8)}, tp=1)
    with pytest.raises(ValueError, match="FlashAttention"):
        describe({"a": torch.zeros(10, 16)}, tp=1)
    with pytest.raises(ValueError, match="FlashAttention"):
        describe({"a": torch.zeros(10, 64, 576)}, tp=1)
    with pytest.raises(ValueError, match="an MLA cache"):
        describe({"a": torch.zeros(10, 2, 64, 576)}, tp=1, mla=True)


def move(engine, p_pools, d_pool, p_blocks, d_blocks, prompt):
    """Exports `prompt` tokens in `p_blocks` of P (a rank per described pool of `p_pools`) and
    loads them into `d_blocks` of D (one rank, `d_pool`), as kvflow's schedulers and NIXL
    ranks do; asserts that the load is ready and P freed the export as transferred."""

    def rank(role, name, index, tp, described):
        layout, blocks = json.dumps(described.layout), described.num_blocks
        return native.Rank(role, name, 1, index, tp, layout, blocks, described.regions, "127.0.0.1:0", RANK_CONFIG, "tiny")

    p_ranks = [rank("prefill", f"{engine}-p", r, len(p_pools), pool) for r, pool in enumerate(p_pools)]
    d_ranks = [rank("decode", f"{engine}-d", 0, 1, d_pool)]
    try:
        p_scheduler = native.PrefillScheduler(p_ranks[0].offer(), [r.address() for r in p_ranks], RANK_CONFIG)
        d_scheduler = native.DecodeScheduler(f"{engine}-d", 1, RANK_CONFIG)
        d_scheduler.arrive("req-1", p_scheduler.finished(native.now_ns(), "req-1", p_blocks, prompt))
        d_scheduler.schedule("req-1", d_blocks)
        events = carry([(p_scheduler, p_ranks), (d_scheduler, d_ranks)], lambda ev: {w for w, _ in ev} >= {"free", "ended"})
        assert ("ended", ("req-1", "ready")) in events, events
        assert ("free", ("req-1", p_blocks, "transferred")) in events, events
    finally:
        for r in d_ranks + p_ranks:
            r.close()


@pytest.mark.parametrize("hnd", [False, True], ids=["nhd", "hnd"])
def test_flash_attention_kv_moves_from_p_at_tp_2_into_d_at_tp_1_byte_for_byte(hnd):
    """P at TP 2 (each rank half of 4 KV heads), D at TP 1, both in FlashAttention's layout:
    D's rank reads both P ranks' heads of every prompt block of both layers, K and V, into its
    own blocks, and P frees the export as transferred."""
    layers, blocks, tokens, dim, prompt = 2, 12, 16, 8, 40
    p_caches = [{f"l{i}": flash(blocks, tokens, 2, dim, hnd) for i in range(layers)} for _ in range(2)]
    for r, caches in enumerate(p_caches):
        for i, layer in enumerate(caches.values()):
            layer.copy_(torch.randn(layer.shape, generator=torch.Generator().manual_seed(10 * r + i)).to(layer.dtype))
    d_caches = {f"l{i}": flash(blocks, tokens, 4, dim, hnd) for i in range(layers)}
    p_blocks, d_blocks = [7, 2, 9], [1, 5, 11]
    move("flash", [describe(p_caches[r], 2, 4) for r in range(2)], describe(d_caches, 1, 4), p_blocks, d_blocks, prompt)
    for name, d_layer in d_caches.items():
        for i, (pb, db) in enumerate(zip(p_blocks, d_blocks)):
            held = min(tokens, prompt - i * tokens)
            for r in range(2):
                want = p_caches[r][name][:, pb, :held]
                assert torch.equal(d_layer[:, db, :held, 2 * r : 2 * r + 2], want), (name, i, r)
    untouched = [b for b in range(blocks) if b not in d_blocks]
    assert not any(d_layer[:, untouched].any() for d_layer in d_caches.values()), "bytes landed outside D's blocks"


@pytest.mark.parametrize("order", ["Hnd", "Nhd"])
def test_packed_kv_moves_from_p_at_tp_2_into_d_at_tp_1_across_block_sizes(order):
    """vLLM 0.33's packed K and V (each head's token its K then its V), from P at TP 2 with
    16-token blocks into D at TP 1 with 32-token ones (host tensors in that layout: no GPU
    here): every prompt token of every head lands where D's layout says."""
    layers, tokens, content, prompt = 2, 16, 16, 40

    def layer(blocks, heads, block_tokens):
        if order == "Hnd":
            return torch.zeros(blocks, heads, block_tokens, content, dtype=torch.float16)
        return torch.zeros(blocks, block_tokens, heads, content, dtype=torch.float16).permute(0, 2, 1, 3)

    def described(caches, heads, block_tokens):
        first = next(iter(caches.values()))
        layout = {
            "layers": layers, "dtype": "float16", "block_tokens": block_tokens, "head_dim": content // 2,
            "attention": "PackedKv", "order": order, "placement": "LayerMajor", "kv_heads": 4,
        }
        regions = [(t.data_ptr(), t.numel() * 2) for t in caches.values()]
        return Described(layout=layout, num_blocks=first.shape[0], regions=regions, device=None)

    p_caches = [{f"l{i}": layer(8, 2, tokens) for i in range(layers)} for _ in range(2)]
    for r, caches in enumerate(p_caches):
        for i, t in enumerate(caches.values()):
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(10 * r + i)).to(t.dtype))
    d_caches = {f"l{i}": layer(6, 4, 2 * tokens) for i in range(layers)}
    p_blocks, d_blocks = [5, 0, 3], [4, 1]
    p_pools = [described(p_caches[r], 2, tokens) for r in range(2)]
    move("packed", p_pools, described(d_caches, 4, 2 * tokens), p_blocks, d_blocks, prompt)
    for name, d_layer in d_caches.items():
        for position in range(prompt):
            p_block, d_block = p_blocks[position // tokens], d_blocks[position // (2 * tokens)]
            for r in range(2):
                want = p_caches[r][name][p_block, :, position % tokens]
                got = d_layer[d_block, 2 * r : 2 * r + 2, position % (2 * tokens)]
                assert torch.equal(got, want), (name, position, r)
