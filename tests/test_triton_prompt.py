"""Prompt chunks on the GPU path: each chunk's own tokens exactly (FlashAttention), its history from
the pages through the decode kernel, which continues from FlashAttention's output and log-sum-exp.

Checked against the torch reference (``paged_torch.attend`` with the chunks' new K/V). On the CPU the
decode kernel runs in Triton's interpreter and a torch causal attention stands in for FlashAttention
(vLLM's CPU build has none); on a GPU both are the real ones.
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
from vllm_kvcompress.triton_kernels import prompt  # noqa: E402
from vllm_kvcompress.triton_kernels.decode import rows_per_program  # noqa: E402
from paged_cases import fill_pages  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, H, HQ, D = 16, 2, 4, 64


def torch_own_chunk_attention(query, key, value, query_start, max_query_len, sm_scale, out, window=None):
    """What FlashAttention gives ``own_chunk_attention``: each chunk's causal attention over its own
    tokens (within a sliding ``window``) into ``out`` and the rows' natural log-sum-exp [Hq, T]."""
    starts = query_start.tolist()
    lse = torch.empty(query.shape[1], query.shape[0], dtype=torch.float32, device=query.device)
    group = query.shape[1] // key.shape[1]
    for a, b in zip(starts, starts[1:]):
        q = query[a:b].float().transpose(0, 1)                                  # [Hq, m, D]
        k, v = (t[a:b].float().repeat_interleave(group, 1).transpose(0, 1) for t in (key, value))
        hidden = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).triu(1)
        if window is not None:
            hidden |= torch.ones_like(hidden).tril(-window)
        scores = (q @ k.transpose(1, 2) * sm_scale).masked_fill(hidden, float("-inf"))
        out[a:b] = (scores.softmax(-1) @ v).transpose(0, 1).to(out.dtype)
        lse[:, a:b] = scores.logsumexp(-1)
    return lse


