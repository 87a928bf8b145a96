"""vllm-kvcompress: compressed KV-cache pages for vLLM, turned on with one flag."""

from .config import KVCompressionConfig, KVCompressionConfigError, LayerFormat, load_config

__all__ = ["KVCompressionConfig", "KVCompressionConfigError", "LayerFormat", "load_config"]
__version__ = "0.1.0"
