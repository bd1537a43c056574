"""Execute a :class:`~gradsum.schedule.plan.Plan` on a simulated cluster, event by event.

Workers run their profile's per-layer forward and backward compute; gradients become ready layer
by layer; groups become eligible according to the plan's trigger and are sent part by part through
the fluid network; PS shards aggregate and answer pulls; the next forward waits as the plan's
forward gate says. Everything is deterministic.

Groups are released in the send order (``schedule/ordering.py``, as the runtime's
``GradientSync`` releases them) and admitted, part by part onto per-shard streams, by the same
:class:`~gradsum.schedule.dispatch.SendWindow` the runtime's ``ShardSender`` uses, so both agree
on what is in flight. PS message life cycle (one part of one group, one worker):

1. the window starts the part (its group admitted, its shard's stream free); the worker's
   communication thread spends ``alpha_worker`` on the message (one thread: messages queue
   FIFO);
2. the bytes flow worker → shard (max-min fair share of every port and NIC on the way);
3. the shard's core spends ``alpha_shard`` on the message (one core: FIFO);
4. when all n workers' pushes of the part are in, the shard answers each worker, in arrival order,
   with ``alpha_shard`` of CPU and a flow shard → worker;
   (where the shard is one core, ``ClusterSpec.shard_one_core``, its flows cross no shard port
   and its core spends ``alpha_shard`` + bytes / ``shard_bw`` on each push and each answer);
5. the worker's thread spends ``alpha_worker`` receiving it; the part is back (its stream and,
   with the group's last part, the window's bytes are free); a group is done at a worker when
   all its parts are back.

All-reduce plans run each group as a ring all-reduce (2(n−1) steps of n concurrent neighbour
flows of M/n bytes, each step paying ``alpha_worker``), one group at a time, once every worker has
released the group.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..schedule.cluster import ClusterSpec
from ..schedule.costs import AllReduceCost
from ..schedule.dispatch import SendWindow
from ..schedule.ordering import send_order
from ..schedule.plan import Plan
from ..schedule.profile import ModelProfile
from .events import EventQueue
from .fluid import FluidNetwork
from .topology import Topology


@dataclass(frozen=True)
class SimResult:
    iteration_s: float
    throughput: float  # samples per second, all workers together
    iteration_ends: tuple[float, ...]  # per iteration, when its last group was back everywhere
    messages: int
    events: int
    rate_updates: int


def default_send_order(plan: Plan, profile: ModelProfile, cluster: ClusterSpec) -> tuple[int, ...]:
    """The order a runtime would fix for this plan: list order, or the priority replay with one
    uncontended message's α + β·M per group (what start-up's fit measures)."""
    link = AllReduceCost.from_cluster(cluster).link
    return send_order(plan, profile, lambda n: link.time(n * cluster.bytes_per_element))


class Simulation:
    """``order``: the send order (default :func:`default_send_order`); ``trace``: a list that
    receives ``(time, event, worker, group, part)`` for every ``"release"`` (part None),
    ``"start"`` and ``"back"`` of a PS plan's messages, in the order they happen."""

    def __init__(
        self,
        profile: ModelProfile,
        plan: Plan,
        cluster: ClusterSpec,
        iterations: int = 3,
        *,
        order: Sequence[int] | None = None,
        trace: list | None = None,
    ) -> None:
        if iterations < 3:
            raise ValueError(
                "simulate at least 3 iterations (the first is a transient: the period is "
                "measured from the second iteration's backward start)"
            )
        if plan.total_elements != profile.total_params:
            raise ValueError("the plan was made for another profile")
        if plan.aggregator == "ps":
            used = {p.shard for g in plan.groups for p in g.parts}
            if used and max(used) >= cluster.shards:
                raise ValueError("the plan uses more shards than the cluster has")
        self.profile, self.plan, self.cluster = profile, plan, cluster
        self.iterations = iterations
        self.order = tuple(default_send_order(plan, profile, cluster) if order is None else order)
        if sorted(self.order) != list(range(len(plan.groups))):
            raise ValueError("a send order must list every group once")
        self.trace = trace
        self.clock = EventQueue()
        self.topology = Topology(cluster)
        self.network = FluidNetwork(self.topology.capacity)
        self._index_plan()
        self._init_workers()
        self._shard_cpu_free = np.zeros(cluster.shards)
        self._arrivals: dict[tuple, list[int]] = defaultdict(list)
        self._allreduce_waiting: dict[tuple, int] = defaultdict(int)
        self._allreduce_queue: list = []
        self._allreduce_busy = False
        self.messages = 0

    # ----------------------------------------------------------------- setup
    def _index_plan(self) -> None:
        plan = self.plan
        self.num_groups = len(plan.groups)
        self.groups_of_layer: list[list[int]] = [[] for _ in range(plan.num_layers)]
        self.layer_count = np.zeros(self.num_groups, dtype=np.int64)
        for g, group in enumerate(plan.groups):
            for layer in plan.layers_of(group):
                self.groups_of_layer[layer].append(g)
                self.layer_count[g] += 1
        element_bytes = self.cluster.bytes_per_element
        self.part_bytes = [[p.numel * element_bytes for p in group.parts] for group in plan.groups]
        self.group_bytes = [group.numel * element_bytes for group in plan.groups]
        self.position = {g: k for k, g in enumerate(self.order)}

    def _init_workers(self) -> None:
        n, L = self.cluster.workers, self.plan.num_layers
        self.ops = [("F", layer) for layer in reversed(range(L))]
        self.ops += [("B", layer) for layer in range(L)]
        self.iteration = [0] * n
        self.op_index = [0] * n
        self.blocked = [False] * n
        self.group_done = np.zeros((n, self.num_groups), dtype=bool)
        self.done_count = [0] * n
        self.layers_pending = np.tile(self.layer_count, (n, 1))
        self.parts_pending = np.zeros((n, self.num_groups), dtype=np.int64)
        self.ready = np.zeros((n, self.num_groups), dtype=bool)
        self.released = [0] * n  # groups of the send order released this iteration
        element_bytes = self.cluster.bytes_per_element
        self.windows = (
            [SendWindow(self.plan, w, element_bytes) for w in range(n)]
            if self.plan.aggregator == "ps"
            else []
        )
        self._worker_cpu_free = np.zeros(n)
        self.comm_iteration = [0] * n
        self.iteration_ends: list[list[float]] = [[] for _ in range(n)]
        self.backward_starts: list[list[float]] = [[] for _ in range(n)]

    # ----------------------------------------------------------------- main loop
    def run(self) -> SimResult:
        for worker in range(self.cluster.workers):
            self._next_op(worker)
        clock, network = self.clock, self.network
        while clock or len(network):
            step = min(clock.next_time(), clock.now + network.time_to_next_completion())
            finished = network.advance(step - clock.now)
            clock.now = step
            for callback, args in finished:
                callback(*args)
            clock.run_due()
        return self._result()

    def _result(self) -> SimResult:
        """The steady-state period: between the slowest worker's backward starts, from the
        second iteration on. Every wait of a forward on the previous iteration's groups lies
        between two backward starts, so the period is never below the compute time (between
        iteration ends it could be: with per-layer forward gates the next iteration starts
        before the last group is back, and a tail longer in one iteration than in the next gave
        a period shorter than one forward and backward). The first iteration is left out: every
        worker starts it at the same instant, later ones when their own groups came back, and
        that stagger alone changes the period (VGG16, wfbp, 32 workers: 0.319 s for the first
        iteration, 0.272 s for each after it)."""
        workers = range(self.cluster.workers)
        ends = [max(self.iteration_ends[w][k] for w in workers) for k in range(self.iterations)]
        starts = [max(self.backward_starts[w][k] for w in workers) for k in range(self.iterations)]
        per_iteration = (starts[-1] - starts[1]) / (self.iterations - 2)
        samples = self.cluster.workers * self.profile.batch_size
        return SimResult(
            per_iteration,
            samples / per_iteration,
            tuple(ends),
            self.messages,
            self.clock.processed,
            self.network.recomputations,
        )

    # ----------------------------------------------------------------- compute
    def _next_op(self, w: int) -> None:
        if self.op_index[w] == len(self.ops):
            self.iteration[w] += 1
            self.op_index[w] = 0
        if self.iteration[w] >= self.iterations:
            return
        kind, layer = self.ops[self.op_index[w]]
        if kind == "F" and self.iteration[w] > 0 and not self._forward_allowed(w, layer):
            self.blocked[w] = True
            return
        if kind == "B" and layer == 0:
            self._start_backward(w)
        spec = self.profile.layers[layer]
        duration = spec.forward_s if kind == "F" else spec.backward_s
        self.clock.after(duration, self._op_finished, w, kind, layer)

    def _forward_allowed(self, w: int, layer: int) -> bool:
        if self.plan.forward_gate == "barrier":
            return self.done_count[w] == self.num_groups
        return bool(self.group_done[w, self.groups_of_layer[layer]].all())

    def _op_finished(self, w: int, kind: str, layer: int) -> None:
        self.op_index[w] += 1
        if kind == "B":
            self._gradient_ready(w, layer)
            if layer == self.plan.num_layers - 1 and self.plan.trigger == "after_backward":
                for g in range(self.num_groups):
                    self._group_eligible(w, g)
        self._next_op(w)

    def _start_backward(self, w: int) -> None:
        self.backward_starts[w].append(self.clock.now)
        self.group_done[w] = False
        self.done_count[w] = 0
        self.layers_pending[w] = self.layer_count
        self.comm_iteration[w] = self.iteration[w]
        self.ready[w] = False
        self.released[w] = 0

    def _gradient_ready(self, w: int, layer: int) -> None:
        for g in self.groups_of_layer[layer]:
            self.layers_pending[w, g] -= 1
            if self.layers_pending[w, g] == 0 and self.plan.trigger == "when_ready":
                self._group_eligible(w, g)

    def _group_done(self, w: int, g: int) -> None:
        self.group_done[w, g] = True
        self.done_count[w] += 1
        if self.done_count[w] == self.num_groups:
            self.iteration_ends[w].append(self.clock.now)
        if self.blocked[w]:
            _kind, layer = self.ops[self.op_index[w]]
            if self._forward_allowed(w, layer):
                self.blocked[w] = False
                self._next_op(w)

    # ----------------------------------------------------------------- sending
    def _group_eligible(self, w: int, g: int) -> None:
        """Group ``g``'s gradients exist; release what the send order now allows."""
        self.ready[w, g] = True
        while self.released[w] < self.num_groups and self.ready[w, self.order[self.released[w]]]:
            g = self.order[self.released[w]]
            self.released[w] += 1
            self._record("release", w, g, None)
            if self.plan.aggregator == "allreduce":
                self._allreduce_ready(w, g)
                continue
            self.parts_pending[w, g] = len(self.plan.groups[g].parts)
            self._start_parts(w, self.windows[w].release(g))

    def _start_parts(self, w: int, parts: list[tuple[int, int]]) -> None:
        for g, index in parts:
            self.messages += 1
            self._record("start", w, g, index)
            self._worker_work(w, self._start_push, w, g, index)

    def _record(self, event: str, w: int, g: int, index: int | None) -> None:
        if self.trace is not None:
            self.trace.append((self.clock.now, event, w, g, index))

    def _worker_work(self, w: int, callback, *args) -> None:
        """``alpha_worker`` of the worker's one communication thread (messages queue FIFO)."""
        start = max(self.clock.now, self._worker_cpu_free[w])
        self._worker_cpu_free[w] = start + self.cluster.alpha_worker
        self.clock.at(self._worker_cpu_free[w], callback, *args)

    def _start_push(self, w: int, g: int, index: int) -> None:
        shard = self.plan.groups[g].parts[index].shard
        path = self.topology.push_path(w, shard)
        self.network.add((self._push_arrived, (w, g, index)), path, self.part_bytes[g][index])

    def _shard_work(self, shard: int, nbytes: float, callback, *args) -> None:
        """One message on the shard's core (FIFO): ``alpha_shard``, and its bytes too where the
        core is all the shard has (``shard_one_core``; otherwise they crossed its port)."""
        cost = self.cluster.alpha_shard
        if self.cluster.shard_one_core:
            cost += nbytes / self.cluster.shard_bw
        start = max(self.clock.now, self._shard_cpu_free[shard])
        self._shard_cpu_free[shard] = start + cost
        self.clock.at(self._shard_cpu_free[shard], callback, *args)

    def _push_arrived(self, w: int, g: int, index: int) -> None:
        shard = self.plan.groups[g].parts[index].shard
        self._shard_work(shard, self.part_bytes[g][index], self._push_processed, w, g, index)

    def _push_processed(self, w: int, g: int, index: int) -> None:
        key = (self.comm_iteration[w], g, index)
        arrived = self._arrivals[key]
        arrived.append(w)
        if len(arrived) == self.cluster.workers:
            del self._arrivals[key]
            shard = self.plan.groups[g].parts[index].shard
            for worker in arrived:
                nbytes = self.part_bytes[g][index]
                self._shard_work(shard, nbytes, self._start_pull, worker, g, index)

    def _start_pull(self, w: int, g: int, index: int) -> None:
        shard = self.plan.groups[g].parts[index].shard
        path = self.topology.pull_path(shard, w)
        self.network.add((self._pull_arrived, (w, g, index)), path, self.part_bytes[g][index])

    def _pull_arrived(self, w: int, g: int, index: int) -> None:
        self._worker_work(w, self._pull_received, w, g, index)

    def _pull_received(self, w: int, g: int, index: int) -> None:
        self._record("back", w, g, index)
        starts, _ = self.windows[w].part_back(g, index)
        self.parts_pending[w, g] -= 1
        if self.parts_pending[w, g] == 0:
            self._group_done(w, g)
        self._start_parts(w, starts)

    # ----------------------------------------------------------------- all-reduce
    def _allreduce_ready(self, w: int, g: int) -> None:
        key = (self.comm_iteration[w], g)
        self._allreduce_waiting[key] += 1
        if self._allreduce_waiting[key] == self.cluster.workers:
            del self._allreduce_waiting[key]
            heapq.heappush(self._allreduce_queue, (key[0], self.position[g], g))
            self._next_allreduce()

    def _next_allreduce(self) -> None:
        if self._allreduce_busy or not self._allreduce_queue:
            return
        _, _, g = heapq.heappop(self._allreduce_queue)
        self._allreduce_busy = True
        self._ring_step(g, 2 * (self.cluster.workers - 1))

    def _ring_step(self, g: int, steps_left: int) -> None:
        n = self.cluster.workers
        if steps_left == 0:
            self._allreduce_busy = False
            for w in range(n):
                self._group_done(w, g)
            self._next_allreduce()
            return
        self.messages += n
        self.clock.after(self.cluster.alpha_worker, self._ring_flows, g, steps_left)

    def _ring_flows(self, g: int, steps_left: int) -> None:
        n = self.cluster.workers
        pending = [n]

        def one_done() -> None:
            pending[0] -= 1
            if pending[0] == 0:
                self._ring_step(g, steps_left - 1)

        chunk = self.group_bytes[g] / n
        for w in range(n):
            self.network.add((one_done, ()), self.topology.worker_path(w, (w + 1) % n), chunk)


def simulate(
    profile: ModelProfile,
    plan: Plan,
    cluster: ClusterSpec,
    iterations: int = 3,
    *,
    order: Sequence[int] | None = None,
) -> SimResult:
    """Steady-state time per iteration of ``plan`` (mean over the iterations after the first)."""
    return Simulation(profile, plan, cluster, iterations, order=order).run()
