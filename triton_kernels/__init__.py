"""Triton kernels over compressed pages, installed as ``vllm_kvcompress.triton_kernels`` (the
checkout's top-level folder, mapped by pyproject.toml's package-dir; import it under that name).

Each kernel is checked against the torch reference in ``vllm_kvcompress.paged_torch``.
Import only where a kernel is launched: on the CPU Triton runs only in interpreter mode
(``TRITON_INTERPRET=1``).

vLLM imports an unrelated upstream package named ``triton_kernels`` (its MoE kernels). Where the
checkout's root is on ``sys.path`` (``python -m ...`` from there), that import reaches this folder;
``upstream.hand_over`` then gives the importer what it would get without the checkout.
"""

if __name__ == "triton_kernels":
    from .upstream import hand_over

    hand_over()
