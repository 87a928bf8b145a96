"""Which implementation runs each operation on a layer's pages: the one place that decides.

Implementations are registered for an (operation, device) pair in order of preference. Each says why
it cannot serve a page format in a given context (``None``: it can); ``plan`` takes the first that
can and keeps the reasons of those it passed over, which the startup log prints. The backend asks
``plan`` and nothing else; the environment reaches this module only as a ``KernelPolicy``.

Operations: ``decode`` (one new token a request), ``prompt`` (a prefill chunk's tokens), ``write``
(new tokens into the pages). Devices: ``cuda`` and ``cpu`` (everything else takes the torch path).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..formats import TOKEN_GROUP, KVPageFormat, MinMaxCodec, UncompressedCodec, page_layout
from ..formats.merged import MergedPairFormat
from ..formats.salient import SalientTokensFormat
from ..policy import KernelPolicy, PolicyError

OPERATIONS = ("decode", "prompt", "write")
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
# csrc/decode_mma.cuh (both CUDA decode kernels): head size 128, pages of 64 or 128 tokens (its WarpSlices),
# mma.sync m16n8k16 (compute capability 8.0 or later); csrc/decode_kernel.cu: query heads a KV head
CUDA_DECODE_HEAD = 128
CUDA_DECODE_PAGES = (64, 128)
CUDA_DECODE_CAPABILITY = (8, 0)
CUDA_DECODE_GROUPS = {4: (1, 2, 4), 2: (1, 4)}
CUDA_WRITE_HEADS = (64, 128, 256)
CUDA_SALIENT_BLOCK = 128  # csrc/salient_write_kernel.cu: tokens a page, at most
# csrc/salient_write_kernel.cu: a warp's probes in shared memory, query heads a KV head x (head size + 4)
# floats, at most (its kMaxProbeFloats)
CUDA_SALIENT_PROBE_FLOATS = 3072


@dataclass(frozen=True)
class Device:
    """What the machine allows, apart from the format."""
    type: str                                # "cuda" or "cpu"
    capability: tuple[int, int] | None = None  # NVIDIA compute capability
    hip: bool = False                        # a ROCm build of torch
    nvcc: bool = False                       # a CUDA compiler for the CUDA kernels' build
    flash_attention: bool = False            # vLLM's FlashAttention (a prompt chunk's own tokens)
    prebuilt: bool = False                   # the CUDA kernels prebuilt for these sources (``cuda_jit.prebuild``)

    @classmethod
    def of(cls, device_type: str, capability: tuple[int, int] | None = None) -> "Device":
        if device_type != "cuda":
            return cls(device_type)
        from ..cuda_jit import nvcc_available, prebuilt_available
        from ..triton_kernels.prompt import flash_attention_available
        hip = torch.version.hip is not None
        return cls("cuda", capability, hip, nvcc_available(),
                   not hip and capability is not None and capability >= (8, 0) and flash_attention_available(),
                   prebuilt_available())

    def why_no_cuda_kernels(self) -> str | None:
        """Why the CUDA kernels' libraries cannot be had here (built with nvcc, or prebuilt for this GPU), or None."""
        if self.hip:
            return "not an NVIDIA GPU"
        if self.nvcc:
            return None
        if not self.prebuilt:
            return "no nvcc (set CUDA_HOME to a CUDA toolkit) and no prebuilt kernels (kvcompress prebuild-cuda)"
        cap = self.capability
        if cap is not None and cap < (8, 0):
            return f"no nvcc, and the prebuilt kernels need compute capability 8.0 or later (this GPU: {cap[0]}.{cap[1]})"
        return None


def why_no_cuda_kernels_here() -> str | None:
    """Why this process's current GPU cannot run the CUDA kernels (none, or ``Device.why_no_cuda_kernels``), or
    None: what the CUDA kernels' tests and benchmarks ask."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    return Device.of("cuda", torch.cuda.get_device_capability()).why_no_cuda_kernels()


def why_no_cuda_decode_here() -> str | None:
    """``why_no_cuda_kernels_here``, and the CUDA decode kernels' compute capability: what their tests ask."""
    return why_no_cuda_kernels_here() or _mma_capability(Device("cuda", torch.cuda.get_device_capability()))