@pytest.fixture
def own_attention(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setattr(prompt, "own_chunk_attention", torch_own_chunk_attention)


def _chunks(seq_lens, q_lens, seed, bits=4, block=B):
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_bits=bits, v_bits=bits), dtype, block, H, D)
    tokens = []
    cache, table = fill_pages(fmt, seq_lens, 3, seed=seed, tokens=tokens)
    key = torch.cat([k[L - m:] for (k, _), L, m in zip(tokens, seq_lens, q_lens)])
    value = torch.cat([v[L - m:] for (_, v), L, m in zip(tokens, seq_lens, q_lens)])
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    qkv = torch.randn(qsl[-1], (HQ + 2 * H) * D, generator=torch.Generator().manual_seed(seed + 1))
    q = qkv[:, :HQ * D].view(qsl[-1], HQ, D)  # a view into a fused QKV output, as the engine hands it over
    return fmt, cache, table, qsl, q.to(dtype), key.to(dtype), value.to(dtype)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("prompt_rows", [None, 16, 64], ids=["row-per-program", "8-rows-grouped", "32-rows-grouped"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_prompt_chunks_equal_reference(own_attention, bits, prompt_rows, num_splits):
    """A 25-token chunk after 15 tokens, a 9-token prompt (no history) and a 2-token chunk after 30:
    every token equals the reference, which reads the history from the pages and the chunk's own
    tokens exactly; reading the chunks back from the pages (the decode rows' answer) is told apart."""
    seq_lens, q_lens = [40, 9, 32], [25, 9, 2]
    fmt, cache, table, qsl, q, key, value = _chunks(seq_lens, q_lens, seed=bits)
    ref = paged_torch.attend(q.float(), cache, fmt, qsl, seq_lens, table, D ** -0.5, key=key, value=value)
    positions = [p for L, m in zip(seq_lens, q_lens) for p in range(L - m + 1, L + 1)]
    rows_of = torch.repeat_interleave(torch.arange(3), torch.tensor(q_lens))
    read_back = paged_torch.attend(q.float(), cache, fmt, list(range(len(positions) + 1)), positions, table[rows_of],
                                   D ** -0.5)
    per_group = rows_per_program(HQ // H, prompt_rows) if prompt_rows else 1
    rows = token_rows(qsl, [15, 0, 30], table.to(DEVICE), per_group)
    assert rows.seq_lens.tolist() == [15] * 25 + [0] * 9 + [30] * 2
    assert rows.query_start.tolist() == qsl and rows.max_query_len == 25
    out = torch.full((qsl[-1], HQ, D), float("nan"), dtype=q.dtype, device=DEVICE)
    dev = [t.to(DEVICE) for t in (q, key, value, cache)]
    if num_splits == 1:
        got = prompt.paged_prompt(*dev, fmt, rows, D ** -0.5, out=out)
    else:  # the split count the backend's plan would pick is 1 at these lengths: ask for 4 directly
        lse = prompt.own_chunk_attention(dev[0], dev[1], dev[2], rows.query_start, rows.max_query_len, D ** -0.5, out)
        from vllm_kvcompress.triton_kernels.decode import paged_decode
        got = paged_decode(dev[0], dev[3], fmt, rows.block_table, rows.seq_lens, D ** -0.5, rows.max_seq_len,
                           num_splits=num_splits, out=out, groups=rows.groups, prior_lse=lse)
    torch.testing.assert_close(got.float().cpu(), ref, rtol=2e-2, atol=2e-2)
    assert (got.float().cpu() - read_back).abs().max() > 0.1


@pytest.mark.parametrize("prompt_rows", [None, 16, 64], ids=["row-per-program", "8-rows-grouped", "32-rows-grouped"])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_sliding_window_chunks_equal_reference(own_attention, prompt_rows, num_splits):
    """A sliding-window layer's chunks (window 20): a 25-token chunk after 15 tokens (its first
    tokens see some history, its last none), a 9-token prompt, a 2-token chunk after 30 and a
    33-token chunk after 37, with every page wholly before a chunk's first window reading as NaN
    (vLLM has freed it): each token equals the reference's. Without the window they differ."""
    from paged_cases import free_before
    seq_lens, q_lens, window = [40, 9, 32, 70], [25, 9, 2, 33], 20
    fmt, cache, table, qsl, q, key, value = _chunks(seq_lens, q_lens, seed=11)
    history = [L - m for L, m in zip(seq_lens, q_lens)]
    cache, table = free_before(cache, table, [h - window + 1 for h in history], B)
    ref = paged_torch.attend(q.float(), cache, fmt, qsl, seq_lens, table, D ** -0.5, window, key=key, value=value)
    per_group = rows_per_program(HQ // H, prompt_rows) if prompt_rows else 1
    rows = token_rows(qsl, history, table.to(DEVICE), per_group)
    assert rows.first_keys(window).tolist() == [h + i - window + 1 for h, m in zip(history, q_lens) for i in range(m)]
    out = torch.full((qsl[-1], HQ, D), float("nan"), dtype=q.dtype, device=DEVICE)
    got = prompt.paged_prompt(*[t.to(DEVICE) for t in (q, key, value, cache)], fmt, rows, D ** -0.5, out=out,
                              window=window, num_splits=num_splits)
    torch.testing.assert_close(got.float().cpu(), ref, rtol=2e-2, atol=2e-2)
    _, whole_cache, whole_table, *_ = _chunks(seq_lens, q_lens, seed=11)
    whole = paged_torch.attend(q.float(), whole_cache, fmt, qsl, seq_lens, whole_table, D ** -0.5, key=key, value=value)
    assert (whole - ref).abs().max() > 0.1


def test_chunks_without_history_launch_no_decode(own_attention, monkeypatch):
    """A step of first chunks only: FlashAttention's output is the answer, and no page is read."""
    seq_lens = q_lens = [7, 12]
    fmt, cache, table, qsl, q, key, value = _chunks(seq_lens, q_lens, seed=3)
    ref = paged_torch.attend(q.float(), cache, fmt, qsl, seq_lens, table, D ** -0.5, key=key, value=value)
    monkeypatch.setattr(prompt, "paged_decode", lambda *a, **k: pytest.fail("the decode kernel was launched"))
    rows = token_rows(qsl, [0, 0], table.to(DEVICE), rows_per_program(HQ // H))
    out = torch.empty(qsl[-1], HQ, D, dtype=q.dtype, device=DEVICE)
    got = prompt.paged_prompt(*[t.to(DEVICE) for t in (q, key, value, cache)], fmt, rows, D ** -0.5, out=out)
    torch.testing.assert_close(got.float().cpu(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_splits", [1, 4])
def test_planned_layers_equal_reference(num_splits, monkeypatch):
    """A step's prompt chunks in three layers, each with its own pages, queries and new K/V: the
    later layers launch the decode kernel through the first one's plan (FlashAttention's log-sum-exp
    is a new tensor in every layer), and every layer's output equals the reference. (The plans start
    empty: earlier tests may have filled them to their limit, past which each new one drops one.)"""
    from vllm_kvcompress.launch_plans import LaunchPlans
    from vllm_kvcompress.triton_kernels import decode
    monkeypatch.setattr(decode, "_plans", LaunchPlans())
    seq_lens, q_lens = [40, 9], [25, 9]
    plans = None
    for layer in range(3):
        fmt, cache, table, qsl, q, key, value = _chunks(seq_lens, q_lens, seed=30 + layer)
        ref = paged_torch.attend(q.float(), cache, fmt, qsl, seq_lens, table, D ** -0.5, key=key, value=value)
        if layer == 0:
            rows = token_rows(qsl, [15, 0], table.cuda(), rows_per_program(HQ // H))
            plans = len(decode._plans._plans)
        else:  # the step's block table: this layer's pages moved to the first layer's blocks
            cache = _moved(cache, table, first_table, seq_lens)
        first_table = table if layer == 0 else first_table
        out = torch.empty(qsl[-1], HQ, D, dtype=q.dtype, device="cuda")
        lse = prompt.own_chunk_attention(q.cuda(), key.cuda(), value.cuda(), rows.query_start, rows.max_query_len,
                                         D ** -0.5, out)
        got = decode.paged_decode(q.cuda(), cache.cuda(), fmt, rows.block_table, rows.seq_lens, D ** -0.5,
                                  rows.max_seq_len, num_splits=num_splits, out=out, groups=rows.groups, prior_lse=lse)
        torch.testing.assert_close(got.float().cpu(), ref, rtol=2e-2, atol=2e-2)
    assert len(decode._plans._plans) == plans + 1


def _moved(cache, table, to_table, seq_lens):
    moved = torch.zeros_like(cache)
    for r, length in enumerate(seq_lens):
        used = -(-length // B)
        moved[to_table[r, :used].long()] = cache[table[r, :used].long()]
    return moved
