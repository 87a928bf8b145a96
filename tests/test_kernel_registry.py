"""The kernel registry decides what runs each operation, and the policy is the only reader of the
environment. Contexts stand for a CPU, an H100 with and without nvcc, so the CUDA plans are
checked on every machine; ``test_plan_on_this_gpu`` checks the real device where there is one."""

import re
from pathlib import Path

import pytest
import torch

from vllm_kvcompress import paged_torch, policy
from vllm_kvcompress.config import KVCompressionConfigError, LayerFormat, load_config, preset_names
from vllm_kvcompress.engine_config import ModelKVShape, full_cuda_graphs, kernel_report
from vllm_kvcompress.formats import KVPageFormat
from vllm_kvcompress.formats.salient import SalientTokensFormat
from vllm_kvcompress.kernels import registry
from vllm_kvcompress.policy import KernelPolicy, PolicyError

CPU = registry.Device("cpu")
H100 = registry.Device("cuda", (9, 0), nvcc=True, flash_attention=True)
H100_NO_NVCC = registry.Device("cuda", (9, 0), nvcc=False, flash_attention=True)
AUTO = KernelPolicy()
FOUR = LayerFormat(k_bits=4, v_bits=4)
ROOT = Path(__file__).resolve().parent.parent


def _fmt(layer_format=FOUR, block=128, heads=4, head_size=128, dtype=torch.bfloat16):
    return KVPageFormat.from_layer_format(layer_format, dtype, block, heads, head_size)


def _plan(layer_format=FOUR, device=H100, query_heads=4, pol=AUTO, dtype=torch.bfloat16, block=128, head_size=128,
          sliding_window=None):
    fmt = _fmt(layer_format, block, 4, head_size, dtype)
    return registry.plan(fmt, registry.LayerContext(device, dtype, query_heads, sliding_window), pol)


def _names(plan):
    return plan.decode.name, plan.prompt.name, plan.write.name


@pytest.mark.parametrize("preset", preset_names())
def test_every_preset_runs_the_torch_reference_on_the_cpu(preset):
    cfg = load_config(preset)
    shape = ModelKVShape(4, 4, 64, torch.float32, 128, 4)
    for i in range(shape.num_layers):
        plan = registry.plan(shape.page_format(cfg, i), shape.layer_context(i, CPU), AUTO)
        assert _names(plan) == ("torch", "torch", "torch")
        assert plan.decode.implementation.load() is None
        assert plan.write.implementation.load() is paged_torch.write_tokens


@pytest.mark.parametrize("layer_format,device,pol,expected", [
    (FOUR, H100, AUTO, ("cuda", "flash-attention+history", "cuda")),
    (LayerFormat(k_bits=2, v_bits=2), H100, AUTO, ("cuda", "flash-attention+history", "cuda")),
    (FOUR, H100_NO_NVCC, AUTO, ("triton", "flash-attention+history", "triton")),
    (FOUR, H100, KernelPolicy(decode="triton"), ("triton", "flash-attention+history", "cuda")),
    (FOUR, H100, KernelPolicy(write="triton"), ("cuda", "flash-attention+history", "triton")),
    (FOUR, H100, KernelPolicy(reference_only=True), ("torch", "torch", "torch")),
    (LayerFormat(k_bits=8, v_bits=8), H100, AUTO, ("triton", "flash-attention+history", "cuda")),
    (LayerFormat(k_bits=3, v_bits=3), H100, AUTO, ("triton", "flash-attention+history", "triton")),
    (LayerFormat(k_bits=4, v_bits=4, outlier_tokens=1), H100, AUTO, ("triton", "flash-attention+triton", "triton")),
    (LayerFormat(k_bits=4, v_bits=2, v_channel_scaling=True), H100, AUTO, ("triton", "flash-attention+history", "triton")),
    (LayerFormat(k_bits=4, v_bits=4, rpc_fraction=0.1, rpc_tokens=16), H100, AUTO, ("torch", "torch", "torch")),
    (LayerFormat(k_bits=4, v_bits=4, k_axis="token"), H100, AUTO, ("torch", "torch", "cuda")),
    (LayerFormat(k_only=True), H100, AUTO, ("triton-slim", "flash-attention+slim", "triton")),
    (LayerFormat(k_bits=8, k_only=True), H100, AUTO, ("triton-slim", "flash-attention+slim", "cuda")),
    (LayerFormat(k_bits=4, k_only=True), H100, AUTO, ("torch", "torch", "cuda")),
    # no vLLM FlashAttention for a chunk's own tokens: prompt chunks take the torch path
    (FOUR, registry.Device("cuda", (9, 0), nvcc=True), AUTO, ("cuda", "torch", "cuda")),
])
def test_cuda_plans(layer_format, device, pol, expected):
    assert _names(_plan(layer_format, device, pol=pol)) == expected


