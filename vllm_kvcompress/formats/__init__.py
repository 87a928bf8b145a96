"""Page formats: byte layouts and their torch reference encode/decode (no vLLM import)."""

from .codecs import Full16Codec, MinMaxCodec
from .page import KVPageFormat

__all__ = ["Full16Codec", "MinMaxCodec", "KVPageFormat"]
