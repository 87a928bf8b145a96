"""MiniCache: two layers in one page of merged directions (a format over a group of layers).

The format is checked against the paper's formulas written out here (SLERP of the two unit
directions, each layer's own norm, the most distinct tokens kept unmerged); the engine against that
format's arithmetic applied to the K/V the model computed, through vLLM's cross-layer cache sharing.
"""

import math

import pytest
import torch

from vllm_kvcompress.config import KVCompressionConfigError, LayerFormat, load_config
from vllm_kvcompress.engine_config import ModelKVShape, capacity_report, check_merge_fits, layer_page_format
from vllm_kvcompress.formats.merged import MergedPairFormat

B, H, D = 16, 2, 8


def _fmt(t=0.6, gamma=0.0, layer_format=LayerFormat(), dtype=torch.float32):
    return MergedPairFormat.from_layer_format(layer_format, t, gamma, dtype, B, H, D)


def _paper_merge(xa, xb, t):
    """MiniCache Eq. 2-3 per token and head: SLERP of the unit vectors, then each layer's norm."""
    na, nb = xa.norm(dim=-1, keepdim=True), xb.norm(dim=-1, keepdim=True)
    ua, ub = xa / na, xb / nb
    omega = torch.arccos((ua * ub).sum(-1, keepdim=True).clamp(-1, 1))
    e = (torch.sin((1 - t) * omega) * ua + torch.sin(t * omega) * ub) / torch.sin(omega)
    return e * na, e * nb


def _kv(seed, n=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, B, H, D, generator=g) for _ in range(4)]


@pytest.mark.parametrize("t", [0.6, 0.5])
def test_restored_layers_follow_the_paper(t):
    ka, va, kb, vb = _kv(1)
    fmt = _fmt(t)
    pages = fmt.encode(ka, va, kb, vb, torch.tensor([B]))
    for layer, want in ((0, (_paper_merge(ka, kb, t)[0], _paper_merge(va, vb, t)[0])),
                        (1, (_paper_merge(ka, kb, t)[1], _paper_merge(va, vb, t)[1]))):
        got = fmt.decode(pages, layer)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=2e-3, atol=2e-3)  # norms are stored in float16
    if t == 0.5:  # plain average merging: the direction of the two unit vectors' mean
        ua, ub = ka / ka.norm(dim=-1, keepdim=True), kb / kb.norm(dim=-1, keepdim=True)
        mean = (ua + ub) / (ua + ub).norm(dim=-1, keepdim=True)
        torch.testing.assert_close(fmt.decode(pages, 0)[0], mean * ka.norm(dim=-1, keepdim=True), rtol=2e-3, atol=2e-3)


def test_the_most_distinct_tokens_are_kept_unmerged():
    ka, va, kb, vb = _kv(2)
    kb[0, 5], vb[0, 5] = -ka[0, 5], -va[0, 5]  # token 5: opposite directions in layer b
    kb[0, 9] = -ka[0, 9]
    fmt = _fmt(gamma=0.1)  # 2 of 16 tokens
    assert fmt.retained == math.ceil(0.1 * B)
    pages = fmt.encode(ka, va, kb, vb, torch.tensor([12]))
    k0, v0 = fmt.decode(pages, 0)
    k1, v1 = fmt.decode(pages, 1)
    for tok in (5, 9):
        for got, want in ((k0, ka), (v0, va), (k1, kb), (v1, vb)):
            torch.testing.assert_close(got[0, tok], want[0, tok])
    merged = _paper_merge(ka, kb, 0.6)[0]
    torch.testing.assert_close(k0[0, 3], merged[0, 3], rtol=2e-3, atol=2e-3)
    assert (k0[0, 12:] == 0).all()  # tokens past num_valid hold nothing


@pytest.mark.parametrize("layer_format", [LayerFormat(), LayerFormat(k_bits=4, v_bits=4)])
def test_appending_in_pieces_keeps_the_most_distinct_tokens(layer_format):
    """A block filled in three appends (after a page that last held another request's tokens): its
    retention slots hold the block's most distinct tokens, as when the block is merged at once; its
    norms are the block's; its direction codes are what a layer page with the same codecs holds after
    the same appends (``paged_torch.write_tokens``: the codecs' append rule)."""
    from vllm_kvcompress import paged_torch

    ka, va, kb, vb = _kv(4)
    kb[0, 2], kb[0, 7], kb[0, 13] = -ka[0, 2], -ka[0, 7], -ka[0, 13]  # distinct, one in each piece
    fmt = _fmt(gamma=0.2, layer_format=layer_format)  # 4 slots of 16
    stale = fmt.encode(*_kv(5), torch.tensor([B]))  # a reused page: its slots hold another block's tokens
    pair, layer_page = stale.clone(), torch.zeros(1, fmt.directions.page_bytes, dtype=torch.uint8)
    for lo, hi in ((0, 5), (5, 6), (6, 14)):
        slots = torch.arange(lo, hi)
        paged_torch.write_pair_tokens(pair, fmt, *(x[0, lo:hi] for x in (ka, va, kb, vb)), slots)
        x, merged, _, _ = fmt.merge(*(x[0, lo:hi] for x in (ka, va, kb, vb)))
        paged_torch.write_tokens(layer_page, fmt.directions, merged[:, 0], merged[:, 1], slots)
    whole = fmt.encode(ka, va, kb, vb, torch.tensor([14]))
    index = fmt.regions.view(pair, "index", torch.int16, (fmt.retained,))
    assert sorted(index[0].tolist()) == sorted(fmt.regions.view(whole, "index", torch.int16, (fmt.retained,))[0].tolist())
    assert {2, 7, 13} <= set(index[0].tolist())
    assert torch.equal(pair[:, :fmt.directions.codes_bytes], layer_page[:, :fmt.directions.codes_bytes])
    for layer in (0, 1):
        for got, want in zip(fmt.decode(pair, layer), fmt.decode(whole, layer)):
            if layer_format.k_bits == 16:
                torch.testing.assert_close(got[:, :14], want[:, :14])
            for tok in (2, 7, 13):
                torch.testing.assert_close(got[0, tok], want[0, tok])


