"""KVmix's recent pivotal context (RPC): each context's newest tokens are read at 16 bits.

References here are written from the method's statement: for a query at position p
(a context of p + 1 tokens), keys p + 1 - w .. p with w = min(ceil(fraction * (p + 1)), cap)
use the model's own K/V, older keys their quantized values (``fake_quant``). A prompt chunk's
queries also see the chunk's own tokens exactly, whatever their window.
"""

import math

import pytest
import torch

from engine_utils import engine, greedy, kv_capacity_tokens, prose
from reference_quant import fake_quant
from vllm_kvcompress import paged_torch
from vllm_kvcompress.config import KVCompressionConfigError, LayerFormat, load_config
from vllm_kvcompress.formats import KVPageFormat

BLOCK, HEADS, DIM = 32, 2, 16


def window_format(fraction=0.2, cap=8, bits=2, dtype=torch.float16):
    lf = LayerFormat(k_bits=bits, v_bits=bits, rpc_fraction=fraction, rpc_tokens=cap)
    return KVPageFormat.from_layer_format(lf, dtype, BLOCK, HEADS, DIM)


def reference(q, k, v, fraction, cap, bits, scale, block=BLOCK):
    """Causal attention of q [m, Hq, D] (the last m positions) over k, v [L, H, D]; with m > 1 (a
    prompt chunk) the last m keys are exact."""
    L, m = k.shape[0], q.shape[0]
    kq, vq = fake_quant(k, bits, "channel", block), fake_quant(v, bits, "token", block)
    group = q.shape[1] // k.shape[1]
    out = []
    for row, p in enumerate(range(L - m, L)):
        w = min(math.ceil(fraction * (p + 1)), cap)
        exact = torch.arange(p + 1) >= (p + 1 - w if m == 1 else min(p + 1 - w, L - m))
        kk = torch.where(exact[:, None, None], k[:p + 1].float(), kq[:p + 1]).repeat_interleave(group, 1)
        vv = torch.where(exact[:, None, None], v[:p + 1].float(), vq[:p + 1]).repeat_interleave(group, 1)
        probs = (torch.einsum("hd,khd->hk", q[row].float(), kk) * scale).softmax(-1)
        out.append(torch.einsum("hk,khd->hd", probs, vv))
    return torch.stack(out)


