"""ZipCache: salient tokens at 4 bits and the rest at 2 in one page, chosen by normalized attention.

The format is checked against the 4-bit min-max codec it shares its grid with (a salient token reads
exactly as that codec's code, another as the middle of its four sub-levels); the saliency against
the paper's definition over the full attention matrix; the engine against the whole method written
out here from the recorded queries, keys and values.
"""

import math

import pytest
import torch

from vllm_kvcompress.config import KVCompressionConfigError, SalientSpec, load_config
from vllm_kvcompress.engine_config import ModelKVShape, capacity_report
from vllm_kvcompress.formats.codecs import MinMaxCodec, TensorSpec
from vllm_kvcompress.formats.salient import SalientTokensFormat
from vllm_kvcompress.salient_torch import attend_and_write, keep_top, probe_rows, token_scores

B, H, D = 32, 2, 16


def _fmt(ratio=0.6, block=B, heads=H, head_size=D, dtype=torch.float32):
    return SalientTokensFormat.create(ratio, dtype, block, heads, head_size)


def _four_bit(k, v, num_valid, block=B):
    """K and V through the plain 4-bit codecs, and their codes."""
    ck = MinMaxCodec.from_spec(TensorSpec(4, "channel"), torch.float32, block, k.shape[2], k.shape[3])
    cv = MinMaxCodec.from_spec(TensorSpec(4, "token"), torch.float32, block, k.shape[2], k.shape[3])
    pk, pv = ck.encode(k, num_valid), cv.encode(v, num_valid)
    return (ck.decode(pk), ck._page_codes(pk)), (cv.decode(pv), cv._page_codes(pv)), (ck, pk), (cv, pv)


def _random_salient(num_valid, slots, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(len(num_valid), B, H, dtype=torch.bool)
    for n, count in enumerate(num_valid.tolist()):
        for h in range(H):
            out[n, torch.randperm(count, generator=g)[:min(slots, count)], h] = True
    return out


def test_salient_tokens_read_as_4_bit_codes_and_the_rest_as_the_middle_of_their_2_bit_level():
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(3, B, H, D, generator=g), torch.randn(3, B, H, D, generator=g) * 3
    num_valid = torch.tensor([B, 20, 1])
    fmt = _fmt()
    salient = _random_salient(num_valid, fmt.slots)
    k_got, v_got = fmt.decode(fmt.encode(k, v, num_valid, salient))
    (k4, kc), (v4, vc), (ck, pk), (cv, pv) = _four_bit(k, v, num_valid)
    valid = (torch.arange(B)[None, :] < num_valid[:, None])[..., None].expand(-1, -1, H)
    s, r = salient & valid, ~salient & valid
    torch.testing.assert_close(k_got[s], k4[s], rtol=0, atol=0)
    torch.testing.assert_close(v_got[s], v4[s], rtol=0, atol=0)
    # the rest: zero + scale * (4 * (code >> 2) + 1.5) on the same grid
    k_scale, k_zero = (ck._stats_from_page(pk, n) for n in ("scale", "zero"))
    v_scale, v_zero = (cv._stats_from_page(pv, n) for n in ("scale", "zero"))
    k_mid = ((kc >> 2) * 4 + 1.5) * k_scale + k_zero
    v_mid = ((vc >> 2) * 4 + 1.5) * v_scale + v_zero
    torch.testing.assert_close(k_got[r], k_mid[r], rtol=0, atol=1e-6)
    torch.testing.assert_close(v_got[r], v_mid[r], rtol=0, atol=1e-6)
    assert fmt.salient(fmt.encode(k, v, num_valid, salient)).eq(s).all()


def test_the_2_bit_level_errs_less_than_a_min_max_2_bit_grid():
    """On values spread evenly, the middle of four 4-bit sub-levels is a 2-bit grid of step 4/15 of the
    range (levels 1.5 steps inside its ends), against min-max 2 bits' 5/15 with levels at the ends."""
    g = torch.Generator().manual_seed(2)
    k = torch.rand(8, B, H, D, generator=g)
    num_valid = torch.full((8,), B)
    fmt = _fmt()
    k_got, _ = fmt.decode(fmt.encode(k, k, num_valid, torch.zeros(8, B, H, dtype=torch.bool)))
    two = MinMaxCodec.from_spec(TensorSpec(2, "channel"), torch.float32, B, H, D)
    ours, minmax = (k_got - k).abs().mean(), (two.decode(two.encode(k, num_valid)) - k).abs().mean()
    assert ours < 0.9 * minmax, (ours, minmax)  # 0.062 against 0.073 here


def test_demoting_a_token_drops_only_its_low_bits():
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, B, H, D, generator=g), torch.randn(2, B, H, D, generator=g)
    num_valid = torch.full((2,), B)
    fmt = _fmt()
    salient = _random_salient(num_valid, fmt.slots)
    pages = fmt.encode(k, v, num_valid, salient)
    keep = salient & (torch.rand(2, B, H, generator=g) < 0.5)
    demoted = fmt.demote(pages, keep)
    assert fmt.salient(demoted).eq(keep).all()
    want = fmt.decode(fmt.encode(k, v, num_valid, keep))  # encoded with only ``keep`` from the start
    for got, w in zip(fmt.decode(demoted), want):
        torch.testing.assert_close(got, w, rtol=0, atol=0)