def test_passed_over_implementations_say_why():
    plan = _plan(LayerFormat(k_bits=4, v_bits=4, rpc_fraction=0.1, rpc_tokens=16))
    assert plan.decode.describe().startswith("torch (not cuda, triton: recent 16-bit window (KVmix RPC)")
    assert "not cuda: no nvcc" in _plan(device=H100_NO_NVCC).write.describe()
    assert _plan(pol=KernelPolicy(decode="triton")).decode.describe() == "triton (not cuda: KVCOMPRESS_DECODE=triton)"
    sliding = _plan(sliding_window=64)  # the Triton kernels read windows, the CUDA decode whole contexts
    assert _names(sliding)[:2] == ("triton", "flash-attention+history")
    outliers = _plan(LayerFormat(k_bits=4, v_bits=4, outlier_tokens=1)).prompt.describe()
    assert outliers == "flash-attention+triton (not flash-attention+history: outlier tokens (read by the decode kernel))"
    assert sliding.decode.describe() == "triton (not cuda: sliding-window layer (the kernel reads whole contexts))"


def test_only_kernels_that_run_in_cuda_graphs_say_so():
    graphs = {(i.operation, i.name): i.cuda_graphs for i in registry.implementations("decode", "cuda")}
    assert graphs == {("decode", "cuda"): True, ("decode", "triton"): True, ("decode", "triton-slim"): True,
                      ("decode", "cuda-salient"): True, ("decode", "triton-salient"): True,
                      ("decode", "triton-merged"): False,
                      ("decode", "torch"): False}


@pytest.mark.parametrize("preset,score,full", [("quant-k4v4", None, True), ("zipcache-r60", None, True),
                                               ("zipcache-r60", "random", False), ("minicache", None, False),
                                               ("slim-k16", None, True)])
def test_full_cuda_graphs_where_decode_steps_run_without_the_host(preset, score, full):
    """vLLM captures decode-only steps whole where every layer's decode kernel runs in a graph, and
    not with ZipCache's scores drawn at random (on the host); on the CPU, never."""
    cfg = load_config(preset)
    if score is not None:
        cfg = cfg.model_copy(update={"salient": cfg.salient.model_copy(update={"score": score})})
    shape = ModelKVShape(8, 4, 128, torch.bfloat16, 128, 4)
    assert full_cuda_graphs(cfg, shape, H100) is full
    assert not full_cuda_graphs(cfg, shape, CPU)


