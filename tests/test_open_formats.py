"""A codec registered from outside the package runs end to end: config, page size, capacity, the
kernel registry (every operation falls to the torch path, with the reason) and a real CPU engine.

The codec here keeps per-token precision inside a fixed page, the shape ZipCache's salient tokens
need: every token at 4 bits (symmetric, per token and head), plus an 8-bit residual for the quarter
of the block's tokens whose 4-bit error is largest, with their indices. The test's reference is
causal attention over K/V put through this codec directly, block by block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from vllm_kvcompress.config import LayerFormat, LayerOverride, load_config
from vllm_kvcompress.engine_config import ModelKVShape, capacity_report
from vllm_kvcompress.formats import CODECS, KVPageFormat, TensorSpec, register_codec
from vllm_kvcompress.formats.layout import Regions
from vllm_kvcompress.formats.packing import pack, unpack
from vllm_kvcompress.kernels import registry
from vllm_kvcompress.policy import KernelPolicy


@dataclass(frozen=True)
class RefinedTokensCodec:
    """4-bit codes for every token, 8-bit residuals for ``block_size // 4`` of them."""
    block_size: int
    num_heads: int
    head_size: int

    name: ClassVar[str] = "test-refined-tokens"
    bits = 4

    @classmethod
    def from_spec(cls, spec: TensorSpec, dtype, block_size, num_heads, head_size):
        return cls(block_size, num_heads, head_size)

    @property
    def refined(self) -> int:
        return self.block_size // 4

    @property
    def regions(self) -> Regions:
        B, H, D, R = self.block_size, self.num_heads, self.head_size, self.refined
        return Regions([("low", B * H * D // 2), ("low_scale", B * H * 2), ("high", R * H * D), ("high_scale", R * H * 2),
                        ("index", R * 2)])

    @property
    def nbytes(self) -> int:
        return self.regions.nbytes

    def encode(self, x, num_valid, stored=None, num_stored=None):
        N, B, H, D = x.shape
        valid = torch.arange(B)[None, :] < num_valid[:, None]
        x = torch.where(valid[:, :, None, None], x.float(), 0)
        low_scale = (x.abs().amax(-1, keepdim=True) / 7).clamp_min(1e-6).half().float()
        low = torch.round(x / low_scale).clamp(-7, 7)
        error = x - low * low_scale
        index = torch.where(valid, error.norm(dim=(2, 3)), -1.0).topk(self.refined, dim=1).indices.sort(1).values
        residual = error.gather(1, index[:, :, None, None].expand(N, self.refined, H, D))
        high_scale = (residual.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-6).half().float()
        pages = torch.zeros(N, self.nbytes, dtype=torch.uint8)
        r = self.regions
        r.write(pages, "low", pack(low.to(torch.int32) + 8, 4))
        r.write(pages, "low_scale", low_scale.half())
        r.write(pages, "high", torch.round(residual / high_scale).clamp(-127, 127).to(torch.int8))
        r.write(pages, "high_scale", high_scale.half())
        r.write(pages, "index", index.to(torch.int16))
        return pages

    def decode(self, pages):
        B, H, D, R = self.block_size, self.num_heads, self.head_size, self.refined
        r = self.regions
        low = unpack(r.view(pages, "low", torch.uint8, (B, H, D // 2)), 4, D) - 8
        x = low.float() * r.view(pages, "low_scale", torch.float16, (B, H, 1)).float()
        residual = r.view(pages, "high", torch.int8, (R, H, D)).float() * r.view(pages, "high_scale", torch.float16,
                                                                                 (R, H, 1)).float()
        index = r.view(pages, "index", torch.int16, (R,)).long()
        return x.scatter_add(1, index[:, :, None, None].expand(-1, R, H, D), residual)

    def tensor_layout(self, base):
        raise NotImplementedError("no kernel reads this codec")


@pytest.fixture
def refined_codec():
    register_codec(RefinedTokensCodec)
    yield RefinedTokensCodec
    del CODECS[RefinedTokensCodec.name]


SETTING = {"name": "refined", "default": {"k_bits": 4, "v_bits": 4, "k_codec": RefinedTokensCodec.name,
                                          "v_codec": RefinedTokensCodec.name}}


def test_page_size_capacity_and_per_token_precision(refined_codec):
    cfg = load_config(SETTING)
    fmt = KVPageFormat.from_layer_format(cfg.default, torch.float32, 128, 2, 64)
    assert fmt.k.name == fmt.v.name == RefinedTokensCodec.name
    per_tensor = 128 * 2 * 64 // 2 + 128 * 2 * 2 + 32 * 2 * 64 + 32 * 2 * 2 + 32 * 2  # all regions 16-byte aligned
    assert fmt.codes_bytes == 2 * per_tensor
    ratio, line = capacity_report(cfg, ModelKVShape(2, 2, 64, torch.bfloat16, 128))
    assert "K4/channel[test-refined-tokens] V4/token[test-refined-tokens]" in line
    assert ratio == pytest.approx(2 * 128 * 2 * 64 * 2 / fmt.page_bytes)
    x = torch.randn(1, 128, 2, 64, generator=torch.Generator().manual_seed(1))
    got = fmt.k.decode(fmt.k.encode(x, torch.tensor([100])))
    error = (got - x)[0, :100].norm(dim=(1, 2))
    index = fmt.k.regions.view(fmt.k.encode(x, torch.tensor([100])), "index", torch.int16, (32,))[0].long()
    refined = torch.zeros(100, dtype=torch.bool)
    refined[index] = True
    assert error[refined].max() < error[~refined].min()  # the refined tokens are stored more precisely
    assert (got[0, 100:] == 0).all()


def test_kernels_pass_over_a_codec_they_cannot_read(refined_codec):
    fmt = KVPageFormat.from_layer_format(load_config(SETTING).default, torch.bfloat16, 128, 4, 128)
    ctx = registry.LayerContext(registry.Device("cuda", (9, 0), nvcc=True), torch.bfloat16, 4)
    plan = registry.plan(fmt, ctx, KernelPolicy())
    assert (plan.decode.name, plan.prompt.name, plan.write.name) == ("torch", "torch", "torch")
    assert "K in codec 'test-refined-tokens'" in plan.decode.describe()


def test_overrides_follow_the_format_model(refined_codec):
    assert set(LayerOverride.model_fields) == set(LayerFormat.model_fields)
    cfg = load_config({"default": {"k_bits": 4, "v_bits": 4}, "layers": {1: {"v_codec": RefinedTokensCodec.name}}})
    assert cfg.layer_format(1).v_codec == RefinedTokensCodec.name and cfg.layer_format(0).v_codec is None
    with pytest.raises(Exception, match="field 'k_codec': codec 'nope' is not registered"):
        from vllm_kvcompress.engine_config import layer_page_format
        layer_page_format(load_config({"default": {"k_bits": 4, "k_codec": "nope"}}), 0, 2, torch.float32, 128, 2, 64)


@pytest.mark.engine
def test_engine_attends_through_a_registered_codec(refined_codec, mha, monkeypatch):
    """Inside a real CPU engine, each layer's attention over prompts run in chunks of 128 tokens
    equals causal attention over the chunk's own K/V and earlier chunks' K/V put through the codec
    block by block."""
    from engine_utils import check_chunked_attention, engine, greedy, prose, record_attention

    recorded = record_attention(monkeypatch)
    with engine(mha, SETTING, enable_chunked_prefill=True, max_num_batched_tokens=128, max_num_seqs=4) as llm:
        tokens = [greedy(llm, [p], max_tokens=1)[0] for p in (prose(200, 41), prose(60, 42))]
    assert all(len(t) == 1 for t in tokens)
    first = recorded[0]
    d = first.q.shape[-1] // first.heads if first.q.dim() == 2 else first.q.shape[-1]
    codec = RefinedTokensCodec(128, first.kv_heads, d)
    assert check_chunked_attention(recorded, lambda k: _through_codec(codec, k), lambda v: _through_codec(codec, v)) > 0


def _through_codec(codec, x):
    """A request's K or V [T, H, D] stored block by block and read back."""
    blocks = []
    for start in range(0, x.shape[0], codec.block_size):
        part = x[start:start + codec.block_size]
        block = torch.zeros(codec.block_size, *x.shape[1:])
        block[:len(part)] = part
        blocks.append(codec.decode(codec.encode(block[None], torch.tensor([len(part)])))[0, :len(part)])
    return torch.cat(blocks)
