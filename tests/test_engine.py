"""The backend inside a real vLLM engine on the CPU, with tiny random Llama models."""

import subprocess
import sys

import pytest
import torch

from engine_utils import (assert_equal_to_reference, attention_backends, check_chunked_attention, engine, greedy,
                          kv_capacity_tokens, prompt_logprobs, prose, record_attention, reference_prompt_logprobs)

pytestmark = pytest.mark.engine
PROMPTS = [prose(40, 1), prose(25, 2), prose(60, 3), "The quick brown fox"]
# prompts in chunks of 128 tokens (a page): a chunk reads earlier chunks back from the pages
CHUNKS = {"enable_chunked_prefill": True, "max_num_batched_tokens": 128, "max_num_seqs": 4}


@pytest.fixture(scope="session")
def stock_run(mha):
    with engine(mha) as llm:
        return {"backends": attention_backends(llm), "greedy": greedy(llm, PROMPTS),
                "logprobs": prompt_logprobs(llm, PROMPTS), "capacity": kv_capacity_tokens(llm)}


def test_installed_but_unconfigured_is_stock_vllm(mha, stock_run):
    """Plugin loaded, no setting: same backend, tokens, logprobs and capacity as vLLM without the plugin."""
    code = (
        "import os, sys, json;"
        "from engine_utils import engine, greedy, kv_capacity_tokens, attention_backends;"
        f"from test_engine import PROMPTS\n"
        "if __name__ == '__main__':\n"
        f"    with engine({str(mha)!r}) as llm:\n"
        "        print('RESULT', json.dumps([greedy(llm, PROMPTS), kv_capacity_tokens(llm), sorted(attention_backends(llm))]))\n"
        "        import vllm.plugins, importlib.metadata as md\n"
        "        print('PLUGINS', [e.name for e in md.entry_points(group='vllm.general_plugins')])")
    env = {**__import__("os").environ, "VLLM_PLUGINS": "none-loaded",
           "PYTHONPATH": __import__("os").path.dirname(__file__)}  # engine_utils, test_engine
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT")]
    assert line, out.stderr[-3000:]
    import json
    tokens, capacity, backends = json.loads(line[0][len("RESULT "):])
    assert "kvcompress" in out.stdout  # the plugin is installed, only not loaded there
    assert stock_run["backends"] == set(backends) == {"CPU_ATTN"}
    assert stock_run["greedy"] == tokens
    assert stock_run["capacity"] == capacity


def test_compressed_engine_uses_our_backend(mha):
    with engine(mha, "quant-k4v4") as llm:
        assert attention_backends(llm) == {"KVCOMPRESS"}
        cfg = llm.llm_engine.vllm_config.additional_config
        assert cfg["kv_compression"]["default"]["k_bits"] == 4  # resolved once, passed on to workers
        assert cfg["kv_compression_capacity_ratio"] > 3.5


@pytest.mark.parametrize("model_name", ["mha", "gqa"])
def test_8bit_greedy_matches_stock(request, model_name):
    """8/8 bits: greedy tokens equal stock vLLM on at least 90% of 4 x 32 new tokens."""
    model = request.getfixturevalue(model_name)
    with engine(model) as llm:
        stock = greedy(llm, PROMPTS)
    with engine(model, "quant-k8v8") as llm:
        ours = greedy(llm, PROMPTS)
    same = sum(a == b for s, o in zip(stock, ours) for a, b in zip(s, o))
    assert same >= 0.9 * 4 * 32, (same, stock, ours)


