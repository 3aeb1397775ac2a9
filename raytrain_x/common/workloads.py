"""Synthetic workloads shared by benchmarks, examples and tests (no downloads needed)."""

from __future__ import annotations


def resnet50_parameter_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of torchvision's ResNet-50 (161 tensors, 25.6M elements), in
    registration order, so benchmarks see the real mix of tiny BN vectors and big convs."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    in_ch = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        out_ch = width * 4
        for block in range(blocks):
            shapes += [(width, in_ch, 1, 1), (width,), (width,)]
            shapes += [(width, width, 3, 3), (width,), (width,)]
            shapes += [(out_ch, width, 1, 1), (out_ch,), (out_ch,)]
            if block == 0:
                shapes += [(out_ch, in_ch, 1, 1), (out_ch,), (out_ch,)]
            in_ch = out_ch
    shapes += [(1000, 2048), (1000,)]
    return shapes
