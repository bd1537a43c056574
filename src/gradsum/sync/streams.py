"""Communication streams: how gradient rounds run beside backward on a GPU, as PyTorch expects.

A round runs on the FIFO communication thread (``comm.py``) while backward continues. On a GPU
that thread must not read a gradient before backward's kernels have written it, must not make
backward's stream wait for communication, and must hand back a future that the caller's stream
can wait on. So, per device:

* one communication stream (``CommStream.of(device)``), on which every round's kernels and
  collectives run, so NCCL calls never sit on the stream backward computes on;
* an event recorded on the producer's current stream when a gradient is handed over
  (``handoff``), which the communication stream waits on before it touches the gradient;
* ``record_stream`` on every tensor that crosses from the producer's stream to the
  communication stream, so the caching allocator never hands its memory to backward while the
  round still reads it;
* a ``torch.futures.Future(devices=[device])`` completed while the communication stream is
  current: waiting on it (``wait``/``value``/``then``) makes the waiter's stream wait for the
  round's kernels, instead of the silent race a plain CPU future leaves for CUDA values;
* ``torch.cuda.set_device`` in the thread, so tensors it allocates land on the right GPU.

On the CPU all of this is nothing: no stream, no event, a plain future.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass
class Handoff:
    """What the communication thread needs to use tensors produced on another stream."""

    stream: CommStream
    event: object | None  # a torch.cuda.Event on the producer's stream, or None on the CPU
    tensors: tuple[torch.Tensor, ...]


_STREAMS: dict[torch.device, CommStream] = {}
_LOCK = threading.Lock()


class CommStream:
    """One device's communication stream (none on the CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None

    @classmethod
    def of(cls, device: torch.device | str) -> CommStream:
        """The communication stream of ``device``, shared by every hook of the process."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        with _LOCK:
            stream = _STREAMS.get(device)
            if stream is None:
                stream = _STREAMS[device] = cls(device)
        return stream

    def handoff(self, tensors: Sequence[torch.Tensor]) -> Handoff:
        """Called where ``tensors`` were produced (backward's thread and stream): an event after
        their writes, for the communication stream to wait on."""
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        return Handoff(self, event, tuple(tensors))

    def future(self) -> torch.futures.Future:
        """A future for a round's result: CUDA-aware on a GPU (see the module docstring)."""
        if self.cuda:
            return torch.futures.Future(devices=[self.device])
        return torch.futures.Future()

    @contextlib.contextmanager
    def running(self, handoff: Handoff | None) -> Iterator[None]:
        """On the communication thread: the device set, the stream current and waiting for the
        handoff's event, its tensors recorded as used by the stream."""
        if not self.cuda:
            yield
            return
        torch.cuda.set_device(self.device)
        with torch.cuda.stream(self.stream):
            if handoff is not None:
                if handoff.event is not None:
                    self.stream.wait_event(handoff.event)
                for tensor in handoff.tensors:
                    tensor.record_stream(self.stream)
            yield
