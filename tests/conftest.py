import os

import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# Under pytest-xdist (scripts/test.sh: one worker a core) each worker's engines run one thread on the
# worker's own core: two engines whose threads share cores wait on each other's spinning barriers.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw"):
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(int(_WORKER[2:]) % (os.cpu_count() or 1)))
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def mha(tmp_path_factory):
    """A tiny trained multi-head-attention Llama (4 heads, 4 KV heads); cond(W_K) at most 1,000."""
    from tiny_models import build_llama
    return build_llama(tmp_path_factory.mktemp("models") / "mha", num_kv_heads=4, num_heads=4, max_cond_k=1e3)


@pytest.fixture(scope="session")
def gqa(tmp_path_factory):
    """The same with grouped-query attention (4 heads, 2 KV heads)."""
    from tiny_models import build_llama
    return build_llama(tmp_path_factory.mktemp("models") / "gqa", num_kv_heads=2, num_heads=4)


@pytest.fixture(scope="session")
def gqa_with_bias(tmp_path_factory):
    """A tiny trained GQA Llama whose projections have biases, V's larger than V's spread across
    channels (as in some of Qwen2's layers)."""
    import torch
    from safetensors.torch import load_file, save_file
    from tiny_models import build_llama

    path = build_llama(tmp_path_factory.mktemp("models") / "gqa-bias", num_kv_heads=2, num_heads=4,
                       attention_bias=True)
    weights = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(5)
    for name, w in weights.items():
        if name.endswith("v_proj.bias"):
            weights[name] = torch.randn(w.shape, generator=gen)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path
