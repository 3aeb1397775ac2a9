"""Synthetic workload shapes shared by benchmarks, examples and tests (no downloads needed);
the torch model built from them is `raytrain_x.torch.workloads.shaped_model`."""

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


def many_small_shapes(count: int = 400, elements: int = 2048) -> list[tuple[int, ...]]:
    """Many small tensors: the workload where fusion settings matter most."""
    return [(elements,) for _ in range(count)]


def many_layers_shapes(count: int = 400) -> list[tuple[int, ...]]:
    """A transformer-like stack of many small layers: `count` tensors of 16K-128K float32
    elements (16M in all, 64 MB), where per-request overhead dominates."""
    block = [(128, 128), (128, 256), (128, 128), (256, 256), (128, 128), (256, 512),
             (128, 128), (128, 256)]  # 16K, 32K, 16K, 64K, 16K, 128K, 16K, 32K elements
    return [block[i % len(block)] for i in range(count)]
