"""The preset configs, installed as ``vllm_kvcompress.configs`` (package data; ``kvcompress presets``)."""
