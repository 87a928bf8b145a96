"""The CUDA kernels' sources, installed as ``vllm_kvcompress.csrc`` (package data; built by ``cuda_jit``)."""
