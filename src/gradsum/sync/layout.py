"""Where a plan's element ranges live in a model's gradients.

A :class:`~gradsum.schedule.plan.Plan` addresses gradients as ranges of one flat buffer that
concatenates the profile's layers in backward order (within a layer, its tensors in
``param_indices`` order). A :class:`Segment` is a piece of one parameter's flattened gradient;
a range of the buffer is a list of segments. Pure: only parameter sizes go in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..schedule.plan import Plan


@dataclass(frozen=True)
class Segment:
    param: int  # index into the synchronised parameters
    start: int  # element range of that parameter's flattened gradient
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


class BufferLayout:
    """Maps buffer ranges of a plan onto parameter segments."""

    def __init__(self, plan: Plan, numels: Sequence[int]):
        order = [i for layer in plan.layer_params for i in layer]
        if sorted(order) != list(range(len(numels))):
            raise ValueError(
                f"the plan's layers name parameters {sorted(order)}, but the model has "
                f"{len(numels)} parameters: the plan was made for another model"
            )
        sizes = [int(numels[i]) for i in order]
        if sum(sizes) != plan.total_elements:
            raise ValueError(
                f"the plan covers {plan.total_elements:,} elements, the model's gradients "
                f"{sum(sizes):,}: the plan was made for another model"
            )
        self._params = order
        self._starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def segments(self, start: int, stop: int) -> tuple[Segment, ...]:
        """The parameter pieces that make up buffer elements ``[start, stop)``, in buffer order."""
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        pieces = []
        k = first
        while k < len(self._params) and self._starts[k] < stop:
            base = int(self._starts[k])
            a, b = max(start, base), min(stop, int(self._starts[k + 1]))
            if b > a:
                pieces.append(Segment(self._params[k], a - base, b - base))
            k += 1
        return tuple(pieces)


def cut_shapes(shapes: Sequence[tuple[int, ...]], start: int, stop: int) -> list[tuple[int, ...]]:
    """The tensors that elements ``[start, stop)`` of a buffer of ``shapes`` (flattened, end to
    end) hold: whole tensors keep their shape, a part of one is 1-D. What a codec that works per
    tensor is told of a part (``Codec.describe``)."""
    pieces, base = [], 0
    for shape in shapes:
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        a, b = max(start, base), min(stop, base + count)
        if b > a:
            pieces.append(tuple(shape) if (a, b) == (base, base + count) else (b - a,))
        base += count
    return pieces
