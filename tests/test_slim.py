"""Slim attention: K-only pages, V = K W_KV (multi-head attention).

References: the identity itself (V from the V projection), vLLM's own RoPE (to check
the rotation back), and stock vLLM with compression off (at 16 bits the answer is
the same).
"""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from engine_utils import engine, greedy, kv_capacity_tokens, prompt_logprobs, prose
from vllm_kvcompress import paged_torch
from vllm_kvcompress.config import KVCompressionConfigError, LayerFormat, load_config
from vllm_kvcompress.formats import KVPageFormat
from vllm_kvcompress.slim import Rotary, SlimLayer, w_kv_from_projections

PROMPTS = [prose(120, 61), prose(40, 62), "The quick brown fox"]
# Prefill attends with the V the model just computed; 32-token chunks make later chunks read
# their history from the K-only pages, so prompt logprobs measure the rebuilt V.
CHUNKED = {"max_num_batched_tokens": 32, "enable_chunked_prefill": True, "enable_prefix_caching": False}


def rope(theta=10000.0, head_size=16, rotary_dim=16, neox=True, max_pos=256):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    with set_current_vllm_config(VllmConfig()):
        return RotaryEmbedding(head_size, rotary_dim, max_pos, theta, neox, torch.float32)


def test_w_kv_rebuilds_v_from_k():
    torch.manual_seed(0)
    hidden = 64
    w_k, w_v, x = torch.randn(hidden, hidden), torch.randn(hidden, hidden), torch.randn(10, hidden)
    w_kv, conditioning = w_kv_from_projections(w_k, w_v)
    k, v = x.double() @ w_k.double().T, x.double() @ w_v.double().T
    torch.testing.assert_close(k @ w_kv, v, rtol=1e-9, atol=1e-9)
    assert conditioning.cond == pytest.approx(torch.linalg.cond(w_k.double()).item(), rel=0.02)  # an estimate
    assert 0 < conditioning.amplification <= conditioning.cond


@pytest.mark.parametrize("cond", [1e1, 1e4, 1e8, 1e11])
def test_condition_number_estimate_matches_the_svd(cond):
    """The power-iteration estimate against the SVD's 2-norm condition number: matrices of a chosen
    spectrum (singular values spaced evenly in log) and Gaussian ones (whose largest singular
    values lie close together, the estimate's slowest case)."""
    from vllm_kvcompress.slim import condition_number

    gen = torch.Generator().manual_seed(int(cond))
    n = 256
    u, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=gen))
    spectrum = torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), n, dtype=torch.float64)
    for a in ((u * spectrum) @ v.T, torch.randn(n, n, dtype=torch.float64, generator=gen)):
        assert condition_number(a, *torch.linalg.lu_factor(a)) == pytest.approx(torch.linalg.cond(a).item(), rel=0.02)


def test_singular_w_k_gets_no_w_kv():
    gen = torch.Generator().manual_seed(0)
    w_k = torch.randn(64, 64, dtype=torch.float64, generator=gen)
    w_k[3] = w_k[5]  # two equal rows: rank 63
    w_kv, conditioning = w_kv_from_projections(w_k, torch.randn(64, 64, generator=gen))
    assert w_kv is None and conditioning.amplification == float("inf")
    u, _ = torch.linalg.qr(torch.randn(64, 64, dtype=torch.float64, generator=gen))
    nearly = (u * torch.logspace(0, -13, 64, dtype=torch.float64)) @ u.T  # cond 1e13: past SINGULAR
    assert w_kv_from_projections(nearly, torch.randn(64, 64, generator=gen))[0] is None