@dataclass(frozen=True)
class LayerContext:
    """What besides the page format decides a layer's implementations."""
    device: Device
    dtype: torch.dtype                # queries and new K/V (the model's dtype)
    num_query_heads: int
    sliding_window: int | None = None
    # slim attention's RoPE (``SlimLayer.rotary``), attached at model load; None before (not checked)
    rotary: object | None = None


@dataclass(frozen=True)
class Implementation:
    operation: str
    device: str
    name: str
    # why it cannot serve ``fmt`` in ``ctx`` (None: it can)
    why_not: Callable[[KVPageFormat, LayerContext], str | None]
    entry: str | None = None      # "module:function" the backend calls (None: the backend's torch path)
    prepare: str | None = None    # "module:function" run once at startup (a CUDA kernel's build)
    warm_up: str | None = None    # "module:function" that compiles the variants a step may launch
    cuda_graphs: bool = False     # runs inside a full CUDA graph of decode-only steps
    reads: tuple[type, ...] = (KVPageFormat,)  # the page formats it reads (the torch path reads all)

    def load(self, what: str = "entry") -> Callable | None:
        path = getattr(self, what)
        if path is None:
            return None
        module, function = path.split(":")
        return getattr(importlib.import_module(module), function)


@dataclass(frozen=True)
class Choice:
    implementation: Implementation
    passed_over: tuple[tuple[str, str], ...] = ()  # (name, why not) of those preferred to it

    @property
    def name(self) -> str:
        return self.implementation.name

    def describe(self) -> str:
        """``torch (not cuda, triton: recent 16-bit window ...)``: each reason once, with the names it stopped."""
        names: dict[str, list[str]] = {}
        for name, reason in self.passed_over:
            names.setdefault(reason, []).append(name)
        why = "; ".join(f"not {', '.join(n)}: {reason}" for reason, n in names.items())
        return self.name + (f" ({why})" if why else "")


@dataclass(frozen=True)
class LayerPlan:
    decode: Choice
    prompt: Choice
    write: Choice

    def describe(self) -> str:
        return ", ".join(f"{op} {getattr(self, op).describe()}" for op in OPERATIONS)


_REGISTRY: list[Implementation] = []


def register(impl: Implementation) -> Implementation:
    """Add ``impl`` after the implementations already registered for its operation and device."""
    if impl.operation not in OPERATIONS:
        raise ValueError(f"operation {impl.operation!r}: allowed: {', '.join(OPERATIONS)}")
    _REGISTRY.append(impl)
    return impl


def implementations(operation: str, device: str) -> list[Implementation]:
    return [i for i in _REGISTRY if i.operation == operation and i.device == device]


def _choose(operation: str, fmt: KVPageFormat, ctx: LayerContext, policy: KernelPolicy) -> Choice:
    passed = []
    candidates = implementations(operation, ctx.device.type) or implementations(operation, "cpu")
    mode = policy.mode(operation)
    for impl in candidates:
        why = _refuses(impl, fmt, ctx, policy) or impl.why_not(fmt, ctx)
        if why is None:
            if mode == "cuda" and not _is_cuda(impl):
                where = next((why for name, why in passed if name.startswith("cuda")),
                             f"the cache is on {ctx.device.type}, not a CUDA device")
                raise PolicyError(f"{policy.variable(operation)}=cuda: the CUDA {operation} kernel cannot be used: "
                                  f"{where}; allowed: 'auto' or 'triton' (the Triton kernel)")
            return Choice(impl, tuple(passed))
        passed.append((impl.name, why))
    raise LookupError(f"no {operation} implementation for {ctx.device.type}")  # torch serves every format


def _is_cuda(impl: Implementation) -> bool:
    """A CUDA kernel (``cuda``, ``cuda-salient``): built with nvcc, and what ``KVCOMPRESS_*=cuda`` asks for."""
    return impl.name == "cuda" or impl.name.startswith("cuda-")


def _refuses(impl: Implementation, fmt: KVPageFormat, ctx: LayerContext, policy: KernelPolicy) -> str | None:
    """Why no kernel, whatever it serves, may run here: the policy, the machine, or pages no kernel reads."""
    if impl.name == "torch":
        return None
    if policy.reference_only:
        return "KVCOMPRESS_KERNELS=torch"
    if _is_cuda(impl):
        if policy.mode(impl.operation) == "triton":
            return f"{policy.variable(impl.operation)}=triton"
        why = ctx.device.why_no_cuda_kernels()
        if why is not None:
            return why
    return _unread_by(impl, fmt)


