"""One source of truth for a page's layout: ``formats.layout``. The torch reference, the offsets the
Triton kernels are compiled with and the CUDA kernels' build flags must all come from it; this fails
if a kernel source states a value of its own or a copy disagrees."""

import re
from pathlib import Path

import pytest
import torch

from paged_cases import PACKED_FORMATS, format_id
from vllm_kvcompress import cuda_jit
from vllm_kvcompress.config import LayerFormat
from vllm_kvcompress.formats import EPS, KERNEL_CONSTANTS, TOKEN_GROUP, WIDEN_MARGIN, KVPageFormat, page_layout
from vllm_kvcompress.formats.packing import packed_row_bytes
from vllm_kvcompress.formats.salient import MIDDLE, NO_SLOT
from vllm_kvcompress.formats.salient_rows import EMPTY

CSRC = Path(cuda_jit.CSRC)


def _sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in [*CSRC.glob("*.cu"), *CSRC.glob("*.cuh")]}


def test_cuda_sources_take_every_shared_constant_from_the_build_flags():
    used = set()
    for name, text in _sources().items():
        used |= set(re.findall(r"\bKVC_[A-Z_]+\b", text)) - {"KVC_HEADERS"}
        # no constant of the formats stated as a number in a kernel source
        for constant in ("kTokenGroup", "kEps", "kWidenMargin", "kNoSlot", "kMiddle", "kEmpty"):
            for value in re.findall(rf"{constant}\s*=\s*([^;]+);", text):
                assert value.strip().startswith("KVC_"), f"{name}: {constant} = {value}"
    assert used == set(KERNEL_CONSTANTS)
    assert KERNEL_CONSTANTS == {"KVC_TOKEN_GROUP": TOKEN_GROUP, "KVC_WIDEN_MARGIN": WIDEN_MARGIN, "KVC_EPS": EPS,
                                "KVC_NO_SLOT": NO_SLOT, "KVC_SALIENT_MIDDLE": MIDDLE, "KVC_EMPTY_ROW": EMPTY}


def test_build_flags_carry_the_formats_values(monkeypatch):
    flags = cuda_jit.build_flags()
    for name, value in KERNEL_CONSTANTS.items():
        assert f"-D{name}={value!r}" in flags
    monkeypatch.setitem(KERNEL_CONSTANTS, "KVC_TOKEN_GROUP", 64)  # a changed layout builds anew
    assert "-DKVC_TOKEN_GROUP=64" in cuda_jit.build_flags()


@pytest.mark.parametrize("layer_format", [*PACKED_FORMATS, LayerFormat(k_bits=4, v_bits=4, v_channel_scaling=True),
                                          LayerFormat(k_bits=8, k_only=True), LayerFormat()], ids=format_id)
def test_kernel_offsets_point_at_what_the_reference_wrote(layer_format):
    """Encode random blocks with the torch reference, then read each region back at the offsets the
    kernels get (``page_layout``): codes, scales and zeros found there are the reference's."""
    B, H, D = 64, 2, 64
    fmt = KVPageFormat.from_layer_format(layer_format, torch.float16, B, H, D)
    lay = page_layout(fmt)
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(2, B, H, D, generator=gen) for _ in range(2))
    pages = fmt.encode(k, v, torch.tensor([B, B // 2]))
    assert lay.page_bytes == fmt.page_bytes and lay.block_size == B
    for tensor, codec, base in (("k", fmt.k, 0), ("v", fmt.v, fmt.k.nbytes)):
        t = getattr(lay, tensor)
        if codec is None:
            assert t is None
            continue
        raw = pages[:, base:base + codec.nbytes]
        if t.bits == 16:
            assert (t.codes, t.row_bytes) == (base, D * 2)
            continue
        assert t.row_bytes == packed_row_bytes(D, t.bits)
        for name in ("codes", "scale", "zero"):
            start, size = codec.regions.offsets[name]
            assert getattr(t, name) == base + start
            assert torch.equal(pages[:, getattr(t, name):getattr(t, name) + size], raw[:, start:start + size])
        assert t.token_group == (codec.token_group if codec.axis == "token" else 0)
        assert (t.channel_scale >= 0) == codec.channel_scaling