@pytest.mark.parametrize("neox, rotary_dim", [(True, 16), (False, 16), (True, 8)])
def test_unrotate_inverts_vllms_rope(neox, rotary_dim):
    emb = rope(neox=neox, rotary_dim=rotary_dim)
    torch.manual_seed(1)
    k = torch.randn(40, 3, 16)
    positions = torch.arange(40) * 3
    q_rot, k_rot = emb.forward_native(positions, k.clone().flatten(1), k.clone().flatten(1))
    back = Rotary(emb.cos_sin_cache, rotary_dim, neox).unrotate(k_rot.view(40, 3, 16), positions)
    torch.testing.assert_close(back, k, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(k_rot.view(40, 3, 16), k, atol=1e-2)  # the rotation did something


def test_k_only_attention_equals_attention_with_v():
    """Decode and a prefill chunk over history: same output as plain attention with the real V."""
    torch.manual_seed(2)
    H, D, L, B = 3, 16, 70, 32
    emb = rope()
    w_k = torch.linalg.qr(torch.randn(H * D, H * D))[0] * 4  # well conditioned: float32 rounding stays small
    w_v, x = torch.randn(H * D, H * D), torch.randn(L, H * D)
    positions = torch.arange(L)
    k_pre, v = (x @ w_k.T).view(L, H, D), (x @ w_v.T).view(L, H, D)
    _, k = emb.forward_native(positions, k_pre.flatten(1).clone(), k_pre.flatten(1).clone())
    k = k.view(L, H, D)
    w_kv, _ = w_kv_from_projections(w_k, w_v)
    slim = SlimLayer.from_w_kv(w_kv.float(), H, Rotary(emb.cos_sin_cache, D, True))
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_only=True), torch.float32, B, H, D)
    cache = torch.zeros(4, fmt.page_bytes, dtype=torch.uint8)
    table = torch.tensor([[3, 1, 0]])
    paged_torch.write_tokens(cache, fmt, k, v, table[0, positions // B] * B + positions % B)
    q = torch.randn(L, H, D)
    for m in (1, 20):  # a decode step, and a 20-token chunk after 50 tokens of history
        got = paged_torch.attend_k_only(q[-m:], cache, fmt, [0, m], [L], table, D ** -0.5, slim, k[-m:], v[-m:])
        want = torch.nn.functional.scaled_dot_product_attention(
            q[-m:].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=D ** -0.5,
            attn_mask=torch.ones(m, L, dtype=torch.bool).tril(L - m)).transpose(0, 1)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_k_only_page_is_half_a_16_bit_page():
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_only=True), torch.bfloat16, 128, 32, 128)
    assert fmt.dense_page_bytes() == 2 * fmt.page_bytes
    k8 = KVPageFormat.from_layer_format(LayerFormat(k_only=True, k_bits=8), torch.bfloat16, 128, 32, 128)
    assert fmt.dense_page_bytes() / k8.page_bytes > 3.8


def test_bad_k_only_settings():
    with pytest.raises(KVCompressionConfigError, match="k_only stores no V, so v_bits = 4 has no meaning"):
        load_config({"default": {"k_only": True, "v_bits": 4}})


@pytest.mark.engine
def test_16_bit_k_only_is_stock_vllm(mha):
    """Greedy tokens for 64 new tokens equal stock vLLM, prompt logprobs within float rounding, and
    vLLM fits at least 1.95x the KV tokens in the same memory."""
    with engine(mha, kv_bytes=16 << 20) as llm:
        want_tokens, want_lp = greedy(llm, PROMPTS, 64), prompt_logprobs(llm, PROMPTS)
        stock = kv_capacity_tokens(llm)
    with engine(mha, "slim-k16", kv_bytes=16 << 20, **CHUNKED) as llm:
        got_tokens, got_lp = greedy(llm, PROMPTS, 64), prompt_logprobs(llm, PROMPTS)
        capacity = kv_capacity_tokens(llm)
    assert got_tokens == want_tokens
    for got, want in zip(got_lp, want_lp):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert capacity >= 1.95 * stock, (capacity, stock)