def plan(fmt: KVPageFormat, ctx: LayerContext, policy: KernelPolicy) -> LayerPlan:
    """The implementation of each operation for one layer; a policy that asks for what cannot serve
    is refused (``PolicyError``)."""
    return LayerPlan(*(_choose(op, fmt, ctx, policy) for op in OPERATIONS))


def model_refusal(dtype: torch.dtype, head_size: int, device: Device, policy: KernelPolicy) -> str | None:
    """Why the kernels of ``device`` cannot serve this model at all (the engine is refused), or None."""
    if device.type != "cuda" or policy.reference_only:
        return None
    if dtype not in KERNEL_DTYPES:
        return f"--dtype {dtype} is not supported with --kv-compression on CUDA (allowed: float16, bfloat16)"
    if head_size & (head_size - 1) or not 64 <= head_size <= 256:
        return (f"the model's head size {head_size} is not supported by the CUDA kernels (allowed: 64, 128, 256); "
                "KVCOMPRESS_KERNELS=torch runs the slow torch reference path instead")
    return None


# --- what each implementation serves -------------------------------------------------------------

KERNEL_CODECS = (UncompressedCodec.name, MinMaxCodec.name)  # the codecs the Triton and CUDA kernels read


_FORMAT_NAMES = {MergedPairFormat: "layers merged in pairs (MiniCache)",
                 SalientTokensFormat: "salient tokens at mixed precision (ZipCache)"}


def _unread_by(impl: Implementation, fmt: KVPageFormat | MergedPairFormat | SalientTokensFormat) -> str | None:
    if not isinstance(fmt, impl.reads):
        return _FORMAT_NAMES.get(type(fmt), type(fmt).__name__)
    if not isinstance(fmt, KVPageFormat):
        return None
    for name, codec in (("K", fmt.k), ("V", fmt.v)):
        if codec is not None and codec.name not in KERNEL_CODECS:
            return f"{name} in codec {codec.name!r} (the kernels read {', '.join(KERNEL_CODECS)})"
    return None


def _triton_decode(fmt: KVPageFormat, ctx: LayerContext) -> str | None:
    if fmt.recent is not None:
        return "recent 16-bit window (KVmix RPC)"
    if fmt.v is None:
        return "K-only pages (slim attention)"
    if isinstance(fmt.k, MinMaxCodec) and fmt.k.axis != "channel":
        return "K quantized per token"
    if isinstance(fmt.v, MinMaxCodec) and fmt.v.axis != "token":
        return "V quantized per channel"
    d = fmt.k.head_size
    if d & (d - 1):
        return f"head size {d} (powers of two only)"
    return None


def _whole_contexts(ctx: LayerContext) -> str | None:
    """Why a kernel that reads every key of a context cannot serve this layer, or None."""
    return "sliding-window layer (the kernel reads whole contexts)" if ctx.sliding_window is not None else None


def _sixteen_bit_queries(ctx: LayerContext) -> str | None:
    return None if ctx.dtype in KERNEL_DTYPES else f"queries in {ctx.dtype} (bfloat16 or float16 only)"


def _cuda_decode(fmt: KVPageFormat, ctx: LayerContext) -> str | None:
    why = _triton_decode(fmt, ctx) or _whole_contexts(ctx) or _sixteen_bit_queries(ctx)
    if why is not None:
        return why
    for name, codec, axis in (("K", fmt.k, "channel"), ("V", fmt.v, "token")):
        if not isinstance(codec, MinMaxCodec) or codec.bits not in CUDA_DECODE_GROUPS:
            return f"{name} not at 2 or 4 bits"
        if codec.channel_scaling:
            return f"{name} with ZipCache channel scales"
    if fmt.k.bits != fmt.v.bits:
        return f"K at {fmt.k.bits} bits and V at {fmt.v.bits} (the same width only)"
    if fmt.outliers:
        return "outlier tokens (the Triton kernel reads them)"
    group, rest = divmod(ctx.num_query_heads, fmt.k.num_heads)
    groups = CUDA_DECODE_GROUPS[fmt.k.bits]
    if rest or group not in groups:
        return (f"{ctx.num_query_heads} query heads for {fmt.k.num_heads} KV heads "
                f"({', '.join(map(str, groups))} query heads a KV head at {fmt.k.bits} bits)")
    why = _mma_decode_pages(fmt)
    if why is not None:
        return why
    lay = page_layout(fmt)
    if lay.v.token_group != TOKEN_GROUP:
        return f"V codes in groups of {lay.v.token_group} tokens ({TOKEN_GROUP} only)"
    offsets = (fmt.page_bytes, lay.k.codes, lay.k.scale, lay.k.zero, lay.v.codes, lay.v.scale, lay.v.zero)
    if any(x % 16 for x in offsets):
        return "page regions not on 16-byte boundaries"
    return _mma_capability(ctx.device)