def test_zipcache_pages_go_through_their_own_kernels_only():
    """The salient kernels (decode rows: CUDA for MHA layers where nvcc exists and not
    KVCOMPRESS_DECODE=triton, else Triton; prompt chunks; the decode rows' write: CUDA where nvcc
    exists, the query heads a KV head fit its shared memory and not KVCOMPRESS_WRITE=triton, else
    Triton) read ZipCache's pages and no others; the other kernels pass them over. Prompt chunks
    need vLLM's FlashAttention for their own tokens; sliding-window layers go through them too (each
    row from its window's first key)."""
    cfg = load_config("zipcache-r60")
    shape = ModelKVShape(4, 4, 128, torch.bfloat16, 128, 4)
    fmt = shape.page_format(cfg, 0)
    plan = registry.plan(fmt, shape.layer_context(0, H100), AUTO)
    assert _names(plan) == ("cuda-salient", "flash-attention+triton-salient", "cuda-salient")
    for ctx, pol, why in ((registry.LayerContext(H100, torch.bfloat16, 8), AUTO,
                           "8 query heads for 4 KV heads (one a KV head only)"),
                          (shape.layer_context(0, H100_NO_NVCC), AUTO, "no nvcc"),
                          (shape.layer_context(0, H100), KernelPolicy(decode="triton"), "KVCOMPRESS_DECODE=triton"),
                          (registry.LayerContext(H100, torch.bfloat16, 4, 512), AUTO, "sliding-window layer")):
        decode = registry.plan(fmt, ctx, pol).decode
        assert decode.name == "triton-salient" and f"cuda-salient: {why}" in decode.describe()
    small = SalientTokensFormat.create(0.6, torch.bfloat16, 128, 4, 64)
    assert "cuda-salient: head size 64 (128 only)" in registry.plan(small, shape.layer_context(0, H100),
                                                                     AUTO).decode.describe()
    assert "not cuda, triton: salient tokens at mixed precision (ZipCache)" in plan.write.describe()
    assert registry.plan(fmt, registry.LayerContext(H100, torch.bfloat16, 8), AUTO).write.name == "cuda-salient"
    many = registry.plan(fmt, registry.LayerContext(H100, torch.bfloat16, 4 * 24), AUTO).write
    assert many.name == "triton-salient" and ("cuda-salient: 24 query heads a KV head at head size 128 (query heads "
                                              "x (head size + 4) at most 3072)") in many.describe()
    for device, pol, why in ((H100_NO_NVCC, AUTO, "no nvcc"), (H100, KernelPolicy(write="triton"),
                                                                "KVCOMPRESS_WRITE=triton")):
        write = registry.plan(fmt, shape.layer_context(0, device), pol).write
        assert write.name == "triton-salient" and f"not cuda, cuda-salient: {why}" in write.describe()
    with pytest.raises(PolicyError, match="KVCOMPRESS_WRITE=cuda: the CUDA write kernel cannot be used: no nvcc"):
        registry.plan(fmt, shape.layer_context(0, H100_NO_NVCC), KernelPolicy(write="cuda"))
    assert registry.plan(fmt, shape.layer_context(0, H100), KernelPolicy(write="cuda")).write.name == "cuda-salient"
    wide = SalientTokensFormat.create(0.6, torch.bfloat16, 256, 4, 128)
    assert "cuda-salient: pages of 256 tokens (at most 128)" in registry.plan(
        wide, shape.layer_context(0, H100), AUTO).write.describe()
    assert "not cuda, triton, triton-slim: salient tokens at mixed precision (ZipCache)" in plan.decode.describe()
    assert "not flash-attention+history, flash-attention+triton: salient tokens" in plan.prompt.describe()
    assert _names(_plan(FOUR))[:2] == ("cuda", "flash-attention+history")
    assert "triton-salient" not in _plan(FOUR, device=H100_NO_NVCC).decode.describe()
    assert "triton-salient" not in _plan(FOUR).prompt.describe()
    sliding = registry.plan(fmt, registry.LayerContext(H100, torch.bfloat16, 4, 512), AUTO)
    assert _names(sliding) == ("triton-salient", "flash-attention+triton-salient", "cuda-salient")
    no_flash = registry.plan(fmt, shape.layer_context(0, registry.Device("cuda", (9, 0), nvcc=True)), AUTO)
    assert _names(no_flash) == ("cuda-salient", "torch", "cuda-salient")
    assert "no vLLM FlashAttention" in no_flash.prompt.describe()


