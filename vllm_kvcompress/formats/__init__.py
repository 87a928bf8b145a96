"""Page formats: byte layouts and their torch reference encode/decode (no vLLM import)."""

from .codecs import UncompressedCodec, MinMaxCodec
from .page import KVPageFormat

__all__ = ["UncompressedCodec", "MinMaxCodec", "KVPageFormat"]
