"""The Triton kernels over ZipCache's pages (the decode kernel's SALIENT path, the write) against the
torch reference of the same pages.

Runs on the CPU in Triton's interpreter and, where a GPU is present, on the GPU.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "0" if __import__("torch").cuda.is_available() else "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from paged_cases import assert_replays_equal_eager, salient_pages  # noqa: E402
from vllm_kvcompress.formats.salient import SalientTokensFormat  # noqa: E402
from vllm_kvcompress.triton_kernels.salient_decode import decode_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _assert_same_tokens(fmt, ours, cache, table, lens):
    """The requests' tokens read the same from both caches (a block's rows past its last hold none)."""
    for i, L in enumerate(lens):
        blocks = table[i, :-(-L // fmt.block_size)].long()
        for a, b in zip(fmt.decode(ours[blocks]), fmt.decode(cache[blocks])):
            torch.testing.assert_close(a.flatten(0, 1)[:L], b.flatten(0, 1)[:L], rtol=0, atol=1e-6)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("HQ", [4, 2, 8, 1])
@pytest.mark.parametrize("block", [32, 128])
def test_decode_rows_equal_attention_over_the_decoded_pages(HQ, block, splits):
    """Decode rows over their history from the pages (refined tokens' low bits through the slot map,
    the others at the middle of their sub-levels) and their own new token: the output and the merged
    log-sum-exp equal attention over the decoded pages plus that token, in one split or three (the
    merge kernel's log-sum-exp), a row of no history included."""
    H, D = 2 if HQ > 1 else 1, 64
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    fmt = SalientTokensFormat.create(0.6, dtype, block, H, D)
    history = [0, 17, block, 3 * block - 5, 70]
    cache, table = salient_pages(fmt, history, 3, seed=HQ + block)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(len(history), HQ, D, generator=g)
    k_new, v_new = torch.randn(len(history), H, D, generator=g), torch.randn(len(history), H, D, generator=g)
    scale = D ** -0.5
    dev = [x.to(DEVICE, dtype) for x in (q, k_new, v_new)]
    out = torch.empty_like(dev[0])
    lse = decode_rows(*dev, cache.to(DEVICE), fmt, table.to(DEVICE),
                      torch.tensor(history, dtype=torch.int32, device=DEVICE), scale, max(history), out,
                      num_splits=splits)
    for i, L in enumerate(history):
        k, v = (x.flatten(0, 1)[:L] for x in fmt.decode(cache[table[i, :-(-L // block)].long()]))
        k, v = torch.cat([k, k_new[i:i + 1]]), torch.cat([v, v_new[i:i + 1]])
        logits = torch.einsum("hd,khd->hk", q[i], k.repeat_interleave(HQ // H, 1)) * scale
        want = torch.einsum("hk,khd->hd", logits.softmax(-1), v.repeat_interleave(HQ // H, 1))
        # the decode kernel's products take float16 factors (as test_triton_decode's); on the GPU
        # bfloat16 queries besides
        tol = 2e-2 if DEVICE == "cpu" else 3e-2
        torch.testing.assert_close(out[i].float().cpu(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(lse[:, i].cpu(), logits.logsumexp(-1), rtol=tol, atol=tol)


@pytest.mark.parametrize("write,window,HQ",
                         [("torch", None, 4), ("triton", None, 4), ("triton", 40, 4), ("triton", None, 2)])
@pytest.mark.parametrize("score", ["normalized", "random"])
def test_decode_steps_through_the_kernel_equal_the_torch_path(score, write, window, HQ):
    """Decode steps of three requests through the kernel, continuing from each new token's exact term,
    and written all at once (``write_decoded``, the torch write or the Triton one), against
    ``attend_and_write`` one request at a time: the same outputs, and the same pages after each step
    (the same 4-bit tokens chosen, K's grids widened alike, or kept), across a re-compression
    (context 100) and a block boundary (64); with a sliding window of 40 (the Triton write), each row
    and its probe see their window alone; with one query head a KV head (HQ 2), MHA's tile and warps.
    On a GPU, whose products round as TF32, the outputs are compared at that precision and the
    choice (which near-ties may flip) is not."""
    from vllm_kvcompress.config import SalientSpec
    from vllm_kvcompress.salient_torch import attend_and_write, write_decoded
    from vllm_kvcompress.triton_kernels import salient_write

    H, D, B = 2, 64, 64
    fmt = SalientTokensFormat.create(0.5, torch.float32, B, H, D)
    spec = SalientSpec(ratio=0.5, score=score)
    g = torch.Generator().manual_seed(9)
    lens = [90, 60, 31]  # prompts; then decodes to 104, 74, 45 tokens
    table = torch.arange(3 * 4, dtype=torch.int32).view(3, 4)
    cache = torch.zeros(12, fmt.page_bytes, dtype=torch.uint8)
    for i, L in enumerate(lens):
        q, k, v = torch.randn(L, HQ, D, generator=g), torch.randn(L, H, D, generator=g), torch.randn(L, H, D, generator=g)
        attend_and_write(q, k, v, cache, fmt, spec, [0, L], [L], table[i:i + 1], D ** -0.5, window)
    ours = cache.clone()
    for step in range(14):
        lens = [L + 1 for L in lens]
        q, k, v = torch.randn(3, HQ, D, generator=g), torch.randn(3, H, D, generator=g), torch.randn(3, H, D, generator=g)
        k = k * (0.1 if step % 2 else 1.0)  # every other step K inside its channels' grids: no widening
        want = attend_and_write(q, k, v, cache, fmt, spec, [0, 1, 2, 3], lens, table, D ** -0.5, window)
        dev = lambda x: x.to(DEVICE)  # noqa: E731
        got = torch.empty_like(dev(q))
        ours_dev = dev(ours)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        windowed = {} if window is None else dict(window=window, first_keys=seq_lens - window)
        lse = decode_rows(dev(q), dev(k), dev(v), ours_dev, fmt, dev(table), seq_lens - 1, D ** -0.5, max(lens), got,
                          **windowed)
        if write == "triton":
            salient_write.write_decoded(dev(q), dev(k), dev(v), ours_dev, fmt, spec, dev(table), seq_lens, lse.t(),
                                        D ** -0.5, window=window)
        else:
            write_decoded(dev(q), dev(k), dev(v), ours_dev, fmt, spec, dev(table), seq_lens, lse.t(), D ** -0.5)
        ours = ours_dev.cpu()
        tol = 2e-2 if DEVICE == "cpu" else 3e-2  # the decode kernel's float16 factors (as above)
        torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)
        if DEVICE != "cpu":
            ours = cache.clone()
            continue
        assert torch.equal(fmt.salient(ours), fmt.salient(cache)), step
        _assert_same_tokens(fmt, ours, cache, table, lens)


def _decode_step_args(fmt, history, HQ, seed, dtype):
    """A decode step's query and new K/V for rows of ``history`` tokens, on the device."""
    g = torch.Generator().manual_seed(seed)
    n, H, D = len(history), fmt.k.num_heads, fmt.k.head_size
    return [torch.randn(n, heads, D, generator=g).to(DEVICE, dtype) for heads in (HQ, H, H)]


def test_padding_rows_write_nothing():
    """A full CUDA graph's batch is padded after its decodes with rows of context 0, whose block
    table row holds a block that no decode writes (vLLM's null block): the write leaves every page
    as the decodes alone leave it."""
    from vllm_kvcompress.config import SalientSpec
    from vllm_kvcompress.triton_kernels import salient_write

    H, HQ, D, B = 2, 4, 64, 32
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    fmt = SalientTokensFormat.create(0.6, dtype, B, H, D)
    history = [40, 70]
    cache, table = salient_pages(fmt, history, 2, seed=4)
    # every entry a padding row may read (its own, or the row before's last) holds request 0's first
    # block, which holds tokens and takes none this step
    held = table[0, 0].item()
    table = torch.cat([table, torch.full((2, 1), held, dtype=table.dtype)], 1)
    padded_table = torch.cat([table, torch.full_like(table[:1], held)]).to(DEVICE)
    q, k, v = _decode_step_args(fmt, history + [0], HQ, 6, dtype)
    lens = torch.tensor([L + 1 for L in history] + [0], dtype=torch.int32, device=DEVICE)
    lse = torch.zeros(HQ, 3, device=DEVICE).t()
    spec = SalientSpec(ratio=0.6)
    want, got = cache.to(DEVICE, copy=True), cache.to(DEVICE, copy=True)
    salient_write.write_decoded(q[:2], k[:2], v[:2], want, fmt, spec, padded_table[:2], lens[:2], lse[:2], D ** -0.5)
    salient_write.write_decoded(q, k, v, got, fmt, spec, padded_table, lens, lse, D ** -0.5)
    assert torch.equal(got, want)


@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA graphs need a GPU")
def test_decode_steps_replayed_in_a_cuda_graph():
    """Decode steps as vLLM's full CUDA graphs run them: three rows and a padding row (context 0)
    captured once with the split count of the longest context allowed, replayed for three steps
    whose tokens advance (a re-compression included), equal launch for launch to the same step run
    eagerly: outputs and pages bit for bit."""
    from vllm_kvcompress.config import SalientSpec
    from vllm_kvcompress.triton_kernels import salient_write

    H, HQ, D, B = 2, 8, 128, 64
    fmt = SalientTokensFormat.create(0.6, torch.bfloat16, B, H, D)
    spec = SalientSpec(ratio=0.6, recompress_interval=100)
    history = [98, 40, 300]
    cache, table = salient_pages(fmt, history + [0], 6, seed=7)
    table = table.to(DEVICE)
    steps = [[*_decode_step_args(fmt, history + [0], HQ, 20 + s, torch.bfloat16),
              torch.tensor([L + 1 + s for L in history] + [0], dtype=torch.int32, device=DEVICE)]
             for s in range(3)]
    inputs = [torch.empty_like(x) for x in steps[0]]
    out = torch.empty_like(inputs[0])

    def step(pages):
        q, k, v, lens = inputs
        lse = decode_rows(q, k, v, pages, fmt, table, (lens - 1).clamp(min=0), D ** -0.5, 2048, out)
        salient_write.write_decoded(q, k, v, pages, fmt, spec, table, lens, lse.t(), D ** -0.5)

    assert_replays_equal_eager(step, inputs, steps, out, cache)


@pytest.mark.skipif(DEVICE == "cpu", reason="registers are counted by the GPU's compiler")
@pytest.mark.parametrize("HQ", [2, 8])
def test_decode_writes_hold_to_their_register_budget(HQ):
    """A decode row's write at the serving shape (blocks of 128, heads of 128) compiles within the
    registers it is given (MHA 96, GQA 168): left to itself the compiler takes over 200, which
    leaves two programs a SM."""
    from vllm_kvcompress.config import SalientSpec
    from vllm_kvcompress.triton_kernels import launch, salient_write

    H, D, B = 2, 128, 128
    fmt = SalientTokensFormat.create(0.6, torch.bfloat16, B, H, D)
    history = [98, 300]
    cache, table = salient_pages(fmt, history, 2, seed=3)
    q, k, v = _decode_step_args(fmt, history, HQ, 5, torch.bfloat16)
    lens = torch.tensor([L + 1 for L in history], dtype=torch.int32, device=DEVICE)
    lse = torch.zeros(len(history), HQ, device=DEVICE)
    salient_write.write_decoded(q, k, v, cache.to(DEVICE), fmt, SalientSpec(ratio=0.6), table.to(DEVICE), lens, lse,
                                D ** -0.5)
    budget = salient_write.decode_tuning(HQ // H).registers
    compiled = [c.kernel for (variant, _), c in launch._compiled.items()
                if variant.kernel is salient_write._salient_write_kernel and variant.constants["DECODE"]
                and variant.constants["G"] == HQ // H and variant.constants["D"] == D]
    assert compiled and all(kernel.n_regs <= budget for kernel in compiled), [k.n_regs for k in compiled]


@pytest.mark.parametrize("splits", [1, 2])
def test_grouped_prompt_rows_continue_a_prior_attention(splits):
    """Prompt chunks' tokens as rows over their chunk's history, taken in groups of 9 tokens of 4
    query heads (two programs' worth of one chunk, a partial last group), continuing a prior
    attention (what FlashAttention gives over the chunk's own tokens), and a chunk with no history:
    each row equals the prior merged with attention over its decoded history, the prior's
    log-sum-exp replaced by the merged one; the row without history keeps its prior."""
    from vllm_kvcompress.token_rows import token_rows
    from vllm_kvcompress.triton_kernels.decode import paged_decode

    H, HQ, D, B = 2, 4, 64, 32
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    fmt = SalientTokensFormat.create(0.6, dtype, B, H, D)
    seq_lens, q_lens = [70, 5, 40], [20, 5, 3]
    cache, table = salient_pages(fmt, [L - m for L, m in zip(seq_lens, q_lens)], 3, seed=4)
    table = torch.cat([table, torch.zeros(3, 2, dtype=torch.int32)], 1)  # room for the chunks' blocks
    qsl = [0, 20, 25, 28]
    g = torch.Generator().manual_seed(8)
    q = torch.randn(28, HQ, D, generator=g)
    prior, prior_lse = torch.randn(28, HQ, D, generator=g), torch.randn(HQ, 28, generator=g)
    rows = token_rows(qsl, [50, 0, 37], table.to(DEVICE), rows_per_group=9)
    scale = D ** -0.5
    out, lse = prior.to(DEVICE, dtype).clone(), prior_lse.to(DEVICE).clone()
    paged_decode(q.to(DEVICE, dtype), cache.to(DEVICE), fmt, rows.block_table, rows.seq_lens, scale, 50,
                 num_splits=splits, out=out, groups=rows.groups, prior_lse=lse, lse_out=True)
    tol = 2e-2 if DEVICE == "cpu" else 3e-2  # the decode kernel's float16 factors
    for t, (i, history) in enumerate(zip([0] * 20 + [1] * 5 + [2] * 3, rows.seq_lens.tolist())):
        assert history == seq_lens[i] - q_lens[i]
        if history == 0:
            torch.testing.assert_close(out[t].float().cpu(), prior[t].to(dtype).float(), rtol=0, atol=0)
            torch.testing.assert_close(lse[:, t].cpu(), prior_lse[:, t], rtol=1e-6, atol=1e-6)  # via base 2
            continue
        k, v = (x.flatten(0, 1)[:history] for x in fmt.decode(cache[table[i, :-(-history // B)].long()]))
        logits = torch.einsum("hd,khd->hk", q[t], k.repeat_interleave(HQ // H, 1)) * scale
        earlier = torch.einsum("hk,khd->hd", logits.softmax(-1), v.repeat_interleave(HQ // H, 1))
        total = torch.logaddexp(logits.logsumexp(-1), prior_lse[:, t])
        want = (earlier * (logits.logsumexp(-1) - total).exp()[:, None]
                + prior[t] * (prior_lse[:, t] - total).exp()[:, None])
        torch.testing.assert_close(out[t].float().cpu(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(lse[:, t].cpu(), total, rtol=tol, atol=tol)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("score,probes,route", [
    ("normalized", None, "decode-kernel"), ("random", None, "decode-kernel"), ("normalized", 2, "decode-kernel"),
    ("normalized", None, "history"), ("random", None, "history"),
], ids=["normalized", "random", "normalized-2-probes-a-product", "normalized-history", "random-history"])
def test_prompt_steps_through_the_kernels_equal_the_torch_path(score, probes, route, window, monkeypatch):
    """Steps of prompt chunks from three requests, batched (``salient_prompt``: own attention, history
    rows in groups, merged; then ``write_chunks`` over all touched blocks at once, the probes' scores
    in the write kernel), against
    ``attend_and_write`` one request at a time: the same outputs and, on the CPU, the same pages after
    every step. The steps cover a first chunk, chunks with history across block boundaries, a
    one-token chunk (held at 4 bits) and a chunk that opens a fresh block; with a sliding window of
    20, each token and probe see their window alone. On the CPU a torch causal attention stands in
    for FlashAttention. With 2 probes a product, a chunk's probes take several products, whose
    scores add up over the block's tokens. Both routes of a step's history: the decode kernel's rows,
    or the history decoded once and one FlashAttention call (``history.dense_prompt``)."""
    from test_triton_history import torch_chunks_attention
    from test_triton_prompt import torch_own_chunk_attention
    from vllm_kvcompress.config import SalientSpec
    from vllm_kvcompress.salient_torch import attend_and_write, plan_chunk_writes
    from vllm_kvcompress.token_rows import token_rows
    from vllm_kvcompress.triton_kernels import history, prompt, salient_prompt, salient_write

    if DEVICE == "cpu":
        monkeypatch.setattr(prompt, "own_chunk_attention", torch_own_chunk_attention)
        monkeypatch.setattr(history, "chunks_attention", torch_chunks_attention)
    monkeypatch.setattr(history, "MIN_HEAD_ROWS_A_HISTORY_TOKEN", 0 if route == "history" else 10 ** 9)
    if probes is not None:
        monkeypatch.setattr(salient_write, "PROBES", probes)
    H, HQ, D, B = 2, 4, 64, 32
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    fmt = SalientTokensFormat.create(0.5, dtype, B, H, D)
    spec = SalientSpec(ratio=0.5, score=score)
    g = torch.Generator().manual_seed(11)
    table = torch.arange(3 * 4, dtype=torch.int32).view(3, 4).flip(1)
    cache = torch.zeros(12, fmt.page_bytes, dtype=torch.uint8)
    ours = cache.clone().to(DEVICE)
    lens = [0, 0, 0]
    for q_lens in ([40, 0, 17], [30, 64, 1], [1, 5, 46]):
        lens = [L + m for L, m in zip(lens, q_lens)]
        qsl = torch.tensor([0] + q_lens).cumsum(0).tolist()
        q = torch.randn(qsl[-1], HQ, D, generator=g).to(dtype)
        k, v = (torch.randn(qsl[-1], H, D, generator=g).to(dtype) for _ in range(2))
        want = attend_and_write(q.float(), k.float(), v.float(), cache, fmt, spec, qsl, lens, table, D ** -0.5,
                                window)
        histories = [L - m for L, m in zip(lens, q_lens)]
        rows = token_rows(qsl, histories, table.to(DEVICE), rows_per_group=9)
        got = torch.full((qsl[-1], HQ, D), float("nan"), dtype=dtype, device=DEVICE)
        dev = [t.to(DEVICE) for t in (q, k, v)]
        writes = plan_chunk_writes(fmt, spec, qsl, lens, table.to(DEVICE))
        salient_prompt.salient_prompt(*dev, ours, fmt, spec, rows, writes, D ** -0.5, got, window=window)
        tol = 2e-2 if DEVICE == "cpu" else 3e-2  # the decode kernel's float16 factors
        torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol)
        if DEVICE != "cpu":  # TF32 products may flip near-ties of the choice: the next step starts level
            ours = cache.clone().to(DEVICE)
            continue
        assert torch.equal(fmt.salient(ours), fmt.salient(cache)), q_lens
        _assert_same_tokens(fmt, ours, cache, table, lens)


def test_the_plan_puts_fresh_blocks_first_each_with_its_own_draw():
    """``plan_chunk_writes`` lists the blocks that held no token before the step first (``fresh`` of
    them; the write takes those through its kernel without stored tokens), and each block keeps its
    own columns and drawn scores: the draw ``attend_and_write`` makes for the block's tokens."""
    from vllm_kvcompress.config import SalientSpec
    from vllm_kvcompress.salient_torch import _random_scores, plan_chunk_writes

    B, H = 32, 2
    fmt = SalientTokensFormat.create(0.5, torch.float32, B, H, 64)
    spec = SalientSpec(ratio=0.5, score="random")
    table = torch.arange(3 * 4, dtype=torch.int32).view(3, 4)
    q_lens, lens = [30, 70, 1], [40, 70, 65]  # histories 10 (a block with tokens, then a fresh one), 0, 64
    qsl = torch.tensor([0] + q_lens).cumsum(0).tolist()
    writes = plan_chunk_writes(fmt, spec, qsl, lens, table)
    stored = writes.num_stored.tolist()
    assert writes.fresh == 5 and stored == [0] * 5 + [10], stored
    blocks = {b: i for i, b in enumerate(writes.blocks.tolist())}
    assert sorted(blocks) == [0, 1, 4, 5, 6, 10]  # request 0: blocks 0, 1; request 1: 4..6; request 2: 10
    for request, L in enumerate(lens):
        for c in range((L - q_lens[request]) // B, -(-L // B)):
            i = blocks[int(table[request, c])]
            assert writes.start[i] == c * B and writes.filled[i] == min(L - c * B, B)
            want = _random_scores(L, H, spec)[c * B:min(L, c * B + B)]
            torch.testing.assert_close(writes.scores[i, :len(want)], want, rtol=0, atol=0)


def _three_requests_chunk_writes(H: int, D: int):
    """A step's chunk writes over 32-token blocks: a chunk after history, a first chunk over three
    blocks, one token; the format, spec, query start locations and the plan."""
    from vllm_kvcompress.config import SalientSpec
    from vllm_kvcompress.salient_torch import plan_chunk_writes

    fmt = SalientTokensFormat.create(0.5, torch.float32, 32, H, D)
    spec = SalientSpec(ratio=0.5)
    q_lens, lens = [30, 70, 1], [40, 70, 65]
    qsl = torch.tensor([0] + q_lens).cumsum(0).tolist()
    return fmt, spec, qsl, plan_chunk_writes(fmt, spec, qsl, lens, torch.arange(12, dtype=torch.int32).view(3, 4))


def test_the_write_takes_fresh_blocks_through_its_fresh_variant(monkeypatch):
    """``write_chunks`` launches the plan's first ``fresh`` blocks with FRESH and the others without,
    each launch from its first block on, over every block once."""
    from vllm_kvcompress.triton_kernels import salient_write

    launches = []
    first_block = salient_write._RUNTIME.index("first_block")
    monkeypatch.setattr(salient_write, "launch", lambda variant, grid, args: launches.append(
        (grid[0], args[first_block], variant.constants["FRESH"])))
    H, HQ, D = 2, 4, 64
    fmt, spec, qsl, writes = _three_requests_chunk_writes(H, D)
    q, kv = torch.zeros(qsl[-1], HQ, D), torch.zeros(qsl[-1], H, D)
    salient_write.write_chunks(q, kv, kv, torch.zeros(12, fmt.page_bytes, dtype=torch.uint8), fmt, spec, writes,
                               torch.zeros(qsl[-1], HQ), D ** -0.5)
    assert launches == [(5, 0, True), (1, 5, False)]


def test_a_steps_later_layers_launch_the_first_layers_chunk_writes_with_their_own_pointers(monkeypatch):
    """On CUDA, ``write_chunks`` plans the step's launches at its first layer: a later layer launches
    the same compiled kernels, grids and arguments but for its own query, key, value, log-sum-exp and
    cache (and the cache wherever a kind reads no pointer), and the scratch scores are the first
    layer's; pointers of another alignment make a plan of their own."""
    from vllm_kvcompress.triton_kernels import salient_write

    launched, ran = [], []

    class Compiled:
        def __init__(self, variant):
            self.variant = variant

        def run(self, grid, stream, args):
            ran.append((self.variant, grid, stream, tuple(args)))

    def launch(variant, grid, args):
        launched.append((variant, tuple(grid) + (1,), args))
        return Compiled(variant)

    monkeypatch.setattr(salient_write, "plannable", lambda device: True)
    monkeypatch.setattr(salient_write, "stream_handle", lambda device: 7)
    monkeypatch.setattr(salient_write, "launch", launch)
    H, HQ, D = 2, 4, 64
    fmt, spec, qsl, writes = _three_requests_chunk_writes(H, D)
    t = qsl[-1]

    def layer():  # query, key, value, log-sum-exp ([T, Hq], as salient_prompt gives it) and cache
        return (torch.randn(t, HQ, D), torch.randn(t, H, D), torch.randn(t, H, D), torch.randn(HQ, t).t(),
                torch.zeros(12, fmt.page_bytes, dtype=torch.uint8))

    layers = [layer() for _ in range(3)]
    for q, k, v, lse, cache in layers:
        salient_write.write_chunks(q, k, v, cache, fmt, spec, writes, lse, D ** -0.5)
    assert [v.constants["FRESH"] for v, _, _ in launched] == [True, False]
    assert len(ran) == 4
    own = {"q_ptr": 0, "k_ptr": 1, "v_ptr": 2, "lse_ptr": 3, "pages_ptr": 4}
    for i, (q, k, v, lse, cache) in enumerate(layers[1:]):
        mine = (q, k, v, lse, cache)
        for (variant, grid, args), run in zip(launched, ran[2 * i:]):
            first_cache = args[salient_write._RUNTIME.index("pages_ptr")]
            expected = tuple(mine[own[name]].data_ptr() if name in own
                             else cache.data_ptr() if arg is first_cache
                             else arg.data_ptr() if isinstance(arg, torch.Tensor) else arg
                             for name, arg in zip(salient_write._RUNTIME, args))
            assert run == (variant, grid, 7, expected)
    unread = [name for name, arg in zip(salient_write._RUNTIME, launched[0][2])
              if name not in own and arg is layers[0][4]]
    assert unread  # the kinds here read no decode table: the cache's pointer goes there
    q, k, v, lse, cache = layers[0]
    shifted = torch.empty(t * H * D + 1)[1:].view(t, H, D)
    salient_write.write_chunks(q, k, shifted, cache, fmt, spec, writes, lse, D ** -0.5)
    assert len(launched) == 4 and len(ran) == 4


@pytest.mark.skipif(DEVICE == "cpu", reason="launches are planned on CUDA alone")
def test_a_layer_through_the_steps_plan_writes_as_it_would_alone():
    """Two steps of prompt chunks (fresh blocks, then both kinds) over two layers, the second layer's
    writes through the plan its first layer made (``write_chunks``), against the second layer's
    steps made alone (plans of their own): the same outputs and the same pages, bit for bit."""
    from vllm_kvcompress.config import SalientSpec
    from vllm_kvcompress.salient_torch import plan_chunk_writes
    from vllm_kvcompress.token_rows import token_rows
    from vllm_kvcompress.triton_kernels import salient_prompt

    H, HQ, D, B = 2, 4, 64, 32
    fmt = SalientTokensFormat.create(0.5, torch.bfloat16, B, H, D)
    spec = SalientSpec(ratio=0.5)
    g = torch.Generator().manual_seed(3)
    table = torch.arange(3 * 4, dtype=torch.int32, device=DEVICE).view(3, 4)
    first, second, alone = (torch.zeros(12, fmt.page_bytes, dtype=torch.uint8, device=DEVICE) for _ in range(3))
    lens = [0, 0, 0]
    for q_lens in ([40, 3, 17], [30, 64, 1]):
        lens = [L + m for L, m in zip(lens, q_lens)]
        qsl = torch.tensor([0] + q_lens).cumsum(0).tolist()
        histories = [L - m for L, m in zip(lens, q_lens)]

        def step(cache, writes, seed):
            gen = torch.Generator().manual_seed(seed)
            q = torch.randn(qsl[-1], HQ, D, generator=gen).to(DEVICE, torch.bfloat16)
            k, v = (torch.randn(qsl[-1], H, D, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(2))
            out = torch.empty_like(q)
            rows = token_rows(qsl, histories, table, rows_per_group=9)
            salient_prompt.salient_prompt(q, k, v, cache, fmt, spec, rows, writes, D ** -0.5, out)
            return out

        writes = plan_chunk_writes(fmt, spec, qsl, lens, table)
        seed = int(torch.randint(1 << 30, (1,), generator=g))
        step(first, writes, seed + 1)
        assert writes.launch_plans  # made at the first layer
        planned = step(second, writes, seed)
        own = step(alone, plan_chunk_writes(fmt, spec, qsl, lens, table), seed)
        assert torch.equal(planned, own) and torch.equal(second, alone), q_lens
    assert not torch.equal(first, second)


def test_warm_up_writes_nothing_and_compiles_what_steps_launch(monkeypatch):
    """The warm-up (every kernel a serving step launches over ZipCache's pages, writes included,
    compiled before serving) leaves a live cache as it was; on a GPU, decode and prompt steps after
    it compile nothing more (Triton's hook after each compile is never called)."""
    from vllm_kvcompress.triton_kernels import salient_prompt

    H, HQ, D, B = 2, 4, 64, 32
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    fmt = SalientTokensFormat.create(0.6, dtype, B, H, D)
    cache = torch.randint(0, 256, (8, fmt.page_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    cache = cache.to(DEVICE)
    before = cache.clone()
    salient_prompt.warm_up(cache, fmt, HQ, dtype)
    assert torch.equal(cache, before)
    if DEVICE == "cpu":
        return
    from triton import knobs

    compiled, hook = [], knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **info: compiled.append(info["repr"])  # after each compile
    try:
        _steps_after_warm_up(fmt, cache, HQ, H, D, dtype, monkeypatch)
    finally:
        knobs.runtime.jit_post_compile_hook = hook
    assert not compiled, compiled


def _steps_after_warm_up(fmt, cache, HQ, H, D, dtype, monkeypatch):
    """A decode step and a prompt step over ``cache`` (its history through each route), scores
    normalized and drawn, as serving runs them."""
    from vllm_kvcompress.config import SalientSpec
    from vllm_kvcompress.salient_torch import plan_chunk_writes
    from vllm_kvcompress.token_rows import token_rows
    from vllm_kvcompress.triton_kernels import history, salient_decode, salient_prompt, salient_write
    from vllm_kvcompress.triton_kernels.decode import longest_first, rows_per_program

    g = torch.Generator().manual_seed(2)
    table = torch.arange(8, dtype=torch.int32, device=DEVICE).view(2, 4)
    lens = torch.tensor([40, 70], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, HQ, D, generator=g).to(DEVICE, dtype)
    k, v = (torch.randn(2, H, D, generator=g).to(DEVICE, dtype) for _ in range(2))
    out = torch.empty_like(q)
    for score in ("normalized", "random"):
        spec = SalientSpec(ratio=0.6, score=score)
        lse = salient_decode.decode_rows(q, k, v, cache, fmt, table, lens - 1, D ** -0.5, 70, out,
                                         row_order=longest_first(lens - 1))
        salient_write.write_decoded(q, k, v, cache, fmt, spec, table, lens, lse.t(), D ** -0.5)
        qsl = [0, 9, 30]
        qp = torch.randn(30, HQ, D, generator=g).to(DEVICE, dtype)
        kp, vp = (torch.randn(30, H, D, generator=g).to(DEVICE, dtype) for _ in range(2))
        writes = plan_chunk_writes(fmt, spec, qsl, lens.tolist(), table)
        for ahead in (0, 10 ** 9):  # a step's route is decided once a step: a step each
            monkeypatch.setattr(history, "MIN_HEAD_ROWS_A_HISTORY_TOKEN", ahead)
            rows = token_rows(qsl, [31, 49], table, rows_per_program(HQ // H))
            salient_prompt.salient_prompt(qp, kp, vp, cache, fmt, spec, rows, writes, D ** -0.5, torch.empty_like(qp))


_SALIENT_KERNELS = """
import torch
from vllm_kvcompress.formats.salient import SalientTokensFormat
from vllm_kvcompress.triton_kernels import decode, salient_write

fmt = SalientTokensFormat.create(0.6, torch.bfloat16, 128, 8, 128)
runtime = dict(q_ptr="*bf16", cache_ptr="*u8", half_ptr="*fp16", block_table_ptr="*i32", seq_lens_ptr="*i32",
               group_rows_ptr="*i32", group_start_ptr="*i32", out_ptr="*bf16", part_ptr="*fp32", lse_ptr="*fp32",
               sm_scale="fp32")
runtime |= {name: "i32" for name in decode._decode_kernel.arg_names if name not in runtime and name.islower()}
for group, split, rows in ((1, False, None), (4, True, None), (1, False, 64), (4, False, 16)):
    compile_for_h100(decode._decode_kernel, runtime, decode.kernel_constants(
        fmt, group, split, 128, rows, True, rows is None, prior=True, lse_out=True))
merge = dict(part_ptr="*fp32", seq_lens_ptr="*i32", out_ptr="*bf16", lse_ptr="*fp32", out_stride="i32",
             num_splits="i32", lse_head_stride="i32")
compile_for_h100(decode._merge_splits_kernel, merge, decode._merge_variant(32, 128, True, True).constants)
kernel = salient_write._salient_write_kernel
write = {name: "*i32" for name in kernel.arg_names if name.endswith("_ptr")}
write |= dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", lse_ptr="*fp32", scores_ptr="*fp32", pages_ptr="*u8",
              scale="fp32", interval="i32", window="i32", first_block="i32")
write |= {name: "i32" for name in kernel.arg_names if name.endswith("_stride")}
for decode_rows, given, fresh in ((True, False, False), (False, False, False), (False, True, False),
                                  (False, False, True), (False, True, True)):
    compile_for_h100(kernel, write, salient_write.write_constants(fmt, 4)
                     | dict(DECODE=decode_rows, GIVEN=given, NORMALIZED=not decode_rows, FRESH=fresh))
"""


def test_the_salient_kernels_compile_for_the_gpu():
    """The decode kernel's SALIENT path (MHA one row, GQA split, prompt groups of MHA and GQA), the
    merge with its log-sum-exp out and the write (decode rows, prompt chunks with probes or drawn
    scores, into blocks with stored tokens or fresh ones) pass the sm_90 compiler's front end (the CPU
    suite runs them in the interpreter)."""
    from sm90 import compiles_for_h100

    compiles_for_h100(_SALIENT_KERNELS)
