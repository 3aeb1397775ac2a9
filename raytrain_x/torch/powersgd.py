"""PowerSGD: gradients compressed to low rank with error feedback (Vogels et al. 2019), as
torch's `powerSGD_hook` does for DDP, through the reducer protocol.

Gradients are views of fixed buckets (`gradient_layout`, DDP's 25 MB by default). When a
bucket's last gradient is ready, this rank's error of the last step is added to it; each
gradient viewed as an n x m matrix that low rank shrinks by at least `min_compression_rate`
is approximated as P Q^T with P = M Q (Q of the last step: warm start) and the bucket's Ps
are allreduced (summed); the other gradients (biases, small matrices) are allreduced whole,
averaged. Once a bucket's Ps land they are orthonormalised, Q = M^T P is allreduced, and the
gradient becomes P Q^T / world; the error is what this rank's input was minus what it got.
A bucket moves on as soon as its last reduction landed, while later buckets' gradients are
still being computed; `synchronize` finishes them all.

The first `start_iter` steps reduce uncompressed (torch's `start_powerSGD_iter`: error
feedback accumulates only once the model has left its first steps). Every rank draws the
same Q from a generator seeded by `seed` and the step; a new world (an elastic change)
draws them again and starts with no error, since a newcomer has none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from raytrain_x.common.errors import ConfigError
from raytrain_x.core import runtime
from raytrain_x.core.collectives import Average, Sum
from raytrain_x.engine.messages import Handle
from raytrain_x.torch.async_ops import allreduce_async_
from raytrain_x.torch.grad_sync import GradientSync, Reducer
from raytrain_x.torch.gradient_layout import GradientBuffer, GradientLayout


def compressed_shape(p: torch.Tensor, rank: int, min_rate: float) -> tuple[int, int, int] | None:
    """(n, m, r) when `p`'s gradient is compressed: viewed as n x m (its first dimension by
    the rest) and approximated at rank r = min(rank, n, m), when that shrinks it by at least
    `min_rate`; None for vectors and for matrices that would not shrink enough."""
    if p.dim() <= 1:
        return None
    n = p.shape[0]
    m = p.numel() // n
    r = min(rank, n, m)
    return (n, m, r) if (n + m) * r * min_rate < n * m else None


def orthonormalize(p: torch.Tensor) -> None:
    """Orthonormalises `p`'s columns in place (a Householder QR's Q, as torch's hook
    takes: Gram-Schmidt in float32 drifts from orthogonal as the rank grows)."""
    p.copy_(torch.linalg.qr(p)[0])


class _Bucket:
    """One bucket's compression: its matrices' P and Q (views of one flat buffer each, one
    allreduce each), its uncompressed gradients' flat copy, and its error."""

    def __init__(self, index: int, buffer: GradientBuffer, rank: int, min_rate: float) -> None:
        self.index = index
        self.buffer = buffer
        self.matrices: list[tuple[torch.Tensor, int, int, int]] = []
        self.whole: list[torch.Tensor] = []
        for p in buffer.params:
            shape = compressed_shape(p, rank, min_rate)
            if shape is None:
                self.whole.append(p)
            else:
                self.matrices.append((p, *shape))
        like = buffer.flat
        self.p_flat = like.new_zeros(sum(n * r for _, n, _, r in self.matrices))
        self.q_flat = like.new_zeros(sum(m * r for _, _, m, r in self.matrices))
        self.ps = _split(self.p_flat, [(n, r) for _, n, _, r in self.matrices])
        self.qs = _split(self.q_flat, [(m, r) for _, _, m, r in self.matrices])
        self.whole_flat = like.new_zeros(sum(p.numel() for p in self.whole))
        self.error: torch.Tensor | None = None
        self.sent_input: torch.Tensor | None = None
        self.handles: list[Handle] = []
        self.phase = 0  # 0: not sent; 1: Ps (and the whole ones) on the wire; 2: Qs; 3: done

    def gradients(self) -> list[torch.Tensor]:
        """Each matrix's gradient viewed as n x m (a view of the bucket)."""
        return [self.buffer.views[p].view(n, m) for p, n, m, _ in self.matrices]