def fill(fmt, k, v, table, prefill):
    """Write a request's tokens: ``prefill`` of them at once, then one at a time (decode)."""
    cache = torch.zeros(int(table.max()) + 2, fmt.page_bytes, dtype=torch.uint8)
    slots = table[torch.arange(k.shape[0]) // BLOCK] * BLOCK + torch.arange(k.shape[0]) % BLOCK
    paged_torch.write_tokens(cache, fmt, k[:prefill], v[:prefill], slots[:prefill])
    for j in range(prefill, k.shape[0]):
        paged_torch.write_tokens(cache, fmt, k[j:j + 1], v[j:j + 1], slots[j:j + 1])
    return cache


@pytest.mark.parametrize("length, prefill", [(70, 40), (64, 64), (33, 1), (100, 97)])
def test_ring_holds_each_pages_newest_tokens_exactly(length, prefill):
    fmt = window_format(cap=8)
    torch.manual_seed(length)
    k, v = torch.randn(length, HEADS, DIM).half(), torch.randn(length, HEADS, DIM).half()
    table = torch.tensor([3, 0, 5, 1])
    ring_k, ring_v = fmt.decode_recent(fill(fmt, k, v, table, prefill))
    for j in range(length):
        page_fill = min(BLOCK, length - (j // BLOCK) * BLOCK)
        if j % BLOCK >= page_fill - 8:
            page, slot = table[j // BLOCK], (j % BLOCK) % 8
            assert torch.equal(ring_k[page, slot].half(), k[j]) and torch.equal(ring_v[page, slot].half(), v[j])


@pytest.mark.parametrize("length", [1, 9, 32, 33, 45, 96])
@pytest.mark.parametrize("fraction, cap", [(0.2, 8), (0.1, 4), (1.0, 16)])
def test_decode_reads_the_window_at_16_bits(length, fraction, cap):
    fmt = window_format(fraction, cap)
    torch.manual_seed(length)
    k, v = torch.randn(length, HEADS, DIM).half(), torch.randn(length, HEADS, DIM).half()
    q = torch.randn(1, 4, DIM).half()
    table = torch.tensor([[2, 0, 3, 4]])
    cache = fill(fmt, k, v, table[0], prefill=length)  # one write: codes are quantized once, as in the reference
    got = paged_torch.attend(q, cache, fmt, [0, 1], [length], table, DIM ** -0.5, key=k[-1:], value=v[-1:])
    want = reference(q, k, v, fraction, cap, 2, DIM ** -0.5)
    torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)
    without = paged_torch.attend(q, cache, window_format(0.0, 0), [0, 1], [length], table, DIM ** -0.5)
    if length > 1:  # the window changes what is read: the test tells the two apart
        assert (without.float() - want).abs().max() > 1e-2


def test_prefill_chunk_each_query_has_its_own_window():
    """A 30-token chunk after 64 tokens of cached history (a prefix-cache hit ends on a page
    boundary): query p's window is min(ceil(0.2 (p+1)), 8), reaching back into the history; the
    chunk's own tokens are exact beyond the window too."""
    fmt = window_format(0.2, 8)
    torch.manual_seed(1)
    k, v = torch.randn(94, HEADS, DIM).half(), torch.randn(94, HEADS, DIM).half()
    q = torch.randn(30, 4, DIM).half()
    table = torch.tensor([[1, 0, 2]])
    cache = fill(fmt, k[:64], v[:64], table[0], prefill=64)
    slots = table[0, torch.arange(64, 94) // BLOCK] * BLOCK + torch.arange(64, 94) % BLOCK
    paged_torch.write_tokens(cache, fmt, k[64:], v[64:], slots)
    got = paged_torch.attend(q, cache, fmt, [0, 30], [94], table, DIM ** -0.5, key=k[64:], value=v[64:])
    torch.testing.assert_close(got.float(), reference(q, k, v, 0.2, 8, 2, DIM ** -0.5), rtol=2e-3, atol=2e-3)


def test_window_costs_its_16_bit_copies():
    plain = KVPageFormat.from_layer_format(LayerFormat(k_bits=2, v_bits=2), torch.float16, 128, 4, 64)
    windowed = KVPageFormat.from_layer_format(LayerFormat(k_bits=2, v_bits=2, rpc_fraction=0.1, rpc_tokens=8),
                                              torch.float16, 128, 4, 64)
    assert windowed.page_bytes - plain.page_bytes == 8 * 2 * 4 * 64 * 2


def test_bad_window_settings_are_refused():
    with pytest.raises(KVCompressionConfigError, match="rpc_fraction > 0 needs rpc_tokens > 0"):
        load_config({"default": {"k_bits": 2, "v_bits": 2, "rpc_fraction": 0.1}})
    with pytest.raises(KVCompressionConfigError, match="'default.rpc_fraction' = 1.5"):
        load_config({"default": {"rpc_fraction": 1.5}})
    with pytest.raises(ValueError, match="rpc_tokens = 32 must be below the block size"):
        window_format(cap=32)


@pytest.mark.engine
def test_engine_attention_with_window_equals_reference(mha, monkeypatch):
    """In the vLLM engine, each layer's prefill output equals the window reference, and the
    capacity vLLM reports counts the 16-bit copies."""
    from vllm_kvcompress.backend import KVCompressImpl

    calls = []
    original = KVCompressImpl.forward

    def recording_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw):
        result = original(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw)
        if attn_metadata is not None and attn_metadata.num_decodes == 0:
            t = attn_metadata.num_actual_tokens
            calls.append((self.num_heads, self.scale, list(attn_metadata.query_start_loc),
                          query[:t].clone(), key[:t].clone(), value[:t].clone(), output[:t].clone()))
        return result

    monkeypatch.setattr(KVCompressImpl, "forward", recording_forward)
    setting = {"default": {"k_bits": 2, "v_bits": 2, "rpc_fraction": 0.2, "rpc_tokens": 16}}
    with engine(mha, setting) as llm:
        assert [len(t) for t in greedy(llm, [prose(200, 41), prose(60, 42)], max_tokens=4)] == [4, 4]
        tokens = kv_capacity_tokens(llm)
    with engine(mha, {"default": {"k_bits": 2, "v_bits": 2}}) as llm:
        plain_tokens = kv_capacity_tokens(llm)
    assert calls
    for hq, scale, qsl, q, k, v, out in calls:
        d = q.shape[-1] // hq if q.dim() == 2 else q.shape[-1]
        q, k, v, out = (t.reshape(t.shape[0], -1, d).float() for t in (q, k, v, out))
        for i in range(len(qsl) - 1):
            s, e = qsl[i], qsl[i + 1]
            want = reference(q[s:e], k[s:e], v[s:e], 0.2, 16, 2, scale, block=128)
            torch.testing.assert_close(out[s:e], want, rtol=1e-4, atol=1e-4)
    lf = load_config(setting).layer_format(0)
    fmt = KVPageFormat.from_layer_format(lf, torch.float32, 128, 4, 64)
    plain = KVPageFormat.from_layer_format(LayerFormat(k_bits=2, v_bits=2), torch.float32, 128, 4, 64)
    assert abs(tokens / plain_tokens - plain.page_bytes / fmt.page_bytes) < 0.02