def _mma_decode_pages(fmt: KVPageFormat | SalientTokensFormat) -> str | None:
    """Why the CUDA decode kernels' slices (csrc/decode_mma.cuh) cannot walk these pages, or None."""
    if fmt.k.head_size != CUDA_DECODE_HEAD:
        return f"head size {fmt.k.head_size} ({CUDA_DECODE_HEAD} only)"
    if fmt.block_size not in CUDA_DECODE_PAGES:
        return f"pages of {fmt.block_size} tokens ({' or '.join(map(str, CUDA_DECODE_PAGES))} only)"
    return None


def _mma_capability(device: Device) -> str | None:
    cap = device.capability
    if cap is not None and cap < CUDA_DECODE_CAPABILITY:
        return f"compute capability {cap[0]}.{cap[1]} (8.0 or later: mma.sync m16n8k16)"
    return None


def _own_tokens_through_flash_attention(ctx: LayerContext) -> str | None:
    """Why a prompt chunk's own tokens cannot go through vLLM's FlashAttention here, or None."""
    why = _sixteen_bit_queries(ctx)
    if why is None and not ctx.device.flash_attention:
        return "no vLLM FlashAttention on this GPU (an NVIDIA GPU of compute capability 8.0 or later)"
    return why


def _flash_prompt(fmt: KVPageFormat, ctx: LayerContext) -> str | None:
    return _triton_decode(fmt, ctx) or _own_tokens_through_flash_attention(ctx)


def _flash_dense_prompt(fmt: KVPageFormat, ctx: LayerContext) -> str | None:
    """A chunk's history decoded once into 16-bit rows, then FlashAttention over it and the chunk."""
    if fmt.outliers:
        return "outlier tokens (read by the decode kernel)"
    return _flash_prompt(fmt, ctx)


def _slim_decode(fmt: KVPageFormat, ctx: LayerContext) -> str | None:
    if fmt.v is not None:
        return "pages hold V (K-only pages only)"
    k = fmt.k
    if not (isinstance(k, UncompressedCodec) or isinstance(k, MinMaxCodec) and k.bits == 8 and k.axis == "channel"
            and not k.channel_scaling):
        return f"K at {k.bits} bits (the kernels read 16-bit K, or 8-bit codes per channel)"
    rotary = ctx.rotary
    if rotary is not None and (not rotary.neox or rotary.rotary_dim != fmt.k.head_size):
        return "RoPE other than NeoX style over the whole head"
    d = fmt.k.head_size
    if d & (d - 1) or d < 32:
        return f"head size {d} (powers of two from 32)"
    return None


def _flash_slim_prompt(fmt: KVPageFormat, ctx: LayerContext) -> str | None:
    """K-only pages' prompt chunks: FlashAttention over their own tokens and their history (V rebuilt
    from K); served only where the slim decode is (a step's decodes and prompts attend together)."""
    return _slim_decode(fmt, ctx) or _own_tokens_through_flash_attention(ctx)


def _triton_write(fmt: KVPageFormat, ctx: LayerContext) -> str | None:
    return "recent 16-bit window (KVmix RPC)" if fmt.recent is not None else None


def _cuda_write(fmt: KVPageFormat, ctx: LayerContext) -> str | None:
    if fmt.recent is not None:
        return "recent 16-bit window (KVmix RPC)"
    if fmt.outliers:
        return "outlier tokens (the Triton write chooses them)"
    for name, codec in (("K", fmt.k), ("V", fmt.v)):
        if codec is None:
            continue
        if not isinstance(codec, MinMaxCodec):
            return f"{name} kept at 16 bits"
        if codec.bits not in (2, 4, 8):
            return f"{name} at {codec.bits} bits (2, 4 or 8 only)"
        if codec.channel_scaling:
            return f"{name} with ZipCache channel scales"
    if fmt.k.head_size not in CUDA_WRITE_HEADS:
        return f"head size {fmt.k.head_size} ({', '.join(map(str, CUDA_WRITE_HEADS))} only)"
    if fmt.page_bytes % 8:
        return f"pages of {fmt.page_bytes} bytes (a multiple of 8 only)"
    return None


