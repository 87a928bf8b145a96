"""The read-back kernel gives the K and V that the format's torch reference decodes from the pages."""

import os

os.environ.setdefault("TRITON_INTERPRET", "0" if __import__("torch").cuda.is_available() else "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from paged_cases import PACKED_FORMATS, fill_pages, format_id, request_slots  # noqa: E402

from vllm_kvcompress.config import LayerFormat  # noqa: E402
from vllm_kvcompress.formats import KVPageFormat  # noqa: E402
from vllm_kvcompress.triton_kernels.layout import kernel_supports  # noqa: E402
from vllm_kvcompress.triton_kernels.read_back import stored_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = PACKED_FORMATS + [LayerFormat(k_bits=16, v_bits=4), LayerFormat(k_bits=4, v_bits=16), LayerFormat()]


@pytest.mark.parametrize("block", [16, 128])
@pytest.mark.parametrize("layer_format", FORMATS, ids=format_id)
def test_read_back_equals_reference_decode(layer_format, block):
    """Every written slot of three requests (lengths not multiples of the block, one of a single
    token), asked for in a scattered order: the values ``KVPageFormat.decode`` gives, in the
    format's dtype (float32 here, so the comparison is to float rounding)."""
    H, D = 2, 64
    fmt = KVPageFormat.from_layer_format(layer_format, torch.float32, block, H, D)
    assert kernel_supports(fmt) is None
    seq_lens = [block + 5, 1, 2 * block + 3]
    cache, table = fill_pages(fmt, seq_lens, 2, seed=layer_format.k_bits + block)
    slots = torch.cat([request_slots(table[i], block, torch.arange(L)) for i, L in enumerate(seq_lens)])
    slots = slots[torch.randperm(len(slots), generator=torch.Generator().manual_seed(1))]
    k_pages, v_pages = fmt.decode(cache)
    want_k = k_pages.flatten(0, 1)[slots]
    want_v = v_pages.flatten(0, 1)[slots]
    got_k, got_v = stored_kv(cache.to(DEVICE), fmt, slots.to(DEVICE))
    assert got_k.dtype == got_v.dtype == torch.float32 and got_k.shape == (len(slots), H, D)
    torch.testing.assert_close(got_k.cpu(), want_k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_v.cpu(), want_v, rtol=1e-6, atol=1e-6)
    assert (want_k - got_k.cpu().roll(1, 0)).abs().max() > 0.1  # the comparison tells slots apart


def test_padding_slots_read_as_zeros():
    """vLLM pads a batch's slots with -1 (CUDA-graph capture, warm-up runs): those tokens read as
    zeros, and the others as stored."""
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_bits=4, v_bits=4), torch.float32, 16, 2, 64)
    cache, table = fill_pages(fmt, [20], 1, seed=3)
    slots = torch.tensor([-1, table[0, 0].item() * 16 + 3, -1])
    k, v = stored_kv(cache.to(DEVICE), fmt, slots.to(DEVICE))
    k_pages, v_pages = fmt.decode(cache)
    assert (k[[0, 2]] == 0).all() and (v[[0, 2]] == 0).all()
    torch.testing.assert_close(k[1].cpu(), k_pages.flatten(0, 1)[slots[1]], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v[1].cpu(), v_pages.flatten(0, 1)[slots[1]], rtol=1e-6, atol=1e-6)