@pytest.mark.parametrize("model_name", ["mha", "gqa"])
@pytest.mark.parametrize("bits", [4, 2])
def test_prompt_logprobs_equal_torch_reference(request, model_name, bits):
    """The engine computes exactly what the format says: prompt logprobs, prompts run in chunks of
    128 tokens, equal a Hugging Face model whose attention reads each chunk's own K/V exactly and
    earlier chunks' K/V through the same quantization.

    Bound: median token within 1e-4, every token within 5e-2, while the quantization itself moves
    some logprob of each prompt by more than 0.2. The two models' K/V differ by float rounding (~1e-6); where that moves a
    block's min/max across a float16 rounding step of its scale, the whole block's codes shift
    (see docs/formats.md), so a few tokens differ by more than rounding. The exact, per-layer check
    is test_backend_output_equals_reference_attention."""
    model = request.getfixturevalue(model_name)
    prompts = [prose(300, 10 + bits), prose(140, 20 + bits)]
    with engine(model, f"quant-k{bits}v{bits}", **CHUNKS) as llm:
        got = [prompt_logprobs(llm, [p])[0] for p in prompts]  # one at a time: chunks start at multiples of 128
    want = reference_prompt_logprobs(model, prompts, bits, bits, block=128, chunk=128)
    plain = reference_prompt_logprobs(model, prompts, 16, 16, block=128, chunk=128)
    assert [g.shape for g in got] == [w.shape for w in want]
    assert_equal_to_reference(got, want, plain, effect=0.2)  # the quantization is visible
    for w, p in zip(want, plain):
        assert (p - w)[:127].abs().max() < 1e-4  # the first chunk reads nothing back


def test_capacity_ratios_reported_by_vllm(mha):
    """Same --kv-cache-memory-bytes, bf16 model: KV tokens >= 3.5x stock at 4/4 and >= 6x at 2/2."""
    budget = 64 << 20
    with engine(mha, dtype="bfloat16", kv_bytes=budget) as llm:
        stock = kv_capacity_tokens(llm)
    ratios = {}
    for bits in (8, 4, 2):
        with engine(mha, f"quant-k{bits}v{bits}", dtype="bfloat16", kv_bytes=budget) as llm:
            ratios[bits] = kv_capacity_tokens(llm) / stock
    assert ratios[4] >= 3.5 and ratios[2] >= 6.0 and ratios[8] >= 1.85, ratios


def test_mixed_per_layer_bits_allocate_by_page_size(mha, tmp_path):
    """Layers of different bits get pages of different sizes in one block table."""
    cfg = tmp_path / "mixed.yaml"
    cfg.write_text("default: {k_bits: 2, v_bits: 2}\nlayers: {0: {k_bits: 8, v_bits: 8}}\nfull_precision_layers: [3]\n")
    budget = 64 << 20
    with engine(mha, str(cfg), dtype="bfloat16", kv_bytes=budget) as llm:
        tokens = kv_capacity_tokens(llm)
        assert len(greedy(llm, PROMPTS[:1], 8)[0]) == 8
    with engine(mha, dtype="bfloat16", kv_bytes=budget) as llm:
        stock = kv_capacity_tokens(llm)
    from vllm_kvcompress.config import load_config
    from vllm_kvcompress.formats import KVPageFormat
    c = load_config(str(cfg))
    pages = [KVPageFormat.from_layer_format(c.layer_format(i), torch.bfloat16, 128, 4, 64) for i in range(4)]
    predicted = sum(p.dense_page_bytes() for p in pages) / sum(p.page_bytes for p in pages)
    assert abs(tokens / stock - predicted) < 0.05 * predicted


@pytest.mark.parametrize("model_name", ["mha", "gqa"])
@pytest.mark.parametrize("bits", [4, 2, 3])
def test_backend_output_equals_reference_attention(request, monkeypatch, model_name, bits):
    """Inside the engine, every layer's attention output for prompts run in chunks of 128 tokens
    equals causal attention over the chunk's own K/V and the earlier chunks' K/V put through the
    format's arithmetic (torch reference), to float rounding."""
    from reference_quant import fake_quant

    model = request.getfixturevalue(model_name)
    recorded = record_attention(monkeypatch)
    with engine(model, f"quant-k{bits}v{bits}", **CHUNKS) as llm:
        for p in (prose(300, 31), prose(90, 32), prose(170, 33)):
            greedy(llm, [p], max_tokens=1)
    assert check_chunked_attention(recorded, lambda k: fake_quant(k, bits, "channel", 128),
                                   lambda v: fake_quant(v, bits, "token", 128)) > 0