@pytest.mark.parametrize("preset", ["minicache", "minicache-k4v4"])
def test_merged_pairs_go_through_their_own_kernels_only(preset):
    """The merged kernels (decode rows, prompt chunks, the pair's write) read MiniCache's pages and no others; the other
    kernels pass them over, and the layers before the first pair keep the usual plan. Prompt chunks
    need vLLM's FlashAttention for their own tokens; codes the kernel cannot read go to torch."""
    cfg = load_config(preset)
    shape = ModelKVShape(4, 4, 128, torch.bfloat16, 128, 8)
    merged = shape.page_format(cfg, 2)
    plan = registry.plan(merged, shape.layer_context(2, H100), AUTO)
    assert _names(plan) == ("triton-merged", "flash-attention+triton-merged", "triton-merged")
    assert "not cuda, triton, triton-slim, cuda-salient, triton-salient: layers merged in pairs (MiniCache)" in plan.decode.describe()
    assert "triton-merged" not in registry.plan(shape.page_format(cfg, 0), shape.layer_context(0, H100), AUTO).decode.name
    no_flash = registry.plan(merged, shape.layer_context(2, registry.Device("cuda", (9, 0), nvcc=True)), AUTO)
    assert _names(no_flash)[:2] == ("triton-merged", "torch") and "no vLLM FlashAttention" in no_flash.prompt.describe()
    three = ModelKVShape(4, 4, 128, torch.bfloat16, 128, 8).page_format(
        cfg.model_copy(update={"default": LayerFormat(k_bits=3, v_bits=3)}), 2)
    refused = registry.plan(three, shape.layer_context(2, H100), AUTO)
    assert _names(refused) == ("torch", "torch", "torch")
    assert "triton-merged: K directions at 3 bits (2, 4, 8 or 16 only)" in refused.decode.describe()
    sliding = registry.plan(merged, registry.LayerContext(H100, torch.bfloat16, 8, 512), AUTO)
    assert _names(sliding) == ("torch", "torch", "torch") and "triton-merged: sliding-window layer" in sliding.decode.describe()


@pytest.mark.parametrize("layer_format,block,head_size,query_heads,dtype,reason", [
    (FOUR, 128, 128, 4, torch.float16, None),
    (FOUR, 128, 128, 8, torch.bfloat16, None),
    (FOUR, 128, 128, 16, torch.bfloat16, None),
    (LayerFormat(k_bits=2, v_bits=2), 128, 128, 16, torch.bfloat16, None),
    (LayerFormat(k_bits=2, v_bits=2), 128, 128, 8, torch.bfloat16,
     "8 query heads for 4 KV heads (1, 4 query heads a KV head at 2 bits)"),
    (FOUR, 128, 128, 32, torch.bfloat16, "32 query heads for 4 KV heads (1, 2, 4 query heads"),
    (FOUR, 128, 128, 6, torch.bfloat16, "6 query heads for 4 KV heads"),
    (FOUR, 64, 128, 4, torch.bfloat16, None),
    (FOUR, 32, 128, 4, torch.bfloat16, "pages of 32 tokens (64 or 128 only)"),
    (FOUR, 256, 128, 4, torch.bfloat16, "pages of 256 tokens"),
    (FOUR, 128, 64, 4, torch.bfloat16, "head size 64"),
    (FOUR, 128, 128, 4, torch.float32, "queries in torch.float32"),
    (LayerFormat(k_bits=8, v_bits=8), 128, 128, 4, torch.bfloat16, "K not at 2 or 4 bits"),
    (LayerFormat(k_bits=4, v_bits=8), 128, 128, 4, torch.bfloat16, "V not at 2 or 4 bits"),
    (LayerFormat(k_bits=4, v_bits=2), 128, 128, 4, torch.bfloat16, "the same width only"),
    (LayerFormat(k_bits=4, v_bits=4, v_channel_scaling=True), 128, 128, 4, torch.bfloat16, "ZipCache"),
    (LayerFormat(k_bits=4, v_bits=4, outlier_tokens=1), 128, 128, 4, torch.bfloat16, "outlier tokens"),
])
def test_cuda_decode_names_what_it_cannot_read(layer_format, block, head_size, query_heads, dtype, reason):
    plan = _plan(layer_format, query_heads=query_heads, dtype=dtype, block=block, head_size=head_size)
    if reason is None:
        assert plan.decode.name == "cuda"
    else:
        assert plan.decode.name != "cuda" and reason in dict(plan.decode.passed_over)["cuda"]


