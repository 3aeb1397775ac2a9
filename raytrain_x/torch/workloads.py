"""A synthetic torch model of any parameter shapes (see `raytrain_x.common.workloads`)."""

from __future__ import annotations

import torch


def shaped_model(shapes: list[tuple[int, ...]]):
    """A torch module whose parameters have `shapes` and whose backward produces every
    gradient in reverse registration order, as a real network's would; the gradient of
    parameter i is `scale * weight_i` (cheap, deterministic)."""
    class ShapedModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.weights = torch.nn.ParameterList(
                torch.nn.Parameter(torch.randn(s, generator=g) * 0.01) for s in shapes)

        def forward(self, scale: torch.Tensor) -> torch.Tensor:
            total = scale.new_zeros(())
            for w in self.weights:  # a chain, so backward visits the last parameter first
                total = total + (w * w).sum() * scale
            return total * 0.5

    return ShapedModel()
