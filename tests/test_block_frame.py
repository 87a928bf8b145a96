"""``k_block_frame``: K kept in its block's RoPE frame, turned forward by its offset when read."""

import os

os.environ.setdefault("TRITON_INTERPRET", "0" if __import__("torch").cuda.is_available() else "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_kvcompress import paged_torch  # noqa: E402
from vllm_kvcompress.block_rope import BlockRope  # noqa: E402
from vllm_kvcompress.config import KVCompressionConfigError, LayerFormat, load_config  # noqa: E402
from vllm_kvcompress.formats import KVPageFormat  # noqa: E402
from paged_cases import fill_pages  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rope_angles(positions: torch.Tensor, head_size: int, base: float = 10000.0) -> torch.Tensor:
    """RoFormer's angles: position times base^(-2i / D), [len, D / 2]."""
    inv_freq = base ** (-torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
    return positions.double()[:, None] * inv_freq[None, :]


def rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] turned by ``angles`` [T, D / 2] as NeoX-style RoPE turns it (halves paired)."""
    cos, sin = angles.cos()[:, None].float(), angles.sin()[:, None].float()
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def block_table(rows: int, head_size: int) -> BlockRope:
    angles = rope_angles(torch.arange(rows), head_size)
    return BlockRope(torch.cat([angles.cos(), angles.sin()], dim=-1).float())


def test_a_key_turned_back_by_its_offset_sits_in_its_blocks_frame():
    """RoPE at position p = p0 + j, turned back by j: the key before RoPE turned by p0, for every
    token of the block; turning forward again gives the key as RoPE made it."""
    B, H, D = 32, 2, 64
    pre = torch.randn(3 * B, H, D, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(3 * B)
    post = rope(pre, rope_angles(positions, D))
    table = block_table(B, D)
    framed = table.turn(post, positions % B, -1.0)
    torch.testing.assert_close(framed, rope(pre, rope_angles(positions - positions % B, D)), atol=2e-5, rtol=0)
    torch.testing.assert_close(table.turn(framed, positions % B, 1.0), post, atol=2e-5, rtol=0)


def _framed_pages(layer_format: LayerFormat, seq_lens, H, D, B, dtype):
    """Pages of keys that a real RoPE turned (a few strong channels before RoPE, as in trained models),
    written in block frames; and the same keys' pages as stored without the frame."""
    fmt = KVPageFormat.from_layer_format(layer_format, dtype, B, H, D)
    cache, table = fill_pages(fmt, seq_lens, 2, seed=3)
    gen = torch.Generator().manual_seed(4)
    rope_table = block_table(B, D)
    for i, L in enumerate(seq_lens):
        pre = torch.randn(L, H, D, generator=gen)
        pre[..., [3, 40]] += 8.0  # outlier channels before RoPE: one fast pair, one slow one
        post = rope(pre, rope_angles(torch.arange(L), D))
        framed = rope_table.turn(post, torch.arange(L) % B, -1.0)
        blocks = table[i, :-(-L // B)].long()
        k, v = fmt.decode(cache[blocks])
        k.flatten(0, 1)[:L] = framed
        cache[blocks] = fmt.encode(k, v, torch.tensor([min(B, L - n * B) for n in range(len(blocks))]))
    return fmt, cache, table, rope_table


FRAMED = [LayerFormat(k_bits=4, v_bits=4, k_block_frame=True),
          LayerFormat(k_bits=2, v_bits=2, outlier_tokens=1, k_block_frame=True),
          LayerFormat(k_bits=3, v_bits=2, outlier_tokens=1, k_block_frame=True),
          LayerFormat(k_bits=8, v_bits=8, k_block_frame=True)]


@pytest.mark.parametrize("layer_format", FRAMED, ids=lambda f: f"k{f.k_bits}v{f.v_bits}o{f.outlier_tokens}")
@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("HQ", [4, 2], ids=["GQA", "MHA"])
def test_decode_turns_framed_keys_as_the_reference(layer_format, num_splits, HQ):
    """The Triton decode over framed pages equals the torch path's attention, which turns each
    decoded key forward by its offset; reading the same pages as if unframed gives another answer."""
    from vllm_kvcompress.triton_kernels.decode import paged_decode

    B, H, D = 32, 2, 64
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    seq_lens = [70, 17, 33]
    fmt, cache, table, rope_table = _framed_pages(layer_format, seq_lens, H, D, B, dtype)
    q = torch.randn(len(seq_lens), HQ, D, generator=torch.Generator().manual_seed(num_splits)).to(dtype)
    args = (list(range(len(seq_lens) + 1)), seq_lens, table, D ** -0.5)
    ref = paged_torch.attend(q.float(), cache, fmt, *args, block_rope=rope_table)
    device_rope = BlockRope(rope_table.cos_sin.to(DEVICE))
    got = paged_decode(q.to(DEVICE), cache.to(DEVICE), fmt, table.to(DEVICE),
                       torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), D ** -0.5, max(seq_lens),
                       num_splits=num_splits, block_rope=device_rope)
    torch.testing.assert_close(got.float().cpu(), ref, rtol=2e-2, atol=2e-2)
    unframed = KVPageFormat.from_layer_format(layer_format.model_copy(update={"k_block_frame": False}), dtype, B, H, D)
    assert (paged_torch.attend(q.float(), cache, unframed, *args) - ref).abs().max() > 0.2


def test_framed_pages_hold_keys_closer_than_unframed_ones():
    """The lever itself: keys with strong channels before RoPE, 2 bits per channel over blocks of
    128, come back with a far smaller error when stored in block frames."""
    B, H, D, L = 128, 1, 64, 256
    pre = torch.randn(L, H, D, generator=torch.Generator().manual_seed(1))
    pre[..., [1, 5, 33, 37]] += 10.0
    post = rope(pre, rope_angles(torch.arange(L), D))
    errors = {}
    for framed in (False, True):
        fmt = KVPageFormat.from_layer_format(LayerFormat(k_bits=2, v_bits=2, k_block_frame=framed), torch.float32,
                                             B, H, D)
        cache = torch.zeros(L // B, fmt.page_bytes, dtype=torch.uint8)
        table = block_table(B, D) if framed else None
        k = post if table is None else table.turn(post, torch.arange(L) % B, -1.0)
        paged_torch.write_tokens(cache, fmt, k, post, torch.arange(L))
        got = fmt.decode(cache)[0].flatten(0, 1)
        if table is not None:
            got = table.turn(got, torch.arange(L) % B, 1.0)
        errors[framed] = (got - post).square().mean().item()
    assert errors[True] < 0.5 * errors[False], errors


@pytest.mark.parametrize("fields,message", [
    ({"k_bits": 16, "v_bits": 4, "k_block_frame": True}, "k_block_frame turns K before its per-channel grids; "
                                                         "not with k_bits = 16"),
    ({"k_bits": 4, "v_bits": 4, "k_axis": "token", "k_block_frame": True}, "k_axis = 'token'"),
    ({"k_bits": 4, "k_only": True, "k_block_frame": True}, "k_only = True"),
])
def test_bad_block_frame_settings_are_refused(fields, message):
    with pytest.raises(KVCompressionConfigError, match=message):
        load_config({"default": fields})


@pytest.mark.parametrize("prompt_rows", [None, 16], ids=["row-per-program", "grouped"])
def test_prompt_history_turns_framed_keys_as_the_reference(monkeypatch, prompt_rows):
    """Prompt chunks over framed pages: their own tokens exactly, the history through the decode
    kernel's turns, as the torch path (CPU: a torch causal attention stands in for FlashAttention)."""
    from test_triton_prompt import torch_own_chunk_attention
    from vllm_kvcompress.token_rows import token_rows
    from vllm_kvcompress.triton_kernels import prompt
    from vllm_kvcompress.triton_kernels.decode import rows_per_program

    if DEVICE == "cpu":
        monkeypatch.setattr(prompt, "own_chunk_attention", torch_own_chunk_attention)
    B, H, HQ, D = 32, 2, 4, 64
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    seq_lens, q_lens = [70, 33], [20, 5]
    fmt, cache, table, rope_table = _framed_pages(FRAMED[1], seq_lens, H, D, B, dtype)
    gen = torch.Generator().manual_seed(9)
    q, key, value = (torch.randn(sum(q_lens), n, D, generator=gen).to(dtype) for n in (HQ, H, H))
    qsl = [0, q_lens[0], sum(q_lens)]
    ref = paged_torch.attend(q.float(), cache, fmt, qsl, seq_lens, table, D ** -0.5, key=key, value=value,
                             block_rope=rope_table)
    per_group = rows_per_program(HQ // H, prompt_rows) if prompt_rows else 1
    rows = token_rows(qsl, torch.tensor(seq_lens, device=DEVICE), table.to(DEVICE), 50, per_group)
    out = torch.empty(sum(q_lens), HQ, D, dtype=dtype, device=DEVICE)
    got = prompt.paged_prompt(*(t.to(DEVICE) for t in (q, key, value, cache)), fmt, rows, D ** -0.5, out=out,
                              block_rope=BlockRope(rope_table.cos_sin.to(DEVICE)))
    torch.testing.assert_close(got.float().cpu(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rope_type,neox,refusal", [
    ("default", True, None), ("linear", True, None),
    ("yarn", True, r"has a rotary embedding whose turns do not compose \(off by 0.1"),
    ("default", False, "turns 64 of 64 channels, GPT-J style"),
])
def test_tables_come_from_the_layers_rope_and_compose(rope_type, neox, refusal):
    """The table is the layer's own RoPE at offsets 0..: RoFormer's angles (linear scaling divides
    them by its factor); YaRN scales cos and sin, so turns by offsets would not compose with the
    block's first position, and GPT-J pairs lie in other planes: both refused at load, naming why."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm_kvcompress.block_rope import _table

    params = {"rope_theta": 10000.0, "rope_type": rope_type}
    if rope_type != "default":
        params |= {"factor": 4.0, "original_max_position_embeddings": 1024}
    with set_current_vllm_config(VllmConfig()):
        layer_rope = get_rope(64, 4096, neox, params, torch.float32)
        if refusal is not None:
            with pytest.raises(KVCompressionConfigError, match="kv-compression k_block_frame: layer 7 " + refusal):
                _table(layer_rope, 64, "layer 7")
            return
        table = _table(layer_rope, 64, "layer 7")
    angles = rope_angles(torch.arange(table.shape[0]), 64) / (4.0 if rope_type == "linear" else 1.0)
    torch.testing.assert_close(table, torch.cat([angles.cos(), angles.sin()], -1).float(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("heads,head_size", [(3, 64), (8, 128), (1, 256)])
def test_the_frame_preset_holds_the_clip_presets_tokens(heads, head_size):
    """The frame costs no bytes: quant-k2v2-o1-frame's page is quant-k2v2-o1-clip's, at SmolLM2's,
    the Llama-2-7B and Gemma 3's shapes."""
    pages = [KVPageFormat.from_layer_format(load_config(name).default, torch.bfloat16, 128, heads, head_size).page_bytes
             for name in ("quant-k2v2-o1-frame", "quant-k2v2-o1-clip")]
    assert pages[0] == pages[1]
    assert load_config("quant-k2v2-o1-frame").default.k_block_frame