def _cuda_salient_write(fmt: SalientTokensFormat, ctx: LayerContext) -> str | None:
    group = ctx.num_query_heads // fmt.k.num_heads
    if group * (fmt.k.head_size + 4) > CUDA_SALIENT_PROBE_FLOATS:
        return (f"{group} query heads a KV head at head size {fmt.k.head_size} (query heads x (head size + 4) "
                f"at most {CUDA_SALIENT_PROBE_FLOATS})")
    if fmt.k.head_size not in CUDA_WRITE_HEADS:
        return f"head size {fmt.k.head_size} ({', '.join(map(str, CUDA_WRITE_HEADS))} only)"
    if fmt.block_size > CUDA_SALIENT_BLOCK:
        return f"pages of {fmt.block_size} tokens (at most {CUDA_SALIENT_BLOCK})"
    return None


def _cuda_salient_decode(fmt: SalientTokensFormat, ctx: LayerContext) -> str | None:
    """csrc/salient_decode_kernel.cu: MHA rows (GQA rows take the Triton kernel), head size and pages as
    the 4-bit CUDA decode's."""
    why = _whole_contexts(ctx) or _sixteen_bit_queries(ctx)
    if why is not None:
        return why
    if ctx.num_query_heads != fmt.k.num_heads:
        return f"{ctx.num_query_heads} query heads for {fmt.k.num_heads} KV heads (one a KV head only)"
    why = _mma_decode_pages(fmt)
    if why is not None:
        return why
    if fmt.page_bytes % 16:  # regions start on 16-byte boundaries (formats.layout.REGION_ALIGN); pages too
        return f"pages of {fmt.page_bytes} bytes (a multiple of 16 only)"
    return _mma_capability(ctx.device)


def _salient_decode(fmt: SalientTokensFormat, ctx: LayerContext) -> str | None:
    d = fmt.k.head_size
    if d & (d - 1) or d < 16:
        return f"head size {d} (powers of two from 16)"
    return None


def _flash_salient_prompt(fmt: SalientTokensFormat, ctx: LayerContext) -> str | None:
    return _salient_decode(fmt, ctx) or _own_tokens_through_flash_attention(ctx)


MERGED_CODE_BITS = (2, 4, 8)  # the merged pages' min-max codes the kernels serve (besides raw 16-bit values)


def _merged_pages(fmt: MergedPairFormat, ctx: LayerContext) -> str | None:
    """Why the merged kernels (decode rows, prompt history, the pair's write) cannot serve these pages:
    the history is read by the layer decode kernel (``MergedLayer``)."""
    for name, codec in (("K", fmt.k), ("V", fmt.v)):
        if isinstance(codec, MinMaxCodec):
            if codec.bits not in MERGED_CODE_BITS:
                return f"{name} directions at {codec.bits} bits ({', '.join(map(str, MERGED_CODE_BITS))} or 16 only)"
            if codec.channel_scaling:
                return f"{name} with ZipCache channel scales"
        elif not isinstance(codec, UncompressedCodec):
            return f"{name} in codec {codec.name!r} (the kernel reads {', '.join(KERNEL_CODECS)})"
    d = fmt.k.head_size
    if d < 16:
        return f"head size {d} (powers of two from 16)"
    return _triton_decode(fmt.directions, ctx) or _whole_contexts(ctx) or _sixteen_bit_queries(ctx)


def _flash_merged_prompt(fmt: MergedPairFormat, ctx: LayerContext) -> str | None:
    return _merged_pages(fmt, ctx) or _own_tokens_through_flash_attention(ctx)


def _always(fmt: KVPageFormat, ctx: LayerContext) -> None:
    return None


