"""What torch's powerSGD_hook reads of DDP, faked for tests that run it on threads: a gradient
bucket over a flat buffer, and a process group whose all_reduce sums over the threads."""

import threading
from types import SimpleNamespace

import torch


class Bucket:
    """A dist.GradBucket over ``buffer``: its gradients are views of the given shapes."""

    def __init__(self, buffer: torch.Tensor, shapes):
        self._buffer, self._views, offset = buffer, [], 0
        for shape in shapes:
            count = torch.Size(shape).numel()
            self._views.append(buffer[offset : offset + count].view(shape))
            offset += count

    def buffer(self):
        return self._buffer

    def index(self):
        return 0

    def gradients(self):
        return self._views

    def is_last(self):
        return True


class ThreadGroup:
    """``workers`` threads as one process group: all_reduce sums in place, in worker order
    (each thread sets ``local.rank`` first)."""

    def __init__(self, workers: int):
        self.workers = workers
        self.barrier = threading.Barrier(workers)
        self.slots: list[torch.Tensor | None] = [None] * workers
        self.local = threading.local()

    def size(self):
        return self.workers

    def all_reduce(self, tensor, group=None, async_op=False):
        self.slots[self.local.rank] = tensor
        self.barrier.wait()
        total = sum(self.slots[1:], self.slots[0].clone())
        self.barrier.wait()
        tensor.copy_(total)
        future = torch.futures.Future()
        future.set_result([tensor])
        return SimpleNamespace(get_future=lambda: future)