def test_quantized_directions_cost_less_and_stay_close():
    ka, va, kb, vb = _kv(3)
    plain, four = _fmt(gamma=0.05), _fmt(gamma=0.05, layer_format=LayerFormat(k_bits=4, v_bits=4))
    assert four.page_bytes < plain.page_bytes
    a = plain.decode(plain.encode(ka, va, kb, vb, torch.tensor([B])), 1)[0]
    b = four.decode(four.encode(ka, va, kb, vb, torch.tensor([B])), 1)[0]
    assert ((a - b).norm() / a.norm()) < 0.15


def test_capacity_counts_a_pair_once():
    cfg = load_config({"merge": {"start_layer": 2}})
    shape = ModelKVShape(6, H, D, torch.bfloat16, B)
    assert cfg.merged_pairs(6) == [(2, 3), (4, 5)]
    ratio, line = capacity_report(cfg, shape)
    pair = layer_page_format(cfg, 2, 6, torch.bfloat16, B, H, D)
    assert layer_page_format(cfg, 3, 6, torch.bfloat16, B, H, D) == pair
    single = 2 * B * H * D * 2
    assert ratio == pytest.approx(6 * single / (2 * single + 2 * pair.page_bytes))
    assert "4 layers 16-bit merged in pairs (t=0.6, gamma=0.05)" in line
    assert load_config({"merge": {}}).merged_pairs(30) == [(15, 16), (17, 18), (19, 20), (21, 22), (23, 24),
                                                            (25, 26), (27, 28)]


@pytest.mark.parametrize("setting,layers,message", [
    ({"merge": {"start_layer": 3}}, 4, "field 'merge.start_layer' = 3 leaves no pair of layers to merge"),
    ({"merge": {"start_layer": 2}, "layers": {3: {"k_bits": 4}}}, 4, "merge pairs layers 2 and 3: their formats differ"),
    ({"merge": {"start_layer": 2}, "default": {"k_only": True}}, 4, "k_only layers"),
    ({"merge": {"start_layer": 2}, "default": {"k_bits": 4, "v_bits": 4, "rpc_fraction": 0.1, "rpc_tokens": 8}}, 4,
     "recent window"),
    ({"merge": {"start_layer": 2}, "default": {"k_bits": 4, "v_bits": 4, "v_rotation": True}}, 4,
     "v_rotation cannot be combined with merging"),
])
def test_pairs_that_cannot_merge_are_refused(setting, layers, message):
    with pytest.raises(KVCompressionConfigError, match=message):
        check_merge_fits(load_config(setting), ModelKVShape(layers, H, D, torch.bfloat16, B))
    with pytest.raises(KVCompressionConfigError, match=r"field 'merge.t' = 1.5"):
        load_config({"merge": {"t": 1.5}})


