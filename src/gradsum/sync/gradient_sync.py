"""gradsum's own gradient synchronisation, for users without DDP and for communication scheduling.

    sync = GradientSync(model, Session(codec, aggregator))   # wait-free backprop by default
    loss.backward()                                          # groups leave as their grads are ready
    sync.wait()                                              # every group back in param.grad
    optimizer.step()

Each parameter gets a post-accumulate-grad hook. Gradients are sent in groups; a group is
released to its sender once all its gradients are ready *and* every group before it in the send
order has been released, so all workers issue the same transfers in the same order.

Groups are whole parameters (``groups``, ``fusion_elements``, or one per parameter), or a
scheduler's :class:`~gradsum.schedule.plan.Plan` (``plan=``, with its send ``order``): element
ranges of the backward-order gradient buffer, possibly parts of a tensor, each split into parts
on PS shards. A plan's trigger is honoured (``after_backward``: nothing leaves before the whole
backward pass has finished); its parts go to their shards when the aggregator can address shards
one by one (:class:`~gradsum.sync.sharded.ShardedServiceAggregator`), otherwise each group is one
round of the Session (all-reduce, switch). See :mod:`gradsum.sync.senders`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from ..codecs.base import DeviceChecks
from ..schedule.plan import Plan
from .comm import wait_all
from .layout import BufferLayout, Segment
from .senders import SerialSender, ShardSender
from .session import Session


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
        session: Session,
        *,
        groups: Sequence[Sequence[int]] | None = None,
        fusion_elements: int | None = None,
        plan: Plan | None = None,
        order: Sequence[int] | None = None,
        timeout: float = 300.0,
        message_delay: float = 0.0,
        broadcast_from: int | None = 0,
        on_backward: bool = True,
    ):
        """``broadcast_from``: where a process group is initialized, the rank whose parameters
        every replica starts from, as DDP does (None: the replicas already agree; without a
        process group they must, e.g. from a shared seed). ``on_backward`` False: no gradient
        leaves during backward; ``release`` sends what ``param.grad`` holds (local steps' outer
        round, sync/local_steps.py)."""
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        if broadcast_from is not None and dist.is_available() and dist.is_initialized():
            broadcast_parameters(self.parameters, broadcast_from)
        if plan is not None and (groups is not None or fusion_elements):
            raise ValueError("pass a plan, or groups / fusion_elements, not both")
        self._segments = (
            _plan_segments(plan, self.parameters)
            if plan is not None
            else _param_segments(self.parameters, groups, fusion_elements)
        )
        self.plan = plan
        self.groups = [sorted({s.param for s in segs}) for segs in self._segments]
        if plan is None:  # a plan's groups tile the buffer (checked by Plan and BufferLayout)
            _check_cover(self.groups, len(self.parameters))
        self.order = _check_order(order, len(self.groups))
        self.session = session
        self.on_backward = on_backward
        self.timeout = timeout
        if message_delay < 0:
            raise ValueError(f"message_delay must be >= 0 s, got {message_delay}")
        self.message_delay = message_delay
        self.step = 0
        after_backward = plan is not None and plan.trigger == "after_backward"
        everything = list(range(len(self.parameters)))
        self._needs = [everything if after_backward else g for g in self.groups]
        self._waiting_on: dict[int, list[int]] = {}
        for g, needed in enumerate(self._needs):
            for i in needed:
                self._waiting_on.setdefault(i, []).append(g)
        self._missing = [len(n) for n in self._needs]
        self._released = 0
        self._futures: list[torch.futures.Future] = []
        self._sources: list[torch.Tensor] | None = None  # release's tensors; None: param.grad
        # every round's device checks of a step, read once in ``wait`` (no host sync per group)
        self._checks = DeviceChecks()
        self._sender = self._make_sender()
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook(i))
            for i, p in enumerate(self.parameters)
        ] if on_backward else []  # fmt: skip

    def _make_sender(self):
        if self.plan is not None and self.plan.aggregator == "ps" and self.session.shards:
            return ShardSender(self.session, self.plan, timeout=self.timeout,
                               message_delay=self.message_delay)  # fmt: skip
        return SerialSender(self.session, message_delay=self.message_delay)

    def _hook(self, index: int):
        def on_ready(_: torch.Tensor) -> None:
            for g in self._waiting_on[index]:
                self._missing[g] -= 1
            self._release_ready_groups()

        return on_ready

    def release(self, tensors: Sequence[torch.Tensor] | None = None,
                groups: Sequence[int] | None = None) -> None:  # fmt: skip
        """Send every group now, from what ``param.grad`` holds, in the send order a backward
        pass would release them; ``wait`` as after backward. ``tensors`` (one per parameter,
        shaped alike): send these instead and write the averages back into them, leaving
        ``param.grad`` free for steps taken while the round is in flight (local steps'
        overlapped outer round, sync/local_steps.py). ``groups``: only these groups, this step
        (local steps' fragments; without backward's hooks): every worker must name the same."""
        if tensors is not None:
            tensors = list(tensors)
            if [t.shape for t in tensors] != [p.shape for p in self.parameters]:
                raise ValueError("release: one tensor per parameter, of its shape")
        self._sources = tensors
        if groups is not None:
            self._release_subset(groups)
            return
        for index in range(len(self.parameters)):
            for g in self._waiting_on[index]:
                self._missing[g] -= 1
        # Without backward's hooks every worker releases all groups here, at once: they can go
        # as one batched round (no worker batches by what happened to be ready)
        self._release_ready_groups(together=not self._handles)

    def _release_subset(self, groups: Sequence[int]) -> None:
        """``groups`` as one job of the sender, in send order; the step waits for them only."""
        if self._handles:
            raise RuntimeError("release(groups=...) sends some groups only: a sync without "
                               "backward hooks (on_backward=False)")  # fmt: skip
        chosen = set(groups)
        if not chosen or not chosen <= set(range(len(self.groups))):
            raise ValueError(f"release: groups {sorted(chosen)} are not among this sync's "
                             f"{len(self.groups)} groups")  # fmt: skip
        if self._released:
            raise RuntimeError("release: this step's groups were already released")
        self._released = len(self.order)  # nothing else is sent this step
        self._send_groups([g for g in self.order if g in chosen], together=True)

    def _release_ready_groups(self, together: bool = False) -> None:
        """Release groups strictly in send order: a ready group waits for those before it.
        ``together``: the ready groups as one job of the sender (``submit_many``)."""
        ready = []
        while self._released < len(self.order) and self._missing[self.order[self._released]] == 0:
            ready.append(self.order[self._released])
            self._released += 1
        self._send_groups(ready, together)

    def _send_groups(self, groups: list[int], together: bool) -> None:
        """``groups`` in this order; ``together``: as one job of the sender where it batches."""
        if together and len(groups) > 1 and hasattr(self._sender, "submit_many"):
            self._futures.extend(self._send_many(groups))
        else:
            self._futures.extend(self._send(group) for group in groups)

    def _send(self, group: int) -> torch.futures.Future:
        flat, shapes, write_back = self._outgoing(group)
        return self._sender.submit(group, flat, self.step, shapes, self._checks).then(write_back)

    def _send_many(self, groups: list[int]) -> list[torch.futures.Future]:
        outgoing = [self._outgoing(group) for group in groups]
        flats = [flat for flat, _, _ in outgoing]
        shapes = [shapes for _, shapes, _ in outgoing]
        futures = self._sender.submit_many(groups, flats, self.step, shapes, self._checks)
        return [f.then(write_back) for f, (_, _, write_back) in zip(futures, outgoing, strict=True)]

    def _outgoing(self, group: int):
        """A group's flat gradient, its tensors' shapes, and the callback that writes its
        average back into the tensors it came from."""
        sources = self._sources
        blocks = [
            block
            for s in self._segments[group]
            for block in row_major_blocks(
                self.parameters[s.param].grad if sources is None else sources[s.param],
                s.start, s.stop,
            )
        ]
        # reshape is a view of a contiguous block and a copy (in row-major order) of any other.
        pieces = [block.reshape(-1) for block in blocks]
        flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0]

        def write_back(future: torch.futures.Future) -> None:
            average = future.wait()
            offset = 0
            for block in blocks:  # views of param.grad, whatever the copies sent
                block.copy_(average[offset : offset + block.numel()].view(block.shape))
                offset += block.numel()

        shapes = [self._shape(s) for s in self._segments[group]]
        return flat, shapes, write_back

    def _shape(self, segment: Segment) -> tuple[int, ...]:
        """A segment's shape for codecs that work per tensor: its parameter's, if whole."""
        param = self.parameters[segment.param]
        whole = segment.start == 0 and segment.stop == param.numel()
        return tuple(param.shape) if whole else (segment.numel,)

    def wait(self) -> None:
        """Block until every group is aggregated and written back into ``param.grad``."""
        if self._released < len(self.order):
            stuck = self.order[self._released]
            raise RuntimeError(
                f"gradient group {stuck} (parameters {self.groups[stuck]}) never became ready: "
                "a parameter received no gradient this step; every worker must use every parameter"
            )
        try:
            wait_all(
                self._futures, self.timeout, f"aggregation of {len(self._futures)} gradient groups"
            )
            self._checks.raise_if_failed()  # the step's one read of its device checks
        finally:
            self._checks = DeviceChecks()
            self._futures = []
            self._sources = None
            self._missing = [len(n) for n in self._needs]
            self._released = 0
            self.step += 1

    @contextlib.contextmanager
    def uncompressed(self) -> Iterator[None]:
        """Steps inside travel through the Session's lossless codec (fp32, bfp on a switch)
        instead of the training codec: warm-up steps, and the training loop's retry of a step
        whose compressed gradient diverged. Every worker must enter it for the same steps."""
        self._sender.session = self.session.uncompressed()
        try:
            yield
        finally:
            self._sender.session = self.session

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the sync: its step (the codecs' random streams and the
        warm-up count on it) and the Session's codec state (error feedback)."""
        return {"step": self.step, "session": self.session.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.session.load_state_dict(state["session"])

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._sender.close()


def broadcast_parameters(parameters: Sequence[torch.Tensor], source: int) -> None:
    """Every rank's ``parameters`` set to ``source``'s, in one broadcast of the default group
    (through host memory, which every backend can send)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in parameters:
        by_dtype.setdefault(p.dtype, []).append(p)
    with torch.no_grad():
        for same in by_dtype.values():  # one broadcast per dtype, bit for bit
            flat = torch.cat([p.detach().reshape(-1).cpu() for p in same])
            dist.broadcast(flat, src=source)
            offset = 0
            for p in same:
                p.copy_(flat[offset : offset + p.numel()].view(p.shape))
                offset += p.numel()


def row_major_blocks(tensor: torch.Tensor, start: int, stop: int) -> list[torch.Tensor]:
    """Views of ``tensor`` that hold its elements ``[start, stop)`` in row-major order.

    Plans and segments number a gradient's elements in row-major (logical) order, the same on
    every worker whatever its memory layout. A contiguous tensor gives one flat view (no copy).
    Any other (a channels-last convolution weight, a transposed weight) cannot be flattened
    without a copy, and writing into a copy would leave ``param.grad`` unaveraged; so the range
    is cut into at most 2·ndim − 1 rectangular blocks — a partial leading row, whole rows, a
    partial trailing row, recursively — each a view with the tensor's own strides. Writing a
    block touches only that range, so groups holding other parts of the same tensor can be
    written back concurrently.
    """
    if tensor.is_contiguous():  # every empty tensor is: an empty parameter sends an empty view
        return [tensor.view(-1)[start:stop]]
    if stop <= start:
        return []
    if tensor.dim() == 1:
        return [tensor[start:stop]]
    row = tensor[0].numel()  # elements per index of the first dimension
    first, offset = divmod(start, row)
    last, remainder = divmod(stop, row)
    if first == last:
        return row_major_blocks(tensor[first], offset, remainder)
    blocks = []
    if offset:
        blocks += row_major_blocks(tensor[first], offset, row)
        first += 1
    if last > first:
        blocks.append(tensor[first:last])
    if remainder:
        blocks += row_major_blocks(tensor[last], 0, remainder)
    return blocks


def _param_segments(parameters, groups, fusion_elements) -> list[tuple[Segment, ...]]:
    """Whole-parameter groups: the given ones, static fusion, or one per parameter (WFBP)."""
    if groups is None:
        groups = (
            fusion_groups(parameters, fusion_elements)
            if fusion_elements
            else wfbp_groups(parameters)
        )
    return [tuple(Segment(i, 0, parameters[i].numel()) for i in g) for g in groups]


def _plan_segments(plan: Plan, parameters) -> list[tuple[Segment, ...]]:
    layout = BufferLayout(plan, [p.numel() for p in parameters])
    return [layout.segments(g.start, g.stop) for g in plan.groups]


def _check_order(order: Sequence[int] | None, count: int) -> list[int]:
    if order is None:
        return list(range(count))
    order = [int(g) for g in order]
    if sorted(order) != list(range(count)):
        raise ValueError(f"a send order must list groups 0..{count - 1} once each, got {order}")
    return order


def _check_cover(groups: list[list[int]], count: int) -> None:
    flat = sorted(i for g in groups for i in g)
    if flat != list(range(count)):
        raise ValueError(f"groups must cover parameters 0..{count - 1} exactly once, got {groups}")