_TRITON = "vllm_kvcompress.triton_kernels"
for _impl in (
    Implementation("decode", "cuda", "cuda", _cuda_decode, "vllm_kvcompress.cuda_decode:paged_decode",
                   prepare="vllm_kvcompress.cuda_decode:build", cuda_graphs=True),
    Implementation("decode", "cuda", "triton", _triton_decode, f"{_TRITON}.decode:paged_decode",
                   warm_up=f"{_TRITON}.decode:warm_up", cuda_graphs=True),
    Implementation("decode", "cuda", "triton-slim", _slim_decode, f"{_TRITON}.slim_decode:slim_decode",
                   cuda_graphs=True),
    # ZipCache's decode rows: the new token exactly, then the pages through a CUDA kernel (MHA) or
    # the layer decode kernel
    Implementation("decode", "cuda", "cuda-salient", _cuda_salient_decode,
                   "vllm_kvcompress.cuda_salient_decode:decode_rows",
                   prepare="vllm_kvcompress.cuda_salient_decode:build", cuda_graphs=True,
                   reads=(SalientTokensFormat,)),
    Implementation("decode", "cuda", "triton-salient", _salient_decode, f"{_TRITON}.salient_decode:decode_rows",
                   warm_up=f"{_TRITON}.salient_decode:warm_up", cuda_graphs=True, reads=(SalientTokensFormat,)),
    # MiniCache's decode rows: the new token exactly, then the pair's pages through the layer decode kernel
    Implementation("decode", "cuda", "triton-merged", _merged_pages, f"{_TRITON}.merged_decode:decode_rows",
                   warm_up=f"{_TRITON}.merged_decode:warm_up", reads=(MergedPairFormat,)),
    Implementation("decode", "cuda", "torch", _always),
    Implementation("decode", "cpu", "torch", _always),
    # a chunk's history decoded once into 16-bit rows, then FlashAttention over the history and the
    # chunk together; else its own tokens through FlashAttention and its history as grouped rows of
    # the Triton decode. Both served only where that decode is, so a layer whose decodes take the
    # torch path sends its prompts there too (it attends a step together)
    Implementation("prompt", "cuda", "flash-attention+history", _flash_dense_prompt,
                   f"{_TRITON}.history:prompt_chunks", warm_up=f"{_TRITON}.history:warm_up"),
    Implementation("prompt", "cuda", "flash-attention+triton", _flash_prompt, f"{_TRITON}.prompt:paged_prompt",
                   warm_up=f"{_TRITON}.decode:warm_up"),
    Implementation("prompt", "cuda", "flash-attention+triton-salient", _flash_salient_prompt,
                   f"{_TRITON}.salient_prompt:salient_prompt", warm_up=f"{_TRITON}.salient_prompt:warm_up",
                   reads=(SalientTokensFormat,)),
    # K-only pages: FlashAttention over each chunk's history (V rebuilt from K) and its own tokens
    Implementation("prompt", "cuda", "flash-attention+slim", _flash_slim_prompt, f"{_TRITON}.slim_prompt:slim_prompt"),
    Implementation("prompt", "cuda", "flash-attention+triton-merged", _flash_merged_prompt,
                   f"{_TRITON}.merged_prompt:merged_prompt", warm_up=f"{_TRITON}.merged_decode:warm_up",
                   reads=(MergedPairFormat,)),
    Implementation("prompt", "cuda", "torch", _always),
    Implementation("prompt", "cpu", "torch", _always),
    Implementation("write", "cuda", "cuda", _cuda_write, "vllm_kvcompress.cuda_write:write_tokens",
                   prepare="vllm_kvcompress.cuda_write:build"),
    Implementation("write", "cuda", "triton", _triton_write, f"{_TRITON}.write:write_tokens",
                   warm_up=f"{_TRITON}.write:warm_up"),
    # ZipCache's decode rows: the new token, the probe's scores and the block's re-compression
    Implementation("write", "cuda", "cuda-salient", _cuda_salient_write,
                   "vllm_kvcompress.cuda_salient_write:write_decoded",
                   prepare="vllm_kvcompress.cuda_salient_write:build",
                   reads=(SalientTokensFormat,)),
    Implementation("write", "cuda", "triton-salient", _salient_decode, f"{_TRITON}.salient_write:write_decoded",
                   reads=(SalientTokensFormat,)),
    # MiniCache: both layers' tokens of a pair, merged, into the pair's pages (the second layer's write)
    Implementation("write", "cuda", "triton-merged", _merged_pages, f"{_TRITON}.merged_write:write_pair_tokens",
                   warm_up=f"{_TRITON}.merged_write:warm_up", reads=(MergedPairFormat,)),
    Implementation("write", "cuda", "torch", _always, "vllm_kvcompress.paged_torch:write_tokens"),
    Implementation("write", "cpu", "torch", _always, "vllm_kvcompress.paged_torch:write_tokens"),
):
    register(_impl)