def test_appending_keeps_earlier_v_and_the_high_bits_of_k_channels_that_fit():
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(1, B, H, D, generator=g), torch.randn(1, B, H, D, generator=g)
    fmt = _fmt()
    first = torch.tensor([20])
    salient = _random_salient(first, 8)
    stored = fmt.encode(k, v, first, salient)
    k_old, v_old = fmt.decode(stored)
    k_new, v_new = k_old.clone(), v_old.clone()
    k_new[:, 20:24], v_new[:, 20:24] = k[:, 20:24] * 0.01, v[:, 20:24]  # inside every K channel's grid
    more = salient.clone()
    more[:, 20:24] = True
    pages = fmt.encode(k_new, v_new, torch.tensor([24]), more, stored, first)
    k_got, v_got = fmt.decode(pages)
    torch.testing.assert_close(k_got[:, :20], k_old[:, :20], rtol=0, atol=0)
    torch.testing.assert_close(v_got[:, :20], v_old[:, :20], rtol=0, atol=0)
    with pytest.raises(ValueError, match="more than 20 salient"):
        fmt.encode(k, v, torch.tensor([B]), torch.ones(1, B, H, dtype=torch.bool))


def test_capacity_counts_codes_refinement_rows_slot_map_and_statistics():
    """Bytes a KV head and block: two 2-bit planes, R = ceil(r B) refinement rows of K and V, a slot
    byte per token, float16 statistics (K per channel, V per token)."""
    for block, heads, d, ratio in ((128, 32, 128, 0.6), (128, 3, 64, 0.6), (64, 2, 64, 0.44)):
        fmt = _fmt(ratio, block, heads, d, torch.bfloat16)
        r = math.ceil(ratio * block)
        per_head = 2 * block * d // 4 + 2 * r * d // 4 + block + 2 * 2 * d + 2 * 2 * block
        assert fmt.page_bytes - heads * per_head in range(0, 16 * 9 + block * 2)  # region alignment, slots
    llama2 = _fmt(0.6, 128, 32, 128, torch.bfloat16)
    assert llama2.dense_page_bytes() / llama2.page_bytes >= 4.5
    cfg = load_config("zipcache-r60")
    ratio, line = capacity_report(cfg, ModelKVShape(32, 32, 128, torch.bfloat16, 128))
    assert ratio == pytest.approx(llama2.dense_page_bytes() / llama2.page_bytes)
    assert "60% of each block's tokens at 4 bits by normalized attention" in line


def test_probe_rows_are_the_newest_and_a_seeded_draw_of_the_rest():
    spec = SalientSpec(probe_recent=0.05, probe_random=0.05, seed=3)
    rows = probe_rows(256, 1000, spec)
    assert rows[-13:].tolist() == list(range(243, 256))
    assert len(rows) == 26 and rows[:13].max() < 243 and len(set(rows.tolist())) == 26
    assert rows.tolist() == probe_rows(256, 1000, spec).tolist()
    assert rows.tolist() != probe_rows(256, 1256, spec).tolist()
    assert probe_rows(1, 77, spec).tolist() == [0]