@pytest.mark.parametrize("model_name", ["mha", "gqa_with_bias"])
def test_rotated_v_equals_reference(request, model_name):
    """``v_rotation``: prompt logprobs (chunks of 128 tokens) equal a Hugging Face model whose earlier
    chunks' V, less its projection's bias, goes onto 2-bit per-token grids after turning by the
    closed-form Hadamard matrix and is turned back; and differ from the same bits unturned. Bounds
    as in test_prompt_logprobs_equal_torch_reference."""
    model = request.getfixturevalue(model_name)
    prompts = [prose(300, 51), prose(140, 52)]
    with engine(model, {"default": {"k_bits": 4, "v_bits": 2, "v_rotation": True}}, **CHUNKS) as llm:
        got = [prompt_logprobs(llm, [p])[0] for p in prompts]
    want = reference_prompt_logprobs(model, prompts, 4, 2, block=128, chunk=128, v_turned=True)
    plain = reference_prompt_logprobs(model, prompts, 4, 2, block=128, chunk=128)
    assert_equal_to_reference(got, want, plain, effect=5e-2)  # the turn is visible


def test_rotated_v_needs_a_power_of_2_head_size(tmp_path):
    from vllm import LLM
    from vllm_kvcompress.config import KVCompressionConfigError
    from tiny_models import build_llama

    model = build_llama(tmp_path / "d48", hidden=192, train_steps=0)
    with pytest.raises(KVCompressionConfigError, match=r"has head size 48; a Hadamard matrix needs a power of 2 "
                       r"\(allowed: v_rotation false, e.g. a config with default: \{k_bits: 4, v_bits: 2\}\)"):
        LLM(str(model), enforce_eager=True, kv_cache_memory_bytes=32 << 20,
            additional_config={"kv_compression": {"default": {"k_bits": 4, "v_bits": 2, "v_rotation": True}}})


@pytest.mark.parametrize("setting, message", [
    ({"default": {"k_bits": 5}}, "field 'default.k_bits' = 5 is not allowed; allowed: 2, 3, 4, 8, 16"),
    ({"default": {"k_bits": 4}, "colour": "red"}, "unknown field 'colour'"),
    ({"layers": {4: {"k_bits": 8}}}, "'layers' names layer 4, but the model has 4 attention layers (allowed: 0..3)"),
    ({"full_precision_layers": [12]}, "'full_precision_layers' names layer 12"),
    ({"model": {"architecture": "LlamaForCausalLM", "num_layers": 30}},
     "field 'model.num_layers' = 30, but the served model"),
    ({"model": {"architecture": "Gemma3ForCausalLM"}}, "has architecture = 'LlamaForCausalLM': this config was made for another model"),
    ("no/such/config.yaml", "'no/such/config.yaml': no such file, and not a preset name"),
    ("MALFORMED", "malformed YAML"),
])
def test_bad_settings_refused_before_engine_starts(mha, tmp_path, setting, message):
    from vllm import LLM
    from vllm_kvcompress.config import KVCompressionConfigError

    if setting == "MALFORMED":
        setting = str(tmp_path / "broken.yaml")
        (tmp_path / "broken.yaml").write_text("default: {k_bits: 4\n")
    with pytest.raises(KVCompressionConfigError) as err:
        LLM(str(mha), enforce_eager=True, kv_cache_memory_bytes=32 << 20,
            additional_config={"kv_compression": setting})
    assert message in str(err.value)


def test_kv_cache_dtype_conflict_refused(mha):
    from vllm import LLM
    from vllm_kvcompress.config import KVCompressionConfigError

    with pytest.raises(KVCompressionConfigError, match="--kv-cache-dtype fp8 cannot be combined"):
        LLM(str(mha), enforce_eager=True, kv_cache_memory_bytes=32 << 20, kv_cache_dtype="fp8",
            additional_config={"kv_compression": "quant-k4v4"})


