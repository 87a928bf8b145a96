"""Page formats: byte layouts and their torch reference encode/decode (no vLLM import)."""

from .codecs import (CLIP_DENOMINATOR, CLIP_RATIOS, CODECS, EPS, WIDEN_MARGIN, Codec, MinMaxCodec, TensorSpec,
                     UncompressedCodec, register_codec)
from .layout import TOKEN_GROUP, PageLayout, TensorLayout, page_layout
from .page import KVPageFormat
from .salient import MIDDLE, NO_SLOT
from .salient_rows import EMPTY

# What the CUDA kernels are built with (``cuda_jit``): the values their sources must not state again.
KERNEL_CONSTANTS = {"KVC_TOKEN_GROUP": TOKEN_GROUP, "KVC_WIDEN_MARGIN": WIDEN_MARGIN, "KVC_EPS": EPS,
                    "KVC_NO_SLOT": NO_SLOT, "KVC_SALIENT_MIDDLE": MIDDLE, "KVC_EMPTY_ROW": EMPTY}

__all__ = ["CLIP_DENOMINATOR", "CLIP_RATIOS", "CODECS", "Codec", "KERNEL_CONSTANTS", "KVPageFormat", "MinMaxCodec",
           "PageLayout", "TensorLayout", "TensorSpec", "UncompressedCodec", "page_layout", "register_codec"]
