"""The KIVI reference row of the quality benchmark (benchmarks/kivi.py): its groups against the
tests' own min-max statement, its residual rule and its chunks on a tiny model."""

import pytest
import torch
from reference_quant import fake_quant

from benchmarks.kivi import KiviModel, KiviSpec, fake_quant_k, fake_quant_v


def test_k_per_channel_over_groups_of_tokens():
    x = torch.randn(2, 3, 96, 16)  # [batch, heads, tokens, d]
    want = fake_quant(x.flatten(0, 1).permute(1, 0, 2), 4, "channel", 32).permute(1, 0, 2).reshape(x.shape)
    assert torch.allclose(fake_quant_k(x, 4, 32), want, atol=1e-6)


def test_v_per_token_over_groups_of_channels():
    x = torch.randn(1, 2, 40, 64)
    got = fake_quant_v(x, 2, 32)
    for g in range(2):
        part = x[..., 32 * g:32 * (g + 1)].flatten(0, 1).permute(1, 0, 2)
        want = fake_quant(part, 2, "token", 40).permute(1, 0, 2).reshape(1, 2, 40, 32)
        assert torch.allclose(got[..., 32 * g:32 * (g + 1)], want, atol=1e-6)
    assert torch.equal(fake_quant_v(x, 4, 128), fake_quant_v(x, 4, 64))  # at most a head's channels


def test_names_residual_and_capacity():
    assert KiviSpec.parse("kivi-4") == KiviSpec(4, 32, 128)
    assert KiviSpec.parse("kivi-2-g128-r0") == KiviSpec(2, 128, 0)
    assert KiviSpec.parse("quant-k4v4") is None
    with pytest.raises(SystemExit, match="multiple of the group"):
        KiviSpec.parse("kivi-4-g32-r48")
    assert [KiviSpec(4, 32, 128).quantized_tokens(n) for n in (0, 127, 128, 300)] == [0, 0, 128, 256]
    assert KiviSpec(4, 32, 0).quantized_tokens(70) == 64  # an incomplete group waits
    # d = 64, 4 bits, groups of 32: K 32 B codes + 8 B stats, V the same, against 256 B at 16 bits
    assert KiviSpec(4, 32, 0).kv_vs_16bit(64, 2048) == pytest.approx(256 / 80)
    assert KiviSpec(4, 32, 128).kv_vs_16bit(64, 2048) == pytest.approx(256 * 2048 / (1920 * 80 + 128 * 256))


@pytest.fixture(scope="module")
def kivi_model(mha):
    return KiviModel(mha, chunk=None)


def _logprobs(model, ids, spec, chunk):
    model.chunk = chunk
    with model.using(spec):
        return torch.tensor(model.window_logprobs(ids, 5)[0])


def test_chunks_read_earlier_chunks_quantized_and_their_own_exactly(kivi_model, mha):
    from transformers import LlamaForCausalLM

    ids = torch.randint(3, 200, (96,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        model = LlamaForCausalLM.from_pretrained(mha, dtype=torch.float32)
        want = model(torch.tensor([ids])).logits[0].log_softmax(-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    exact = _logprobs(kivi_model, ids, None, 32)
    assert torch.allclose(exact, want, atol=1e-4)  # chunks and a cache alone change nothing
    two_bit = KiviSpec(2, 32, 0)
    assert torch.allclose(_logprobs(kivi_model, ids, two_bit, None), want, atol=1e-4)  # one chunk: nothing cached
    assert torch.allclose(_logprobs(kivi_model, ids, KiviSpec(2, 32, 128), 32), want, atol=1e-4)  # all in residual
    chunked = _logprobs(kivi_model, ids, two_bit, 32)
    assert torch.allclose(chunked[:31], want[:31], atol=1e-4)  # the first chunk attends to itself only
    assert (chunked[31:] - want[31:]).abs().max() > 1e-2


def test_greedy_without_quantization_is_the_models(kivi_model, mha):
    from transformers import LlamaForCausalLM

    ids = list(range(5, 45))
    kivi_model.chunk = 16
    with kivi_model.using(None):
        tokens = kivi_model.greedy(ids, 8)
    model = LlamaForCausalLM.from_pretrained(mha, dtype=torch.float32)
    want = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(ids):]
    assert tokens == want.tolist()