@pytest.mark.parametrize("layer_format,head_size,why", [
    (LayerFormat(k_bits=3, v_bits=4), 64, "K at 3 bits"),
    (LayerFormat(k_bits=4, v_bits=2, v_channel_scaling=True), 64, "ZipCache"),
    (LayerFormat(k_bits=16, v_bits=4), 64, "K kept at 16 bits"),
    (LayerFormat(k_bits=4, v_bits=4, rpc_tokens=8, rpc_fraction=0.1), 64, "recent 16-bit window"),
    (FOUR, 80, "head size 80"),
    (LayerFormat(k_bits=4, v_bits=4, outlier_tokens=1), 64, "outlier tokens"),
])
def test_cuda_write_names_what_it_cannot_write_and_cuda_is_refused(layer_format, head_size, why):
    """auto passes the format to another kernel and says why; KVCOMPRESS_WRITE=cuda is refused."""
    plan = _plan(layer_format, head_size=head_size)
    assert plan.write.name != "cuda" and why in dict(plan.write.passed_over)["cuda"]
    with pytest.raises(PolicyError, match=f"KVCOMPRESS_WRITE=cuda: the CUDA write kernel cannot be used: .*{why}"):
        _plan(layer_format, head_size=head_size, pol=KernelPolicy(write="cuda"))


@pytest.mark.parametrize("device,pol,message", [
    (CPU, KernelPolicy(decode="cuda"), "KVCOMPRESS_DECODE=cuda: .*the cache is on cpu"),
    (CPU, KernelPolicy(write="cuda"), "KVCOMPRESS_WRITE=cuda: .*the cache is on cpu"),
    (H100_NO_NVCC, KernelPolicy(decode="cuda"), "KVCOMPRESS_DECODE=cuda: .*no nvcc"),
    (registry.Device("cuda", (7, 5), nvcc=True), KernelPolicy(decode="cuda"), "compute capability 7.5"),
    (registry.Device("cuda", (9, 0), hip=True, nvcc=True), KernelPolicy(decode="cuda"), "not an NVIDIA GPU"),
])
def test_a_required_cuda_kernel_that_cannot_run_is_refused(device, pol, message):
    with pytest.raises(PolicyError, match=message):
        _plan(device=device, pol=pol)


@pytest.mark.parametrize("env,message", [
    ({"KVCOMPRESS_DECODE": "fast"}, "KVCOMPRESS_DECODE='fast': allowed are 'auto'"),
    ({"KVCOMPRESS_WRITE": "CUDA"}, "KVCOMPRESS_WRITE='CUDA': allowed are 'auto'"),
    ({"KVCOMPRESS_KERNELS": "triton"}, "KVCOMPRESS_KERNELS='triton': allowed are 'torch'"),
])
def test_policy_refuses_values_that_name_nothing(env, message):
    with pytest.raises(KVCompressionConfigError, match=message):
        KernelPolicy.from_environment(env)


def test_policy_reads_the_switches():
    assert KernelPolicy.from_environment({}) == AUTO
    env = {"KVCOMPRESS_KERNELS": "torch", "KVCOMPRESS_DECODE": "triton", "KVCOMPRESS_WRITE": "cuda"}
    assert KernelPolicy.from_environment(env) == KernelPolicy(True, "triton", "cuda")


def test_only_the_policy_reads_the_environment_switches():
    """One reader: no other module of the package or its kernels names a KVCOMPRESS_ variable's
    value through os.environ / getenv."""
    readers = []
    for path in [*(ROOT / "vllm_kvcompress").rglob("*.py"), *(ROOT / "triton_kernels").rglob("*.py")]:
        if re.search(r"(environ|getenv)[^\n]*KVCOMPRESS_", path.read_text()):
            readers.append(path.relative_to(ROOT).as_posix())
    assert readers == []
    assert "os.environ" in (ROOT / "vllm_kvcompress" / "policy.py").read_text()