@pytest.mark.parametrize("score", ["normalized", "accumulated"])
def test_scores_are_the_papers_attention_column_sums(score):
    """ZipCache's normalized attention: a key's column of the causal attention matrix summed over the
    probe rows (and a KV head's query heads), divided by the probes that see it; H2O's accumulated
    attention is the sum alone."""
    g = torch.Generator().manual_seed(5)
    hq, n, first = 4, 24, 40
    q, k = torch.randn(hq, n, D, generator=g), torch.randn(first + n, H, D, generator=g)
    pos = torch.arange(first, first + n)
    probes = torch.tensor([3, 10, 20, 23])
    got = token_scores(q[:, probes], pos[probes], k, 0, 0.25, SalientSpec(score=score))
    full = torch.zeros(hq, n, first + n)
    for h in range(hq):
        for i in range(n):
            logits = q[h, i] @ k[:first + i + 1, h // 2].T * 0.25
            full[h, i, :first + i + 1] = logits.softmax(-1)
    column = full[:, probes].sum(1).view(H, 2, -1).sum(1)  # [H, L]
    if score == "normalized":
        column = column / (torch.arange(first + n)[None, :] <= pos[probes][:, None]).sum(0)
    torch.testing.assert_close(got, column.T, rtol=1e-5, atol=1e-6)


def test_keep_top_takes_the_best_candidates_up_to_each_quota():
    scores = torch.tensor([[5., 1., 4., 3.], [1., 2., 3., 4.]])[..., None]
    candidates = torch.tensor([[True, True, False, True], [True, True, True, True]])[..., None]
    got = keep_top(scores, candidates, torch.tensor([2, 3]))[..., 0]
    assert got.tolist() == [[True, False, False, True], [False, True, True, True]]


def _paper_step(q, k_all, history, scale, ratio, block):
    """One prompt chunk of the method written out: all query rows are probes (probe_recent 1), each
    touched block's tokens ranked by normalized attention, its ceil(r n) best keep 4 bits."""
    L = k_all.shape[0]
    hq, m, _ = q.shape
    heads = k_all.shape[1]
    logits = torch.einsum("hqd,khd->hqk", q, k_all.repeat_interleave(hq // heads, 1)) * scale
    causal = torch.arange(L)[None, :] <= torch.arange(history, L)[:, None]
    probs = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    normalized = probs.view(heads, hq // heads, m, L).sum((1, 2)) / causal.sum(0)
    salient = torch.zeros(L, heads, dtype=torch.bool)
    for b0 in range(history // block * block, L, block):
        filled = min(block, L - b0)
        top = normalized[:, b0:b0 + filled].topk(math.ceil(ratio * filled - 1e-9), dim=1).indices
        for h in range(heads):
            salient[b0 + top[h], h] = True
    return salient


def test_prompt_chunks_attend_exactly_to_themselves_and_to_the_chosen_precision_before():
    """Two chunks of one request through the torch path against the method written out: the second
    chunk's attention reads the first chunk's tokens at 4 bits where the paper's saliency ranks them
    in their block's top r, else at 2 bits; the pages then hold that choice."""
    g = torch.Generator().manual_seed(6)
    hq, ratio, scale = 4, 0.5, 0.3
    fmt = _fmt(ratio)
    spec = SalientSpec(ratio=ratio, probe_recent=1.0, probe_random=0.0)
    cache = torch.zeros(4, fmt.page_bytes, dtype=torch.uint8)
    table = torch.tensor([[2, 0, 3, 1]])
    m1, m2 = 2 * B, B + 5
    q = torch.randn(m1 + m2, hq, D, generator=g)
    k, v = torch.randn(m1 + m2, H, D, generator=g), torch.randn(m1 + m2, H, D, generator=g)
    attend_and_write(q[:m1], k[:m1], v[:m1], cache, fmt, spec, [0, m1], [m1], table, scale)
    salient1 = _paper_step(q[:m1].transpose(0, 1), k[:m1], 0, scale, ratio, B)
    (k4, kc), (v4, vc), (ck, pk), (cv, pv) = _four_bit(k[:m1].view(2, B, H, D), v[:m1].view(2, B, H, D),
                                                    torch.full((2,), B))
    k_scale, k_zero = (ck._stats_from_page(pk, n) for n in ("scale", "zero"))
    v_scale, v_zero = (cv._stats_from_page(pv, n) for n in ("scale", "zero"))
    mid = lambda c, s, z: ((c >> 2) * 4 + 1.5) * s + z  # noqa: E731
    sal = salient1.view(2, B, H)[..., None]
    k_hist = torch.where(sal, k4, mid(kc, k_scale, k_zero)).flatten(0, 1)
    v_hist = torch.where(sal, v4, mid(vc, v_scale, v_zero)).flatten(0, 1)
    out = attend_and_write(q[m1:], k[m1:], v[m1:], cache, fmt, spec, [0, m2], [m1 + m2], table, scale)
    keys = torch.cat([k_hist, k[m1:]]).repeat_interleave(hq // H, 1)
    values = torch.cat([v_hist, v[m1:]]).repeat_interleave(hq // H, 1)
    logits = torch.einsum("qhd,khd->hqk", q[m1:], keys) * scale
    logits = logits.masked_fill(~torch.ones(m2, m1 + m2, dtype=torch.bool).tril(m1), float("-inf"))
    torch.testing.assert_close(out, torch.einsum("hqk,khd->qhd", logits.softmax(-1), values), rtol=1e-4, atol=1e-5)
    stored = fmt.salient(cache[table[0].long()])
    assert stored[:2].reshape(-1, H).eq(salient1).all()
    salient2 = _paper_step(q[m1:].transpose(0, 1), torch.cat([k_hist, k[m1:]]), m1, scale, ratio, B)
    assert stored[2:].reshape(-1, H)[:m2].eq(salient2[m1:]).all()
    assert stored.sum(1).tolist()[3] == [3, 3]  # 5 tokens: ceil(0.5 * 5)


def test_decoding_holds_new_tokens_while_slots_are_free_and_recompresses_on_the_interval():
    g = torch.Generator().manual_seed(7)
    hq, scale = 4, 0.3
    fmt = _fmt(0.5)  # 16 slots of 32
    spec = SalientSpec(ratio=0.5, recompress_interval=10, probe_recent=1.0, probe_random=0.0)
    cache = torch.zeros(2, fmt.page_bytes, dtype=torch.uint8)
    table = torch.tensor([[1, 0]])
    n = 8
    q, k, v = torch.randn(n, hq, D, generator=g), torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)
    attend_and_write(q, k, v, cache, fmt, spec, [0, n], [n], table, scale)
    assert fmt.salient(cache[1:2]).sum(1).tolist() == [[4, 4]]
    counts = []
    for L in range(n + 1, B + 1):
        q, k, v = (torch.randn(1, h, D, generator=g) for h in (hq, H, H))
        attend_and_write(q, k, v, cache, fmt, spec, [0, 1], [L], table, scale)
        salient = fmt.salient(cache[1:2])[0]
        counts.append(salient.sum(0).tolist())
        if L % 10:
            assert salient[L - 1].all() or salient.sum(0).eq(fmt.slots).all()  # held, or the block is full
        else:
            assert salient.sum(0).tolist() == [math.ceil(0.5 * L)] * H
    assert counts[-1] == [fmt.slots] * H and max(max(c) for c in counts) == fmt.slots


@pytest.mark.parametrize("setting, message", [
    ({"default": {"k_bits": 2, "v_bits": 2}, "salient": {}},
     r"needs every compressed layer at K4/channel V4/token .* but layer 0 is K2/channel V2/token"),
    ({"default": {"k_bits": 4, "v_bits": 4, "v_channel_scaling": True}, "salient": {}}, r"layer 0 is K4"),
    ({"default": {"k_bits": 4, "v_bits": 4}, "salient": {}, "merge": {}}, r"'salient' and 'merge' cannot be combined"),
])
def test_settings_zipcache_cannot_serve_are_refused(setting, message):
    with pytest.raises(KVCompressionConfigError, match=message):
        load_config(setting).check_salient_layers(4)


def test_bad_zipcache_fields_are_refused_with_the_field_and_value():
    for fields, message in (({"ratio": 0}, r"field 'salient.ratio' = 0"),
                            ({"low_bits": 3}, r"field 'salient.low_bits' = 3"),
                            ({"score": "h2o"}, r"field 'salient.score' = 'h2o'"),
                            ({"recompress_interval": 0}, r"field 'salient.recompress_interval' = 0"),
                            ({"probes": 1}, r"unknown field 'salient.probes'; allowed fields here: high_bits")):
        with pytest.raises(KVCompressionConfigError, match=message):
            load_config({"default": {"k_bits": 4, "v_bits": 4}, "salient": fields})


@pytest.mark.engine
def test_engine_attends_through_the_precision_the_paper_chooses(gqa, monkeypatch):
    """A prompt in chunks of 128 tokens (a page) and a decode step in a real engine, every layer's
    attention against the method written out from the recorded queries, keys and values: each chunk
    reads earlier chunks' tokens at 4 bits where normalized attention over that chunk's queries
    ranked them in their block's top half, else at the middle of their 2-bit level."""
    from engine_utils import engine, greedy, kv_capacity_tokens, prose, record_attention

    recorded = record_attention(monkeypatch)
    setting = {"default": {"k_bits": 4, "v_bits": 4},
               "salient": {"ratio": 0.5, "probe_recent": 1.0, "probe_random": 0.0}}
    chunks = {"enable_chunked_prefill": True, "max_num_batched_tokens": 128, "max_num_seqs": 4}
    with engine(gqa, setting, **chunks) as llm:
        assert len(greedy(llm, [prose(230, 61)], max_tokens=2)[0]) == 2
        capacity = kv_capacity_tokens(llm)
    with engine(gqa) as llm:
        assert capacity > 4 * kv_capacity_tokens(llm)
    block, by_layer = 128, {}
    for c in recorded:
        by_layer.setdefault(c.layer, []).append(c)
    checked = 0
    for calls in by_layer.values():
        hq, heads, scale = calls[0].heads, calls[0].kv_heads, calls[0].scale
        d = calls[0].q.shape[-1] // hq if calls[0].q.dim() == 2 else calls[0].q.shape[-1]
        k_exact, v_exact, salient = [], [], []
        for c in calls:
            q, k, v, out = (t.reshape(t.shape[0], -1, d).float() for t in (c.q, c.k, c.v, c.out))
            m, L = q.shape[0], c.seq_lens[0]
            history = L - m
            assert sum(x.shape[0] for x in k_exact) == history
            if history:
                ks, vs, sal = torch.cat(k_exact), torch.cat(v_exact), torch.cat(salient)
                n = -(-history // block)
                pad = lambda x: torch.cat([x, x.new_zeros(n * block - history, *x.shape[1:])]).view(n, block, *x.shape[1:])  # noqa: E731
                filled = torch.tensor([min(block, history - i * block) for i in range(n)])
                (k4, kc), (v4, vc), (ck, pk), (cv, pv) = _four_bit(pad(ks), pad(vs), filled, block)
                mid = lambda codes, codec, page: (((codes >> 2) * 4 + 1.5) * codec._stats_from_page(page, "scale")  # noqa: E731
                                                  + codec._stats_from_page(page, "zero"))
                s = pad(sal)[..., None]
                k_hist = torch.where(s, k4, mid(kc, ck, pk)).flatten(0, 1)[:history]
                v_hist = torch.where(s, v4, mid(vc, cv, pv)).flatten(0, 1)[:history]
            else:
                k_hist, v_hist = k[:0], v[:0]
            keys = torch.cat([k_hist, k]).repeat_interleave(hq // heads, 1)
            values = torch.cat([v_hist, v]).repeat_interleave(hq // heads, 1)
            logits = torch.einsum("qhd,khd->hqk", q, keys) * scale
            logits = logits.masked_fill(~torch.ones(m, L, dtype=torch.bool).tril(history), float("-inf"))
            torch.testing.assert_close(out, torch.einsum("hqk,khd->qhd", logits.softmax(-1), values),
                                       rtol=1e-4, atol=1e-4)
            checked += history > 0
            if m > 1:  # a prompt chunk: its block's choice (decodes are held, and are not read here)
                chosen = _paper_step(q.transpose(0, 1), torch.cat([k_hist, k]), history, scale, 0.5, block)
                k_exact.append(k), v_exact.append(v), salient.append(chosen[history:])
    assert checked >= 2 * len(by_layer)  # a later chunk and the decode step, in every layer