@pytest.mark.engine
def test_engine_restores_merged_layers(mha, monkeypatch):
    """A 4-layer model with layers 2 and 3 merged: the second step's attention of those layers equals
    attention over the prompt's K/V put through the merged format, plus the new token's own K/V; the
    other layers are stock 16-bit pages."""
    from engine_utils import engine, greedy, kv_capacity_tokens, prose, record_attention
    from vllm.model_executor.models.utils import extract_layer_index

    recorded = record_attention(monkeypatch)
    setting = {"merge": {"start_layer": 2, "gamma": 0.05}}
    prompt = prose(150, 51)
    with engine(mha, setting) as llm:
        tokens = greedy(llm, [prompt], max_tokens=2)
        merged_capacity = kv_capacity_tokens(llm)
    with engine(mha) as llm:
        stock_capacity = kv_capacity_tokens(llm)
    assert len(tokens[0]) == 2 and merged_capacity > 1.2 * stock_capacity
    calls = {}
    for c in recorded:
        calls.setdefault(extract_layer_index(c.layer), []).append((c.heads, c.kv_heads, c.scale, c.q, c.k, c.v, c.out))
    prefill = {i: calls[i][0] for i in (2, 3)}
    hq, hkv, scale = prefill[2][:3]
    kv = [x.reshape(x.shape[0], hkv, -1).float() for i in (2, 3) for x in prefill[i][4:6]]
    d = kv[0].shape[-1]
    n = kv[0].shape[0]
    fmt = MergedPairFormat.from_layer_format(LayerFormat(), 0.6, 0.05, torch.float32, 128, hkv, d)
    num_blocks = -(-n // 128)
    blocks = [torch.zeros(num_blocks * 128, hkv, d) for _ in kv]
    for blk, x in zip(blocks, kv):
        blk[:n] = x
    filled = torch.tensor([min(128, n - 128 * j) for j in range(num_blocks)])
    pages = fmt.encode(*(b.view(num_blocks, 128, hkv, d) for b in blocks), filled)
    for layer, i in ((0, 2), (1, 3)):
        _, _, _, q, k_new, v_new, out = calls[i][1]  # the decode step: one new token
        k_hist, v_hist = (x.flatten(0, 1)[:n] for x in fmt.decode(pages, layer))
        k = torch.cat([k_hist, k_new.reshape(1, hkv, d).float()]).repeat_interleave(hq // hkv, 1)
        v = torch.cat([v_hist, v_new.reshape(1, hkv, d).float()]).repeat_interleave(hq // hkv, 1)
        scores = torch.einsum("hd,khd->hk", q.reshape(hq, d).float(), k) * scale
        want = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
        torch.testing.assert_close(out.reshape(hq, d).float(), want, rtol=1e-4, atol=1e-4)


def test_pairs_of_sliding_window_layers_merge_and_mixed_pairs_are_refused():
    """Gemma 3's pattern (five sliding-window layers, then one of full attention): pairs of two
    sliding-window layers merge; a pair with a full-attention layer is refused with both windows named."""
    windows = (512, 512, 512, 512, 512, None, 512, 512, 512, 512, 512, None)
    shape = ModelKVShape(12, H, D, torch.bfloat16, B, sliding_windows=windows)
    check_merge_fits(load_config({"merge": {"start_layer": 7}}), shape)  # (7, 8), (9, 10)
    _, line = capacity_report(load_config({"merge": {"start_layer": 7}}), shape)
    assert "mixes sliding-window and full-attention layers, for which vLLM pads pages" in line
    assert "mixes" not in capacity_report(load_config("quant-k4v4"), shape)[1]  # one page size: nothing to pad
    with pytest.raises(KVCompressionConfigError,
                       match=r"merge pairs layers 5 and 6: full attention and a sliding window of 512"):
        check_merge_fits(load_config({"merge": {"start_layer": 5}}), shape)


def test_a_sliding_window_pair_sees_only_its_window():
    """``attend_pair`` with a window: each query row attends to keys p - window < j <= p, restored
    from the pages or its chunk's own; pages before the window (freed by vLLM, here full of NaN)
    are never read."""
    from vllm_kvcompress import paged_torch

    window, block = 20, 16
    fmt = MergedPairFormat.from_layer_format(LayerFormat(), 0.6, 0.1, torch.float32, block, H, D)
    g = torch.Generator().manual_seed(8)
    L, m = 70, 6  # 64 tokens in the pages, a chunk of 6
    ka, va, kb, vb = (torch.randn(5, block, H, D, generator=g) for _ in range(4))
    cache = torch.full((6, fmt.page_bytes), 255, dtype=torch.uint8)  # NaN everywhere
    table = torch.tensor([[5, 4, 3, 2, 1]], dtype=torch.int32)
    filled = torch.tensor([16, 16, 16, 16, 0])
    cache[[5, 4, 3, 2, 1]] = fmt.encode(ka, va, kb, vb, filled)
    cache[[5, 4]] = 255  # the blocks wholly before the first row's window
    q = torch.randn(m, 2 * H, D, generator=g)
    k_new, v_new = torch.randn(m, H, D, generator=g), torch.randn(m, H, D, generator=g)
    for layer in (0, 1):
        out = paged_torch.attend_pair(q, cache, fmt, layer, [0, m], [L], table, D ** -0.5, k_new, v_new, window)
        pages = fmt.encode(ka, va, kb, vb, filled)
        k, v = (torch.cat([x.flatten(0, 1)[:L - m], new]) for x, new in zip(fmt.decode(pages, layer), (k_new, v_new)))
        for row in range(m):
            p = L - m + row
            keys = slice(p - window + 1, p + 1)
            logits = torch.einsum("hd,khd->hk", q[row], k[keys].repeat_interleave(2, 1)) * D ** -0.5
            want = torch.einsum("hk,khd->hd", logits.softmax(-1), v[keys].repeat_interleave(2, 1))
            torch.testing.assert_close(out[row], want, rtol=1e-4, atol=1e-4)