def test_startup_block_groups_layers_and_refuses_what_no_kernel_serves(monkeypatch):
    monkeypatch.setattr(policy, "current", lambda: AUTO)
    cfg = load_config({"default": {"k_bits": 4, "v_bits": 4},
                       "layers": {2: {"rpc_fraction": 0.1, "rpc_tokens": 16}, 3: {"k_axis": "token"}}})
    shape = ModelKVShape(num_layers=4, num_kv_heads=4, head_size=128, dtype=torch.bfloat16, block_size=128,
                         num_query_heads=4)
    lines = kernel_report(cfg, shape, H100)
    assert lines[0] == "kv-compression kernels on cuda:"
    assert lines[1] == "  layers 0-1: K4/channel V4/token: decode cuda, prompt flash-attention+history, write cuda"
    assert lines[2].startswith("  layer 2: K4/channel V4/token +10% recent (<= 16) at 16-bit: decode torch (not cuda, "
                               "triton: recent 16-bit window (KVmix RPC)")
    assert lines[3].startswith("  layer 3: K4/token V4/token: decode torch") and lines[3].endswith("write cuda")
    assert kernel_report(cfg, shape, CPU)[1:] == [
        "  layers 0-1: K4/channel V4/token: decode torch, prompt torch, write torch",
        "  layer 2: K4/channel V4/token +10% recent (<= 16) at 16-bit: decode torch, prompt torch, write torch",
        "  layer 3: K4/token V4/token: decode torch, prompt torch, write torch"]
    with pytest.raises(KVCompressionConfigError, match=r"head size 80 is not supported by the CUDA kernels "
                                                       r"\(allowed: 64, 128, 256\)"):
        kernel_report(cfg, ModelKVShape(4, 2, 80, torch.bfloat16, 128, 4), H100)
    with pytest.raises(KVCompressionConfigError, match=r"--dtype torch.float32 is not supported .* on CUDA "
                                                       r"\(allowed: float16, bfloat16\)"):
        kernel_report(cfg, ModelKVShape(4, 2, 128, torch.float32, 128, 4), H100)


def test_the_backend_loads_what_the_registry_planned(monkeypatch):
    """On the CPU: the torch write and no decode kernel; a policy that cannot be honoured is refused
    at the layer's first use, not by falling back."""
    pytest.importorskip("vllm")
    from vllm_kvcompress.backend import KVCompressImpl
    impl = KVCompressImpl.__new__(KVCompressImpl)  # only the planning, without an engine
    impl.__dict__.update(num_heads=4, sliding_window=None, _dtype=torch.float32)
    monkeypatch.setattr(policy, "current", lambda: AUTO)
    plan = impl._plan_layer(_fmt(dtype=torch.float32), None, torch.device("cpu"))
    assert _names(plan) == ("torch", "torch", "torch")
    assert impl._decode_kernel is None and impl._prompt_kernel is None and impl._write is paged_torch.write_tokens
    monkeypatch.setattr(policy, "current", lambda: KernelPolicy(decode="cuda"))
    with pytest.raises(PolicyError, match="KVCOMPRESS_DECODE=cuda"):
        impl._plan_layer(_fmt(dtype=torch.float32), None, torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_plan_on_this_gpu():
    """The plan the backend makes for quant-k4v4 on the Llama-2-7B shape on this GPU: the CUDA
    kernels where nvcc or the prebuilt kernels exist, else Triton; prompt chunks through FlashAttention
    and Triton rows."""
    from vllm_kvcompress.cuda_jit import nvcc_available, prebuilt_available
    device = registry.Device.of("cuda", torch.cuda.get_device_capability())
    modern = device.capability >= (8, 0)
    write = "cuda" if nvcc_available() or (prebuilt_available() and modern) else "triton"
    plan = registry.plan(_fmt(heads=32), registry.LayerContext(device, torch.bfloat16, 32), AUTO)
    assert _names(plan) == ("cuda" if write == "cuda" and modern else "triton", "flash-attention+history", write)
