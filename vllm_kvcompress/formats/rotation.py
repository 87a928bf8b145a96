"""V's channels turned before quantizing (``LayerFormat.v_rotation``, QuaRot's Hadamard rotation).

A token's V has a few channels far larger than the rest; on a per-token grid they set the step
for all. Turned by an orthonormal Hadamard matrix, every channel carries a share of each, and the
grid fits them all. Attention's output is linear in V, so the pages keep V turned and the output
is turned back: ``sum_j p_j (v_j H) H^T = sum_j p_j v_j``. Both turns are folded into the model's
projections at load (``v_rotation_loader``). Sylvester's H is symmetric: turning back is the same product.
"""

from __future__ import annotations

import torch


def hadamard(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[n, n] orthonormal Hadamard matrix (Sylvester's construction; n a power of 2), in float32
    whatever torch's default dtype (vLLM sets the model's while it loads one)."""
    h = torch.ones(1, 1, dtype=torch.float32, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / n ** 0.5
