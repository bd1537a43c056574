"""gradsum's own gradient synchronisation, for users without DDP and for communication scheduling.

    sync = GradientSync(model, codec, aggregator)            # wait-free backprop by default
    loss.backward()                                          # groups leave as their grads are ready
    sync.wait()                                              # every group back in param.grad
    optimizer.step()

Each parameter gets a post-accumulate-grad hook. Parameters are sent in groups; a group is
released to the communication thread once all its gradients are ready *and* every group before it
in the send order has been released, so all workers issue the same transfers in the same order.
Groups come from one place (``groups`` or ``fusion_elements``), so a scheduler's plan plugs in
without touching this class.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..codecs import Codec
from .aggregator import Aggregator
from .comm import CommunicationThread, wait_all
from .partition import PARTITION_ELEMENTS


def backward_order(parameters: Sequence[torch.nn.Parameter]) -> list[int]:
    """Indices in the order gradients usually become ready: last registered first."""
    return list(reversed(range(len(parameters))))


def wfbp_groups(parameters: Sequence[torch.nn.Parameter]) -> list[list[int]]:
    """Wait-free backprop: every parameter on its own, as soon as it is ready."""
    return [[i] for i in backward_order(parameters)]


def fusion_groups(parameters: Sequence[torch.nn.Parameter], threshold: int) -> list[list[int]]:
    """Static fusion: consecutive parameters (backward order) until ``threshold`` elements."""
    if threshold < 1:
        raise ValueError(f"fusion threshold must be >= 1 element, got {threshold}")
    groups: list[list[int]] = [[]]
    filled = 0
    for index in backward_order(parameters):
        if filled >= threshold:
            groups.append([])
            filled = 0
        groups[-1].append(index)
        filled += parameters[index].numel()
    return [g for g in groups if g]


class GradientSync:
    def __init__(
        self,
        model: torch.nn.Module,
        codec: Codec,
        aggregator: Aggregator,
        *,
        groups: Sequence[Sequence[int]] | None = None,
        fusion_elements: int | None = None,
        seed: int = 0,
        timeout: float = 300.0,
        partition_elements: int = PARTITION_ELEMENTS,
    ):
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        if groups is None:
            groups = (
                fusion_groups(self.parameters, fusion_elements)
                if fusion_elements
                else wfbp_groups(self.parameters)
            )
        self.groups = [list(g) for g in groups]
        _check_cover(self.groups, len(self.parameters))
        self.codec = codec
        self.aggregator = aggregator
        self.seed = seed
        self.timeout = timeout
        self.partition_elements = partition_elements
        self.step = 0
        self._group_of = {i: g for g, members in enumerate(self.groups) for i in members}
        self._missing = [len(g) for g in self.groups]
        self._released = 0
        self._futures: list[torch.futures.Future] = []
        self._thread = CommunicationThread("gradsum-sync")
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook(i))
            for i, p in enumerate(self.parameters)
        ]

    def _hook(self, index: int):
        def on_ready(_: torch.Tensor) -> None:
            self._missing[self._group_of[index]] -= 1
            self._release_ready_groups()

        return on_ready

    def _release_ready_groups(self) -> None:
        while self._released < len(self.groups) and self._missing[self._released] == 0:
            self._futures.append(self._send(self._released))
            self._released += 1

    def _send(self, group: int) -> torch.futures.Future:
        params = [self.parameters[i] for i in self.groups[group]]
        grads = [p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1)
        step = self.step

        def run() -> None:
            average = self.aggregator.synchronize(
                flat,
                self.codec,
                key=("group", group, flat.numel()),
                step=step,
                seed=self.seed,
                partition_elements=self.partition_elements,
            )
            offset = 0
            for grad in grads:
                grad.copy_(average[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()

        return self._thread.submit(run)

    def wait(self) -> None:
        """Block until every group is aggregated and written back into ``param.grad``."""
        if self._released < len(self.groups):
            stuck = self.groups[self._released]
            raise RuntimeError(
                f"gradient group {self._released} (parameters {stuck}) never became ready: a "
                "parameter received no gradient this step; every worker must use every parameter"
            )
        try:
            wait_all(
                self._futures, self.timeout, f"aggregation of {len(self.groups)} gradient groups"
            )
        finally:
            self._futures = []
            self._missing = [len(g) for g in self.groups]
            self._released = 0
            self.step += 1

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._thread.close()


def _check_cover(groups: list[list[int]], count: int) -> None:
    flat = sorted(i for g in groups for i in g)
    if flat != list(range(count)):
        raise ValueError(f"groups must cover parameters 0..{count - 1} exactly once, got {groups}")
