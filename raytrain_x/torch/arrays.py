"""Torch tensors for the engine's array protocol (`raytrain_x.engine.arrays`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from raytrain_x.engine.arrays import ArrayOps, register


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class TorchOps(ArrayOps):
    family = "torch"
    devices = ("cpu", "cuda")

    def dtype(self, a: torch.Tensor) -> str:
        return dtype_name(a.dtype)

    def device(self, a: torch.Tensor) -> str:
        return a.device.type

    def is_contiguous(self, a: torch.Tensor) -> bool:
        return a.is_contiguous()

    def numel(self, a: torch.Tensor) -> int:
        return a.numel()

    def zeros(self, shape: Sequence[int], dtype: str, device: str = "cpu") -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=getattr(torch, dtype), device=device)

    def empty(self, shape: Sequence[int], dtype: str, device: str = "cpu") -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=device)

    def concat(self, arrays):
        return torch.cat(list(arrays))

    def stack(self, arrays):
        return torch.stack(list(arrays))

    def clone(self, a):
        return a.clone()

    def cast(self, a, dtype):
        return a.to(getattr(torch, dtype))

    def view_buffer(self, buffer, count):
        return torch.from_dlpack(buffer.view(count))

    def int32(self, values):
        return torch.tensor(list(values), dtype=torch.int32)

    def is_floating(self, a):
        return a.is_floating_point()

    def span(self, arrays):
        first = arrays[0]
        if first.device.type != "cpu":
            return None
        storage = first.untyped_storage()
        base = storage.data_ptr()
        end = first.data_ptr()
        size = first.element_size()
        for t in arrays:
            if (t.data_ptr() != end or t.dtype != first.dtype or not t.is_contiguous()
                    or t.untyped_storage().data_ptr() != base):
                return None
            end += t.numel() * size
        if end > base + storage.nbytes():
            return None
        count = (end - first.data_ptr()) // size
        return first.new_empty(0).set_(storage, first.storage_offset(), (count,))


TORCH = TorchOps()
register(TORCH, torch.Tensor)