@pytest.mark.engine
def test_values_come_from_k(mha, tmp_path):
    """Decoding reads V through W_KV: a W_KV file with one layer's matrix scaled changes the answer,
    the unchanged file gives the computed answer (so the file is what is used)."""
    out = tmp_path / "wkv.pt"
    subprocess.run([sys.executable, "-m", "vllm_kvcompress.cli", "slim-weights", str(mha), "-o", str(out)],
                   check=True, capture_output=True)
    data = torch.load(out, weights_only=True)
    assert sorted(data["w_kv"]) == [0, 1, 2, 3] and max(data["cond"].values()) < 1e5
    with engine(mha, "slim-k16") as llm:
        want = greedy(llm, PROMPTS, 24)
    with engine(mha, {"default": {"k_only": True}, "slim_weights": str(out)}) as llm:
        assert greedy(llm, PROMPTS, 24) == want
    data["w_kv"][1] = -data["w_kv"][1]
    torch.save(data, out)
    with engine(mha, {"default": {"k_only": True}, "slim_weights": str(out)}) as llm:
        assert greedy(llm, PROMPTS, 24) != want


@pytest.mark.engine
def test_8_bit_k_refused_where_rebuilt_v_would_suffer(mha):
    """This model's W_K amplify K's rounding tens to hundreds of times (the trained weights, hence the
    exact figure, vary with the CPU's arithmetic): 8-bit K would put more than 5% error into V, so
    slim-k8 is refused, naming the layers; lifting the limit runs it, visibly less exact than K16."""
    with pytest.raises(KVCompressionConfigError, match=r"\(layer 0: cond .*, layer 3: .*allowed: amplification "
                                                       r"below 8.5"):
        with engine(mha, "slim-k8"):
            pass
    with engine(mha) as llm:
        want = prompt_logprobs(llm, PROMPTS)
    errors = {}
    for name, extra in (("slim-k16", {}), ("slim-k8", {"slim_max_amplification": 1e6})):
        with engine(mha, load_config(name).model_dump() | extra, **CHUNKED) as llm:
            got = prompt_logprobs(llm, PROMPTS)
        errors[name] = max((g - w).abs().max().item() for g, w in zip(got, want))
    assert errors["slim-k16"] < 1e-3 < errors["slim-k8"], errors


def _edited_model(src, tmp_path, **changes):
    model = tmp_path / "edited"
    shutil.copytree(src, model)
    config = json.loads((model / "config.json").read_text())
    config.update(changes)
    (model / "config.json").write_text(json.dumps(config))
    return model


def _engine_config(model, setting, **kwargs):
    from vllm.engine.arg_utils import EngineArgs
    args = EngineArgs(str(model), additional_config={"kv_compression": setting}, max_model_len=512, **kwargs)
    return args.create_engine_config()


@pytest.mark.engine
def test_refusals_at_startup(mha, gqa, tmp_path):
    with pytest.raises(KVCompressionConfigError, match="needs multi-head attention, but .* has 4 query heads "
                                                       "and 2 KV heads"):
        _engine_config(gqa, "slim-k16")
    with pytest.raises(KVCompressionConfigError, match="--tensor-parallel-size 2: each head's V needs the K"):
        _engine_config(mha, "slim-k16", tensor_parallel_size=2, distributed_executor_backend="mp")
    with pytest.raises(KVCompressionConfigError, match="attention_bias=true"):
        _engine_config(_edited_model(mha, tmp_path, attention_bias=True), "slim-k16")


@pytest.mark.engine
def test_singular_w_k_refused_naming_the_layer(mha, tmp_path):
    from safetensors.torch import load_file, save_file
    model = tmp_path / "singular"
    shutil.copytree(mha, model)
    weights = load_file(model / "model.safetensors")
    weights["model.layers.2.self_attn.k_proj.weight"][5] = 0.0
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match=r"W_K is singular or badly conditioned \(layer 2: "):
        with engine(model, "slim-k16"):
            pass
