"""Prompt chunks whose history is decoded once into 16-bit rows, then attended with the chunk's own
tokens in one FlashAttention call (``triton_kernels.history``).

The decoded rows are checked against the format's torch reference (``KVPageFormat.decode``), the
attention against ``paged_torch.attend`` with the chunks' new K/V. On the CPU the history kernel runs
in Triton's interpreter and a torch attention stands in for FlashAttention; on a GPU both are real.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "0" if __import__("torch").cuda.is_available() else "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from vllm_kvcompress import paged_torch  # noqa: E402
from vllm_kvcompress.config import LayerFormat  # noqa: E402
from vllm_kvcompress.formats import KVPageFormat  # noqa: E402
from vllm_kvcompress.token_rows import token_rows  # noqa: E402
from vllm_kvcompress.triton_kernels import history  # noqa: E402
from paged_cases import fill_pages, format_id, free_before  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16
B, H, HQ, D = 16, 2, 4, 64


def torch_chunks_attention(query, key, value, query_start, max_query_len, key_start, max_key_len, sm_scale, out,
                           window=None):
    """What FlashAttention gives ``chunks_attention``: each chunk's m queries over its n keys, query i
    seeing keys j <= i + n - m (causal, aligned at the end) and, with a ``window``, j > i + n - m - window;
    the rows' natural log-sum-exp [Hq, T]."""
    group = query.shape[1] // key.shape[1]
    lse = torch.empty(query.shape[1], query.shape[0], dtype=torch.float32, device=query.device)
    for (qa, qb), (ka, kb) in zip(zip(query_start.tolist(), query_start.tolist()[1:]),
                                  zip(key_start.tolist(), key_start.tolist()[1:])):
        m, n = qb - qa, kb - ka
        q = query[qa:qb].float().transpose(0, 1)
        k, v = (t[ka:kb].float().repeat_interleave(group, 1).transpose(0, 1) for t in (key, value))
        last_seen = torch.arange(m)[:, None] + n - m
        j = torch.arange(n)[None, :]
        hidden = j > last_seen
        if window is not None:
            hidden |= j <= last_seen - window
        scores = (q @ k.transpose(1, 2) * sm_scale).masked_fill(hidden.to(q.device), float("-inf"))
        out[qa:qb] = (scores.softmax(-1) @ v).transpose(0, 1).to(out.dtype)
        lse[:, qa:qb] = scores.logsumexp(-1)
    return lse


