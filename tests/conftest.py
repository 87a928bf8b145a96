import os

import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(scope="session")
def mha(tmp_path_factory):
    """A tiny trained multi-head-attention Llama (4 heads, 4 KV heads)."""
    from tiny_models import build_llama
    return build_llama(tmp_path_factory.mktemp("models") / "mha", num_kv_heads=4, num_heads=4)


@pytest.fixture(scope="session")
def gqa(tmp_path_factory):
    """The same with grouped-query attention (4 heads, 2 KV heads)."""
    from tiny_models import build_llama
    return build_llama(tmp_path_factory.mktemp("models") / "gqa", num_kv_heads=2, num_heads=4)
