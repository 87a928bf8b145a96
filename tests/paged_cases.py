"""Pages of random (never zero) K/V for the decode-kernel tests, written through the torch reference."""

import torch

from vllm_kvcompress import paged_torch
from vllm_kvcompress.config import LayerFormat

# the packed formats every kernel test covers: 2/3/4/8 bits, and ZipCache's channel-scaled V
PACKED_FORMATS = [LayerFormat(k_bits=4, v_bits=4), LayerFormat(k_bits=2, v_bits=2), LayerFormat(k_bits=8, v_bits=8),
                  LayerFormat(k_bits=3, v_bits=3), LayerFormat(k_bits=4, v_bits=2, v_channel_scaling=True)]


def format_id(layer_format: LayerFormat) -> str:
    """A test id for a layer format."""
    return layer_format.describe().replace("/", "_").replace(" ", "-")


def request_slots(table_row, block_size, positions):
    """The slots of a request's tokens at ``positions``, from its row of the block table."""
    return table_row[positions // block_size].long() * block_size + positions % block_size


def scattered_blocks(seq_lens, block_size, spare_blocks, gen):
    """A block table that scatters each request's blocks over a cache of ``spare_blocks`` pages more
    than they need (drawn from ``gen``): (number of pages, table [requests, most blocks] int32)."""
    counts = [-(-L // block_size) for L in seq_lens]
    num_blocks = sum(counts) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(max(counts), 1), dtype=torch.int32)
    used = 0
    for i, n in enumerate(counts):
        table[i, :n] = perm[used:used + n]
        used += n
    return num_blocks, table


def block_fills(table, seq_lens, block_size, num_blocks):
    """[num_blocks] the tokens each page holds, of requests of ``seq_lens`` tokens behind ``table``."""
    filled = torch.zeros(num_blocks, dtype=torch.long)
    for i, L in enumerate(seq_lens):
        for j in range(-(-L // block_size)):
            filled[table[i, j].long()] = min(block_size, L - j * block_size)
    return filled


def encoded_pages(fmt, seq_lens, spare_blocks, seed, encode):
    """Each request's blocks encoded at once by ``encode(gen, n, filled)`` (``n`` blocks, ``filled``
    [n] tokens each; ``gen`` draws the values) into scattered pages of a zeroed cache, behind a
    block table (formats with their own pages: ZipCache's, MiniCache's)."""
    gen = torch.Generator().manual_seed(seed)
    B = fmt.block_size
    num_blocks, table = scattered_blocks(seq_lens, B, spare_blocks, gen)
    cache = torch.zeros(num_blocks, fmt.page_bytes, dtype=torch.uint8)
    for i, L in enumerate(seq_lens):
        n = -(-L // B)
        if n:
            filled = torch.tensor([min(B, L - j * B) for j in range(n)])
            cache[table[i, :n].long()] = encode(gen, n, filled)
    return cache, table


def salient_pages(fmt, seq_lens, spare_blocks, seed):
    """ZipCache's pages (``SalientTokensFormat``) of random K/V, each block's salient tokens drawn at
    random up to its slots, behind a block table that scatters each request's blocks over the cache."""
    B, H, D = fmt.block_size, fmt.k.num_heads, fmt.k.head_size

    def encode(g, n, filled):
        k, v = torch.randn(n, B, H, D, generator=g), torch.randn(n, B, H, D, generator=g) * 2
        salient = torch.rand(n, B, H, generator=g).argsort(1) < torch.minimum(filled, torch.tensor(fmt.slots))[:, None, None]
        return fmt.encode(k, v, filled, salient)

    return encoded_pages(fmt, seq_lens, spare_blocks, seed, encode)


def fill_pages(fmt, seq_lens, spare_blocks, seed, garbage=False, tokens=None):
    """Each request's tokens in scattered pages, behind a block table; ``spare_blocks`` pages more.
    With ``garbage``, spare pages and the unwritten rest of a last page hold random bytes (float16
    infinities and NaNs among them), to which a kernel must give no weight; else zeros, as in
    vLLM's cache. ``tokens``, a list, receives each request's K and V [L, H, D]."""
    gen = torch.Generator().manual_seed(seed)
    B, H, D = fmt.block_size, fmt.k.num_heads, fmt.k.head_size
    num_blocks = sum(-(-L // B) for L in seq_lens) + spare_blocks
    cache = (torch.randint(0, 256, (num_blocks, fmt.page_bytes), dtype=torch.uint8, generator=gen) if garbage
             else torch.zeros(num_blocks, fmt.page_bytes, dtype=torch.uint8))
    _, table = scattered_blocks(seq_lens, B, spare_blocks, gen)
    for i, L in enumerate(seq_lens):
        k = torch.randn(L, H, D, generator=gen) + 0.3
        v = torch.randn(L, H, D, generator=gen) - 0.2
        slots = request_slots(table[i], B, torch.arange(L))
        paged_torch.write_tokens(cache, fmt, k, v, slots)
        if tokens is not None:
            tokens.append((k, v))
    return cache, table


def free_before(cache, table, first_keys, block_size):
    """Each row's blocks wholly before its first visible key (a sliding window's) pointed at one
    page of NaN bytes, as vLLM frees them: the pages and table a windowed read must see through."""
    cache = torch.cat([cache, torch.full_like(cache[:1], 0xFF)])
    table = table.clone()
    for i, first in enumerate(first_keys):
        table[i, :max(0, first) // block_size] = cache.shape[0] - 1
    return cache, table


def assert_replays_equal_eager(step, inputs, steps, out, cache):
    """``step(pages)`` (a decode step's launches over the tensors ``inputs``, into ``out``) captured once
    in a CUDA graph over a copy of ``cache`` and replayed for each of ``steps`` (values for
    ``inputs``), and run eagerly on another copy: ``out`` and the pages equal bit for bit after each."""
    for x, y in zip(inputs, steps[0]):
        x.copy_(y)
    step(cache.to("cuda", copy=True))  # compiles and plans outside capture
    pages, eager = cache.to("cuda", copy=True), cache.to("cuda", copy=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(pages)
    for s, values in enumerate(steps):
        for x, y in zip(inputs, values):
            x.copy_(y)
        graph.replay()
        replayed = out.clone()
        step(eager)
        assert torch.equal(replayed, out), s
        assert torch.equal(pages, eager), s