@pytest.fixture
def flash_attention(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setattr(history, "chunks_attention", torch_chunks_attention)
        from test_triton_prompt import torch_own_chunk_attention
        monkeypatch.setattr(history, "own_chunk_attention", torch_own_chunk_attention)


def _chunks(layer_format, seq_lens, q_lens, seed, block=B):
    fmt = KVPageFormat.from_layer_format(layer_format, DTYPE, block, H, D)
    tokens = []
    cache, table = fill_pages(fmt, seq_lens, 3, seed=seed, tokens=tokens)
    key = torch.cat([k[L - m:] for (k, _), L, m in zip(tokens, seq_lens, q_lens)]).to(DTYPE)
    value = torch.cat([v[L - m:] for (_, v), L, m in zip(tokens, seq_lens, q_lens)]).to(DTYPE)
    qsl = torch.tensor([0] + q_lens).cumsum(0).tolist()
    q = torch.randn(qsl[-1], HQ, D, generator=torch.Generator().manual_seed(seed + 1)).to(DTYPE)
    return fmt, cache, table, qsl, q, key, value


def _reference_lse(q, cache, fmt, table, seq_lens, q_lens, key):
    """Each chunk row's natural log-sum-exp over its decoded history and its chunk's exact K up to
    itself [Hq, T]: from ``KVPageFormat.decode``'s keys."""
    rows = []
    group = HQ // H
    start = 0
    for i, (L, m) in enumerate(zip(seq_lens, q_lens)):
        hist = L - m
        k_hist = fmt.decode(cache[table[i, :-(-hist // B)].long()])[0].flatten(0, 1)[:hist] if hist else key[:0].float()
        k = torch.cat([k_hist, key[start:start + m].float()]).repeat_interleave(group, 1)  # [L, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q[start:start + m].float(), k) * D ** -0.5
        hidden = torch.arange(L)[None, :] > (hist + torch.arange(m))[:, None]
        rows.append(scores.masked_fill(hidden, float("-inf")).logsumexp(-1))
        start += m
    return torch.cat(rows, dim=1)


def test_plan_places_history_pages_then_own_tokens():
    """Chunks of 3 and 2 tokens after 20 and 0 tokens, and 4 after 40 with a window of 10: pages of
    16 tokens; the windowed chunk's first query sees keys from 31 on, so its rows start at page 1."""
    plan = history.HistoryPlan([0, 3, 5], [20, 0], 16, None)
    assert plan.items.tolist() == [[0, 0, 0, 16], [0, 1, 16, 4]]
    assert plan.key_start.tolist() == [0, 23, 25] and plan.max_key_len == 23
    assert plan.own_rows.tolist() == [20, 21, 22, 23, 24]
    windowed = history.HistoryPlan([0, 4], [40], 16, 10)
    assert windowed.items.tolist() == [[0, 1, 0, 16], [0, 2, 16, 8]]
    assert windowed.own_rows.tolist() == [24, 25, 26, 27] and windowed.num_keys == 28


def test_groups_keep_the_key_buffer_bound(monkeypatch):
    """Chunks of 5, 4 and 6 keys (history and own tokens) at 10 bytes a key, 100 bytes at most a group."""
    monkeypatch.setattr(history, "KEY_BUFFER_BYTES", 100)
    assert history.key_groups([0, 2, 4, 10], [3, 2, 0], row_bytes=10) == [(0, 2), (2, 3)]
    assert history.key_groups([0, 2, 4], [3, 2], row_bytes=1) == [(0, 2)]


@pytest.mark.parametrize("layer_format", [
    LayerFormat(k_bits=4, v_bits=4), LayerFormat(k_bits=2, v_bits=2), LayerFormat(k_bits=3, v_bits=3),
    LayerFormat(k_bits=8, v_bits=8), LayerFormat(k_bits=4, v_bits=2, v_channel_scaling=True),
    LayerFormat(k_bits=16, v_bits=4),
], ids=format_id)
def test_history_rows_equal_the_format_decode(layer_format):
    """Every history row equals ``KVPageFormat.decode``'s value of that token (one rounding to the
    model's dtype), from scattered pages, a partial last page included."""
    seq_lens = [37, 16, 5]
    fmt, cache, table, *_ = _chunks(layer_format, seq_lens, [1, 1, 1], seed=7)
    qsl, histories = [0, 1, 2, 3], [L - 1 for L in seq_lens]
    plan = history.HistoryPlan(qsl, histories, B, None)
    rows = token_rows(qsl, histories, table.to(DEVICE))
    items = torch.tensor(plan.items.ravel(), dtype=torch.int32, device=DEVICE)
    k, v = history.history_rows(cache.to(DEVICE), fmt, rows.block_table, plan, items, DTYPE)
    for i, hist in enumerate(histories):
        want_k, want_v = fmt.decode(cache[table[i, :-(-hist // B)].long()])
        start = int(plan.key_start[i])
        got_k, got_v = k[start:start + hist].float().cpu(), v[start:start + hist].float().cpu()
        tol = dict(rtol=0, atol=1e-5) if DTYPE == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
        torch.testing.assert_close(got_k, want_k.flatten(0, 1)[:hist].to(DTYPE).float(), **tol)
        torch.testing.assert_close(got_v, want_v.flatten(0, 1)[:hist].to(DTYPE).float(), **tol)


@pytest.mark.parametrize("ratio", [0.5, 0.25])
def test_zipcache_history_rows_equal_the_format_decode(ratio):
    """ZipCache's pages (a 2-bit high plane for every token, refinement rows for the salient ones):
    every history row equals ``SalientTokensFormat.decode``'s, 4-bit tokens and 2-bit ones alike."""
    from vllm_kvcompress.formats.salient import SalientTokensFormat
    from paged_cases import salient_pages
    fmt = SalientTokensFormat.create(ratio, DTYPE, B, H, D)
    seq_lens = [37, 16, 5]
    cache, table = salient_pages(fmt, seq_lens, 3, seed=9)
    qsl = [0, 1, 2, 3]
    plan = history.HistoryPlan(qsl, seq_lens, B, None)
    rows = token_rows(qsl, seq_lens, table.to(DEVICE))
    items = torch.tensor(plan.items.ravel(), dtype=torch.int32, device=DEVICE)
    k, v = history.history_rows(cache.to(DEVICE), fmt, rows.block_table, plan, items, DTYPE)
    tol = dict(rtol=0, atol=1e-5) if DTYPE == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
    for i, hist in enumerate(seq_lens):
        pages = cache[table[i, :-(-hist // B)].long()]
        assert fmt.salient(pages).any() and not fmt.salient(pages).all()
        want_k, want_v = fmt.decode(pages)
        start = int(plan.key_start[i])
        torch.testing.assert_close(k[start:start + hist].float().cpu(), want_k.flatten(0, 1)[:hist].to(DTYPE).float(),
                                   **tol)
        torch.testing.assert_close(v[start:start + hist].float().cpu(), want_v.flatten(0, 1)[:hist].to(DTYPE).float(),
                                   **tol)


@pytest.mark.parametrize("layer_format", [LayerFormat(k_bits=4, v_bits=4), LayerFormat(k_bits=2, v_bits=2)],
                         ids=format_id)
def test_chunks_equal_reference(flash_attention, layer_format):
    """A 25-token chunk after 15 tokens, a 9-token prompt (no history) and a 2-token chunk after 30:
    every token equals the reference, which reads the history from the pages and the chunk's own
    tokens exactly; reading the chunks back from the pages (the decode rows' answer) is told apart."""
    seq_lens, q_lens = [40, 9, 32], [25, 9, 2]
    fmt, cache, table, qsl, q, key, value = _chunks(layer_format, seq_lens, q_lens, seed=3)
    ref = paged_torch.attend(q.float(), cache, fmt, qsl, seq_lens, table, D ** -0.5, key=key, value=value)
    positions = [p for L, m in zip(seq_lens, q_lens) for p in range(L - m + 1, L + 1)]
    rows_of = torch.repeat_interleave(torch.arange(3), torch.tensor(q_lens))
    read_back = paged_torch.attend(q.float(), cache, fmt, list(range(len(positions) + 1)), positions, table[rows_of],
                                   D ** -0.5)
    rows = token_rows(qsl, [15, 0, 30], table.to(DEVICE))
    out = torch.full((qsl[-1], HQ, D), float("nan"), dtype=DTYPE, device=DEVICE)
    dev = [t.to(DEVICE) for t in (q, key, value, cache)]
    lse = history.dense_prompt(*dev, fmt, rows, D ** -0.5, out)
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)
    assert (out.float().cpu() - read_back).abs().max() > 0.1
    torch.testing.assert_close(lse.cpu(), _reference_lse(q, cache, fmt, table, seq_lens, q_lens, key), rtol=1e-3,
                               atol=1e-3)
    plans = dict(rows.step_plans)
    again = torch.empty_like(out)
    history.dense_prompt(*dev, fmt, rows, D ** -0.5, again)  # the step's next layer
    assert all(rows.step_plans[k] is plans[k] for k in plans) and len(plans) == 1  # planned once a step
    torch.testing.assert_close(again, out, rtol=0, atol=0)


def test_groups_of_chunks_equal_one_call(flash_attention, monkeypatch):
    """With a key buffer that holds one chunk at a time, each chunk goes through its own call: the
    same answer as one call for all."""
    seq_lens, q_lens = [40, 9, 32], [25, 9, 2]
    fmt, cache, table, qsl, q, key, value = _chunks(LayerFormat(k_bits=4, v_bits=4), seq_lens, q_lens, seed=5)
    rows = token_rows(qsl, [15, 0, 30], table.to(DEVICE))
    dev = [t.to(DEVICE) for t in (q, key, value, cache)]
    whole = torch.empty_like(dev[0])
    whole_lse = history.dense_prompt(*dev, fmt, rows, D ** -0.5, whole)
    calls = []
    attention = history.chunks_attention
    monkeypatch.setattr(history, "chunks_attention", lambda *a, **k: calls.append(1) or attention(*a, **k))
    monkeypatch.setattr(history, "KEY_BUFFER_BYTES", 40 * 2 * H * D * DTYPE.itemsize)  # the longest chunk's keys
    rows = token_rows(qsl, [15, 0, 30], table.to(DEVICE))  # the next step's
    grouped = torch.empty_like(dev[0])
    grouped_lse = history.dense_prompt(*dev, fmt, rows, D ** -0.5, grouped)
    assert len(calls) == 3
    torch.testing.assert_close(grouped, whole)
    torch.testing.assert_close(grouped_lse, whole_lse)


def test_sliding_window_skips_freed_pages(flash_attention):
    """A sliding-window layer's chunks (window 20), every page wholly before a chunk's first window
    reading as NaN (vLLM has freed it): each token equals the reference's. Without the window they
    differ."""
    seq_lens, q_lens, window = [40, 9, 32, 70], [25, 9, 2, 33], 20
    layer_format = LayerFormat(k_bits=4, v_bits=4)
    fmt, cache, table, qsl, q, key, value = _chunks(layer_format, seq_lens, q_lens, seed=11)
    histories = [L - m for L, m in zip(seq_lens, q_lens)]
    cache, table = free_before(cache, table, [h - window + 1 for h in histories], B)
    ref = paged_torch.attend(q.float(), cache, fmt, qsl, seq_lens, table, D ** -0.5, window, key=key, value=value)
    rows = token_rows(qsl, histories, table.to(DEVICE))
    out = torch.full((qsl[-1], HQ, D), float("nan"), dtype=DTYPE, device=DEVICE)
    history.dense_prompt(*[t.to(DEVICE) for t in (q, key, value, cache)], fmt, rows, D ** -0.5, out, window=window)
    got = out
    torch.testing.assert_close(got.float().cpu(), ref, rtol=2e-2, atol=2e-2)
    _, whole_cache, whole_table, *_ = _chunks(layer_format, seq_lens, q_lens, seed=11)
    whole = paged_torch.attend(q.float(), whole_cache, fmt, qsl, seq_lens, whole_table, D ** -0.5, key=key, value=value)
    assert (whole - ref).abs().max() > 0.1


@pytest.mark.parametrize("seq_lens,q_lens,buffer_keys,route", [
    ([7, 12], [7, 12], 130, "none"),             # first chunks only: no page read
    ([40, 32], [3, 2], 130, "decode-kernel"),    # 2.6 rows a history token, 2 query heads a KV head: 5.2
    ([80, 9, 130], [60, 9, 70], 130, "history"),  # 65 rows a history token: 130
    ([80, 9, 130], [60, 9, 70], 129, "decode-kernel"),  # the last chunk's 130 keys pass the buffer
], ids=["no-history", "few-rows", "many-rows", "many-rows-past-the-buffer"])
def test_steps_take_the_route_their_rows_a_history_token_ask(flash_attention, monkeypatch, seq_lens, q_lens,
                                                             buffer_keys, route):
    """``prompt_chunks`` decodes the history ahead only where a step's chunks have at least
    ``MIN_HEAD_ROWS_A_HISTORY_TOKEN`` query rows times query heads a KV head for each history token
    (here set to 100) and each chunk's keys fit the buffer; every route equals the reference."""
    monkeypatch.setattr(history, "MIN_HEAD_ROWS_A_HISTORY_TOKEN", 100)
    monkeypatch.setattr(history, "KEY_BUFFER_BYTES", buffer_keys * 2 * H * D * DTYPE.itemsize)
    from test_triton_prompt import torch_own_chunk_attention
    from vllm_kvcompress.triton_kernels import prompt
    if DEVICE == "cpu":
        monkeypatch.setattr(prompt, "own_chunk_attention", torch_own_chunk_attention)
    fmt, cache, table, qsl, q, key, value = _chunks(LayerFormat(k_bits=4, v_bits=4), seq_lens, q_lens, seed=3)
    ref = paged_torch.attend(q.float(), cache, fmt, qsl, seq_lens, table, D ** -0.5, key=key, value=value)
    taken = []
    for name in ("paged_prompt", "dense_prompt"):
        run = getattr(history, name)
        monkeypatch.setattr(history, name, lambda *a, run=run, name=name, **k: taken.append(name) or run(*a, **k))
    histories = [L - m for L, m in zip(seq_lens, q_lens)]
    rows = token_rows(qsl, histories, table.to(DEVICE))
    got = history.prompt_chunks(*[t.to(DEVICE) for t in (q, key, value, cache)], fmt, rows, D ** -0.5,
                                torch.empty(qsl[-1], HQ, D, dtype=DTYPE, device=DEVICE))
    assert taken == {"none": [], "decode-kernel": ["paged_prompt"], "history": ["dense_prompt"]}[route]
    torch.testing.assert_close(got.float().cpu(), ref, rtol=2e-2, atol=2e-2)
