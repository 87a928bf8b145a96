"""Tensor parallelism on the CPU engine: pages sized from each rank's KV heads, the same tokens as
one process. Pipeline parallelism runs on GPUs only (vLLM's CPU workers do not pipeline);
benchmarks/gpu_parallel.py checks both on two GPUs."""

import pytest
import torch
from engine_utils import engine, greedy, kv_capacity_tokens, prose

PROMPTS = [prose(30 + 41 * i, seed=i) for i in range(4)]
BUDGET = 64 << 20
CONFIGS = {  # settings written to a file
    "per-layer": "default: {k_bits: 4, v_bits: 4}\nlayers:\n  0: {k_bits: 8, v_bits: 8}\n  3: {k_bits: 2, v_bits: 2}\n",
    "rotated": "default: {k_bits: 4, v_bits: 4, v_rotation: true}\n",  # the turn folded into each rank's shard
}


def _predicted_tokens(setting: str, num_kv_heads: int) -> int:
    """KV tokens for BUDGET bytes a rank from the page arithmetic: whole blocks of every layer's page."""
    from vllm_kvcompress.config import load_config
    from vllm_kvcompress.formats import KVPageFormat
    cfg = load_config(setting)
    block = 128
    page = sum(KVPageFormat.from_layer_format(cfg.layer_format(i), torch.float32, block, num_kv_heads, 64).page_bytes
               for i in range(4))
    return BUDGET // page * block


@pytest.mark.engine
@pytest.mark.parametrize("setting, model_name", [("quant-k4v4", "gqa"), ("per-layer", "gqa"),
                                                 ("rotated", "gqa_with_bias")])
def test_tensor_parallel_matches_one_process(request, setting, model_name, tmp_path, monkeypatch):
    """TP 2 over 2 KV heads: each rank pages one head, so the same memory a rank holds the tokens
    that one-head pages predict (about twice one process's), and greedy tokens are unchanged. With
    V turned, on a model with large V biases: each rank folds its shard, and the biases moved to the
    output projection are summed over the ranks."""
    gqa = request.getfixturevalue(model_name)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core a worker
    if setting in CONFIGS:
        (tmp_path / f"{setting}.yaml").write_text(CONFIGS[setting])
        setting = str(tmp_path / f"{setting}.yaml")
    runs = {}
    for tp in (1, 2):
        with engine(gqa, setting, kv_bytes=BUDGET, tensor_parallel_size=tp, distributed_executor_backend="mp") as llm:
            runs[tp] = greedy(llm, PROMPTS, 24), kv_capacity_tokens(llm)
    assert runs[2][0] == runs[1][0]
    assert runs[1][1] == _predicted_tokens(setting, num_kv_heads=2)
    assert runs[2][1] == _predicted_tokens(setting, num_kv_heads=1)


@pytest.mark.engine
def test_merged_layers_refused_under_pipeline_parallelism(gqa):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvcompress.config import KVCompressionConfigError
    args = EngineArgs(str(gqa), additional_config={"kv_compression": "minicache"}, max_model_len=512,
                      pipeline_parallel_size=2, distributed_executor_backend="mp")
    with pytest.raises(KVCompressionConfigError, match="merge with --pipeline-parallel-size 2: a merged pair's"):
        args.create_engine_config()
