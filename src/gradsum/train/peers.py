"""What a PyTorch user would pick instead of gradsum: DDP with torch's own communication hooks.

``--aggregator ddp --ddp-hook H`` trains with ``DistributedDataParallel`` over the job's Gloo
group (the links every method shares) and torch's hook ``H``:

* ``allreduce`` — DDP's default: an fp32 all-reduce of each bucket;
* ``fp16`` / ``bf16`` — ``fp16_compress_hook`` / ``bf16_compress_hook``: each bucket cast to
  16 bits, all-reduced, cast back;
* ``powersgd`` — ``powerSGD_hook`` at ``--powersgd-rank`` with its error feedback and warm
  start, after ``--powersgd-start`` uncompressed steps (torch requires at least 2); with
  ``--powersgd-first-q shape`` its first Q per matrix is the one gradsum's codec draws with
  ``first_q=shape`` (common random numbers for comparing the two).

:class:`DDPSync` gives the training loop what ``GradientSync`` gives it (``wait``, ``step``,
``uncompressed``, ``close``), so both run through the same loop, launcher, guard and links.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .config import DDP_HOOK_NAMES


def powersgd_matrix(shape: torch.Size) -> tuple[int, int] | None:
    """The matrix torch's PowerSGD hook factors a tensor of ``shape`` into (its first dimension
    by the rest), or None for a vector, which it all-reduces uncompressed."""
    if len(shape) < 2:
        return None
    rows = shape[0]
    return rows, int(torch.Size(shape).numel() // rows)


def wire_bytes_per_step(config, model: torch.nn.Module) -> int:
    """Bytes one worker contributes to one step's exchange with a DDP hook, in steady state
    (PowerSGD past its uncompressed start): fp32 4 per coordinate, fp16/bf16 2, PowerSGD
    4·r·(rows + columns) per matrix it compresses and 4 per coordinate of the rest."""
    total = 0
    for parameter in model.parameters():
        count = parameter.numel()
        if config.ddp_hook in ("fp16", "bf16"):
            total += 2 * count
        elif config.ddp_hook == "powersgd":
            matrix = powersgd_matrix(parameter.shape)
            rank = config.powersgd_rank
            # the hook's own test (min_compression_rate 2): compress where it saves half
            if matrix and matrix[0] * matrix[1] > 2 * rank * (matrix[0] + matrix[1]):
                total += 4 * rank * (matrix[0] + matrix[1])
            else:
                total += 4 * count
        else:
            total += 4 * count
    return total


def in_order(hook):
    """A DDP comm hook that starts each bucket's ``hook`` only once the previous bucket's
    future has completed.

    Torch's ``powerSGD_hook`` issues its second and third all-reduces (P, then Q) from future
    callbacks, which Gloo runs on its own threads, while DDP's autograd thread calls the hook
    for the next bucket, which issues that bucket's first all-reduce. Gloo numbers collectives
    in the order threads issue them, so two workers could number them differently and one would
    receive the other's tensor: on the 100 Mbit/s testbed a worker aborted inside backward with
    ``gloo::EnforceNotMet ... Received data size doesn't match expected size`` in most runs.
    Chaining the buckets gives every worker the same order; nothing blocks, so the autograd
    thread still computes the next bucket's gradient while this one's is on the wire.
    (A function, not a callable object: DDP reads the hook's ``__name__`` and annotations.)
    """
    last: list[torch.futures.Future] = []  # the previous bucket's result, once there is one

    def hook_in_order(state, bucket):
        result: torch.futures.Future = torch.futures.Future()

        def start(previous: torch.futures.Future | None) -> None:
            try:
                if previous is not None:
                    previous.value()  # the previous bucket's error fails this one too
                hook(state, bucket).add_done_callback(lambda done: _settle(result, done))
            except Exception as error:
                result.set_exception(error)

        previous = last.pop() if last else None
        last.append(result)
        if previous is None:
            start(None)
        else:
            previous.add_done_callback(start)  # at once when it has completed already
        return result

    hook_in_order.__name__ = f"{hook.__name__}_in_order"
    return hook_in_order


def with_shape_seeded_q(hook, seed: int):
    """``hook`` (torch's ``powerSGD_hook``) with each matrix's first Q drawn as gradsum's
    PowerSGD draws it with ``first_q=shape`` (``codecs.lowrank.shape_seeded_q``) instead of from
    the hook's own random stream: on a bucket's first compressed step the Qs go into the hook's
    warm-start memory, in the hook's order (its matrices grouped by shape), and the hook
    orthogonalizes them as it does its own draw."""
    from ..codecs.lowrank import shape_seeded_q

    def hook_with_shape_seeded_q(state, bucket):
        index = bucket.index()
        if state.iter >= state.start_powerSGD_iter and index not in state.q_memory_dict:
            by_shape: dict[tuple[int, int], list[int]] = {}
            for tensor in bucket.gradients():  # the hook's compression test and order
                n, m = tensor.shape[0], tensor.numel() // tensor.shape[0]
                r = min(n, m, state.matrix_approximation_rank)
                if (n + m) * r * state.min_compression_rate < n * m:
                    by_shape.setdefault((n, m), []).append(r)
            qs = [shape_seeded_q(seed, n, m, r).reshape(-1)
                  for (n, m), ranks in by_shape.items() for r in ranks]  # fmt: skip
            buffer = bucket.buffer()
            state.q_memory_dict[index] = torch.cat(qs).to(buffer) if qs else buffer.new_empty(0)
            p_size = sum(n * r for (n, _), ranks in by_shape.items() for r in ranks)
            state.p_memory_dict[index] = buffer.new_empty(p_size)
        return hook(state, bucket)

    hook_with_shape_seeded_q.__name__ = f"{hook.__name__}_shape_seeded_q"
    return hook_with_shape_seeded_q


def _settle(result: torch.futures.Future, done: torch.futures.Future) -> None:
    try:
        result.set_result(done.value())
    except Exception as error:
        result.set_exception(error)


class DDPSync:
    """DDP around ``model`` with the configured hook; ``net`` is the module to call forward on."""

    def __init__(self, model: torch.nn.Module, config) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        if config.ddp_hook not in DDP_HOOK_NAMES:
            raise ValueError(
                f"unknown --ddp-hook {config.ddp_hook!r}; choose one of {', '.join(DDP_HOOK_NAMES)}"
            )
        self.model = model
        self.net = DistributedDataParallel(model)
        self.step = 0
        self._manual = False
        # steps the hook itself sends uncompressed: torch's PowerSGD hook averages its first
        # start_powerSGD_iter steps in fp32 on its own, so the run's uncompressed steps are those
        # same steps, not as many again before the hook is first called
        self._hook_warmup = 0
        self.hook_state = None  # the PowerSGD hook's, where it runs
        if config.ddp_hook == "fp16":
            self.net.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif config.ddp_hook == "bf16":
            self.net.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif config.ddp_hook == "powersgd":
            if config.powersgd_start < 2:
                raise ValueError(
                    f"--powersgd-start {config.powersgd_start}: torch's PowerSGD hook needs at "
                    "least 2 uncompressed steps with error feedback or warm start"
                )
            self._hook_warmup = max(config.powersgd_start, config.uncompressed_steps)
            state = powersgd.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=config.powersgd_rank,
                start_powerSGD_iter=self._hook_warmup,
                use_error_feedback=True,
                warm_start=True,
                random_seed=config.seed,
            )
            self.hook_state = state
            hook = powersgd.powerSGD_hook
            if config.powersgd_first_q == "shape":
                hook = with_shape_seeded_q(hook, config.seed)
            self.net.register_comm_hook(state, in_order(hook))

    def wait(self) -> None:
        """DDP's backward has averaged the gradients already; a retried step averages them
        here, uncompressed."""
        if self._manual:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat /= dist.get_world_size()
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        self.step += 1

    @contextlib.contextmanager
    def uncompressed(self) -> Iterator[None]:
        """Steps inside skip the hook (DDP's ``no_sync``) and are averaged in fp32 by ``wait``;
        during the PowerSGD hook's own uncompressed start the hook averages them in fp32."""
        if self.step < self._hook_warmup:
            yield
            return
        self._manual = True
        try:
            with self.net.no_sync():
                yield
        finally:
            self._manual = False

    def close(self) -> None:
        pass