def _split(flat: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    out, at = [], 0
    for rows, cols in shapes:
        out.append(flat[at:at + rows * cols].view(rows, cols))
        at += rows * cols
    return out


class PowerSGD(Reducer):
    """Low-rank gradient compression with error feedback, torch's PowerSGD comm hook for
    `DistributedOptimizer(reducer=rx.PowerSGD(...))`.

    Args:
        matrix_rank: the rank of each gradient's approximation (torch's
            `matrix_approximation_rank`); higher is more accurate and sends more.
        start_iter: steps reduced uncompressed first (torch's `start_powerSGD_iter`).
        min_compression_rate: a gradient is compressed only when low rank shrinks it by at
            least this much; others are averaged whole.
        error_feedback: carry each rank's compression error into its next step's gradient.
        warm_start: start each step's power iteration from the last step's Q (False: a fresh
            random Q every step).
        bucket_cap_mb: the size of the buckets gradients are grouped in (DDP's 25 MB).
        seed: the seed every rank draws the same random Qs from.
    """

    kind = "powersgd"
    warns_unskipped = True

    def __init__(self, matrix_rank: int = 1, start_iter: int = 1000,
                 min_compression_rate: float = 2.0, error_feedback: bool = True,
                 warm_start: bool = True, bucket_cap_mb: float = 25.0, seed: int = 0) -> None:
        for name, value, low in (("matrix_rank", matrix_rank, 1), ("start_iter", start_iter, 0),
                                 ("seed", seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"PowerSGD {name} must be an int >= {low}, got {value!r}")
        if not min_compression_rate > 0:
            raise ConfigError(f"PowerSGD min_compression_rate must be > 0, got "
                              f"{min_compression_rate!r}")
        if not bucket_cap_mb > 0:
            raise ConfigError(f"PowerSGD bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        self.matrix_rank = matrix_rank
        self.start_iter = start_iter
        self.min_compression_rate = min_compression_rate
        self.error_feedback = error_feedback
        self.warm_start = warm_start
        self.bucket_cap_mb = bucket_cap_mb
        self.seed = seed
        self.iteration = 0  # steps taken
        self._world: object | None = None  # the engine the Qs and errors belong to
        self._began = False

    def __repr__(self) -> str:
        return (f"PowerSGD(matrix_rank={self.matrix_rank}, start_iter={self.start_iter}, "
                f"min_compression_rate={self.min_compression_rate}, "
                f"error_feedback={self.error_feedback}, warm_start={self.warm_start})")

    def bind(self, core: GradientSync) -> None:
        super().bind(core)
        params = core.reduced_params
        self.layout = GradientLayout(params, core.gradient_names, None)
        self.layout.build(int(self.bucket_cap_mb * 2**20), 0)
        self._buckets = [_Bucket(i, buffer, self.matrix_rank, self.min_compression_rate)
                         for i, buffer in enumerate(self.layout.buckets)]
        self._bucket_of = {p: b for b in self._buckets for p in b.buffer.params}

    @property
    def compressed(self) -> bool:
        """This step's gradients are compressed (`start_iter` steps have passed)."""
        return self.iteration >= self.start_iter

    def bytes_sent(self) -> tuple[int, int]:
        """(bytes a step sends compressed, bytes it would send uncompressed), per rank."""
        sent = sum((b.p_flat.numel() + b.q_flat.numel()) * b.p_flat.element_size()
                   + b.whole_flat.numel() * b.whole_flat.element_size() for b in self._buckets)
        whole = sum(b.buffer.flat.numel() * b.buffer.flat.element_size() for b in self._buckets)
        return sent, whole

    # ------------------------------------------------------------------ the world
    def _begin_step(self) -> None:
        """The step's first bucket: in a new world (the first, or after an elastic change)
        every rank draws the same Qs and starts without error."""
        self._began = True
        engine = runtime.engine()
        if engine is not self._world:
            self._world = engine
            self._draw_qs()
            for b in self._buckets:
                b.error = None
        elif not self.warm_start:
            self._draw_qs()

    def _draw_qs(self) -> None:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.iteration)
        for b in self._buckets:
            if b.q_flat.numel():
                b.q_flat.copy_(torch.randn(b.q_flat.shape, generator=g, dtype=torch.float64))
                for q in b.qs:
                    orthonormalize(q)

    # ------------------------------------------------------------------ backward
    def ready(self, p: torch.Tensor) -> None:
        if not self._began:
            self._begin_step()
        bucket = self._bucket_of[p]
        bucket.buffer.ready += 1
        if bucket.buffer.ready >= len(bucket.buffer.params):
            self._send(bucket)
            self._advance(wait=False)

    def _send(self, b: _Bucket) -> None:
        """Phase 1: the bucket's Ps and its whole gradients go on the wire."""
        b.buffer.ready = 0
        b.buffer.attach()
        flat = b.buffer.flat
        pset = self.core.process_set
        name = f"powersgd.{b.index}"
        if not self.compressed:
            b.handles = [allreduce_async_(flat, name=f"{name}.all", op=Average,
                                          process_set=pset, fuse=False)]
            b.phase = 2  # lands as the final gradient
            return
        if self.error_feedback:
            if b.error is None:
                b.error = torch.zeros_like(flat)
            flat.add_(b.error)
            b.sent_input = flat.clone()
        if b.whole:
            torch.cat([b.buffer.views[p].reshape(-1) for p in b.whole], out=b.whole_flat)
        for m, p_, q in zip(b.gradients(), b.ps, b.qs):
            torch.matmul(m, q, out=p_)
        b.handles = []
        if b.whole:
            b.handles.append(allreduce_async_(b.whole_flat, name=f"{name}.whole", op=Average,
                                              process_set=pset))
        if b.matrices:
            b.handles.append(allreduce_async_(b.p_flat, name=f"{name}.p", op=Sum,
                                              process_set=pset))
        b.phase = 1

    def _advance(self, wait: bool) -> None:
        """Moves every sent bucket on as far as its landed reductions let it (all the way,
        waiting, with `wait`)."""
        for b in self._buckets:
            while b.phase in (1, 2) and (wait or all(h.done() for h in b.handles)):
                for h in b.handles:
                    h.wait()
                if b.phase == 1:
                    self._send_qs(b)
                else:
                    self._finish(b)

    def _send_qs(self, b: _Bucket) -> None:
        """Phase 2: the summed Ps orthonormalised; Q = M^T P goes on the wire."""
        for p_ in b.ps:
            orthonormalize(p_)
        for m, p_, q in zip(b.gradients(), b.ps, b.qs):
            torch.matmul(m.T, p_, out=q)
        b.handles = ([allreduce_async_(b.q_flat, name=f"powersgd.{b.index}.q", op=Sum,
                                       process_set=self.core.process_set)]
                     if b.matrices else [])
        b.phase = 2

    def _finish(self, b: _Bucket) -> None:
        """Phase 3: the bucket's gradients are the averages (exact for the whole ones,
        P Q^T / world for the matrices); the error is what this rank sent minus that."""
        b.phase = 3
        b.handles = []
        if not self.compressed:
            return
        world = self.core.process_set.size()
        for m, p_, q in zip(b.gradients(), b.ps, b.qs):
            torch.matmul(p_, q.T, out=m)
            m.div_(world)
        at = 0
        for p in b.whole:
            view = b.buffer.views[p]
            view.copy_(b.whole_flat[at:at + view.numel()].view_as(view))
            at += view.numel()
        if self.error_feedback and b.sent_input is not None:
            torch.sub(b.sent_input, b.buffer.flat, out=b.error)
            b.sent_input = None

    def busy(self, p: torch.Tensor) -> bool:
        return self._bucket_of[p].phase in (1, 2)

    def in_flight(self) -> bool:
        return any(b.phase in (1, 2) for b in self._buckets)

    def synchronize(self) -> None:
        if not self._began:
            self._begin_step()
        for b in self._buckets:  # buckets some of whose gradients never came: zeros there
            if b.phase == 0:
                self._send(b)
        self._advance(wait=True)

    def forget(self) -> None:
        for b in self._buckets:
            b.phase = 0
            b.handles = []
            b.buffer.ready = 0
            b.sent_input = None  # a failed step's input is not this rank's error
        self._began = False

    def step(self, closure: Callable[[], Any] | None, synchronize: bool) -> Any:
        result = super().step(closure, synchronize)
        self.iteration += 1
        return result

    def zero_grad(self, set_to_none: bool) -> bool:
        """The gradients stay views of their buckets (zeroed, never None), as with DDP's
        gradient_as_bucket_view."""
        self.layout.zero(set_to_none)
        return True

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"iteration": self.iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
