"""CUDA-graph capture sizes past vLLM's 512 tokens, added only where the engine left them to vLLM."""

from types import SimpleNamespace

import pytest

from vllm_kvcompress import graph_sizes

VLLM_DEFAULT = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))  # max_num_seqs 256


def test_sizes_added_past_512_every_64_then_every_128_tokens():
    assert graph_sizes.added_sizes(VLLM_DEFAULT, 8192) == [576, 640, 704, 768, 832, 896, 960, 1024,
                                                           1152, 1280, 1408, 1536, 1664, 1792, 1920, 2048]


def test_sizes_stop_at_the_token_budget_which_is_captured():
    assert graph_sizes.added_sizes(VLLM_DEFAULT, 700) == [576, 640, 700]
    assert graph_sizes.added_sizes(VLLM_DEFAULT, 512) == []
    blackwell = VLLM_DEFAULT + list(range(528, 1025, 16))  # vLLM's default ceiling there: 1024
    assert graph_sizes.added_sizes(blackwell, 8192) == [1152, 1280, 1408, 1536, 1664, 1792, 1920, 2048]


def test_nothing_added_under_a_small_max_num_seqs_or_without_graphs():
    assert graph_sizes.added_sizes([1, 2, 4, 8, 16], 8192) == []  # max_num_seqs 8
    assert graph_sizes.added_sizes([], 8192) == []                 # eager


def _config(sizes):
    return SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_capture_sizes=list(sizes),
                                                              max_cudagraph_capture_size=sizes[-1]),
                           scheduler_config=SimpleNamespace(max_num_batched_tokens=8192))


def test_extend_only_inside_a_build_that_left_the_sizes_to_vllm(mha):
    vllm = pytest.importorskip("vllm.engine.arg_utils")
    m = str(mha)
    left = vllm.EngineArgs(model=m)
    config = _config(VLLM_DEFAULT)
    assert graph_sizes.extend(config) == []  # outside an engine build: unknown who chose the sizes
    with graph_sizes.building(left):
        added = graph_sizes.extend(config)
    assert added[0] == 576 and added[-1] == 2048
    cc = config.compilation_config
    assert cc.cudagraph_capture_sizes == VLLM_DEFAULT + added and cc.max_cudagraph_capture_size == 2048
    for given in (vllm.EngineArgs(model=m, max_cudagraph_capture_size=512),
                  vllm.EngineArgs(model=m, cudagraph_capture_sizes=[1, 512]),
                  vllm.EngineArgs(model=m, compilation_config={"max_cudagraph_capture_size": 512}),
                  vllm.EngineArgs(model=m, compilation_config={"cudagraph_capture_sizes": [8, 512]})):
        config = _config(VLLM_DEFAULT)
        with graph_sizes.building(given):
            assert graph_sizes.extend(config) == []
        assert config.compilation_config.cudagraph_capture_sizes == VLLM_DEFAULT
