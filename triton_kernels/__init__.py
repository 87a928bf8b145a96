"""Triton kernels over compressed pages, installed as ``vllm_kvcompress.triton_kernels`` (the
checkout's top-level folder, mapped by pyproject.toml's package-dir; import it under that name).

Each kernel is checked against the torch reference in ``vllm_kvcompress.paged_torch``.
Import only where a kernel is launched: on the CPU Triton runs only in interpreter mode
(``TRITON_INTERPRET=1``).
"""