def test_chunked_prefill_and_mixed_batches_lossless(mha):
    """Through our backend with 16-bit pages, chunked prefill (32-token chunks) and batches that mix
    decodes with prefill chunks give stock vLLM's tokens and prompt logprobs."""
    prompts = [prose(150, 41), prose(60, 42), prose(220, 43)]
    with engine(mha) as llm:
        want_tokens, want_lp = greedy(llm, prompts, 16), prompt_logprobs(llm, prompts)
    lossless = {"default": {"k_bits": 16, "v_bits": 16}}
    with engine(mha, lossless, max_num_batched_tokens=32, enable_chunked_prefill=True,
                enable_prefix_caching=False) as llm:
        assert attention_backends(llm) == {"KVCOMPRESS"}
        got_tokens, got_lp = greedy(llm, prompts, 16), prompt_logprobs(llm, prompts)
    assert got_tokens == want_tokens
    for g, w in zip(got_lp, want_lp):
        assert (g - w).abs().max() < 1e-4


def test_prefix_cache_reuses_compressed_pages(mha):
    """Requests sharing a 300-token prefix hit vLLM's prefix cache on compressed pages (two full
    128-token blocks) and get the same answer as without prefix caching."""
    from vllm import SamplingParams

    prefix = prose(300, 50)
    prompts = [prefix + " The quick brown fox", prefix + " Once upon a time"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    results, cached = {}, {}
    for caching in (False, True):
        with engine(mha, "quant-k4v4", enable_prefix_caching=caching) as llm:
            llm.generate(prompts[:1], params, use_tqdm=False)  # puts the prefix's full blocks in the cache
            outs = llm.generate(prompts, params, use_tqdm=False)
            results[caching] = [list(o.outputs[0].token_ids) for o in outs]
            cached[caching] = [o.num_cached_tokens or 0 for o in outs]
    assert cached[False] == [0, 0] and min(cached[True]) >= 256
    assert results[True] == results[False]


def test_sliding_window_layers_lossless_at_16_bits(mha, tmp_path):
    """Layers with a sliding window (here every other layer, window 48, as Gemma 3 and Mistral
    declare it) read only their window: 16-bit pages give stock vLLM's greedy tokens, prompts
    longer than the window."""
    import json
    import shutil
    model = tmp_path / "windowed"
    shutil.copytree(mha, model)
    config = json.loads((model / "config.json").read_text())
    config.update(sliding_window=48, layer_types=["sliding_attention", "full_attention"] * 2)
    (model / "config.json").write_text(json.dumps(config))
    prompts = [prose(320, 51), prose(70, 52)]  # the first outgrows two 128-token pages past its window
    with engine(model) as llm:
        want = greedy(llm, prompts, 24)
    with engine(model, {"default": {"k_bits": 16, "v_bits": 16}}) as llm:
        assert "KVCOMPRESS" in attention_backends(llm)
        assert greedy(llm, prompts, 24) == want
    with engine(mha) as llm:  # the window matters: without it the tokens differ
        assert greedy(llm, prompts, 24) != want


def test_generic_platforms_give_compressed_layers_128_token_pages(mha):
    """On CUDA, vLLM sets the block size from the chosen backend after the config is built
    (``Platform.update_block_size_for_backend``, the generic implementation; the CPU platform
    keeps its own 128). Run that implementation on this engine's config: our backend must get
    128-token pages (16-token pages would spend 2 bits a value on K's per-channel scales)."""
    from vllm.platforms.interface import Platform

    from vllm_kvcompress.backend import KVCompressBackend

    with engine(mha, "quant-k4v4", dtype="bfloat16", kv_bytes=32 << 20) as llm:
        vllm_config = llm.llm_engine.vllm_config
    vllm_config.cache_config.block_size = 16  # what the generic path starts from on CUDA
    assert Platform._preferred_block_size_for_backends([KVCompressBackend], 16, vllm_config) == 128
