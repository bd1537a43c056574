"""Where a round's tensors leave the gradient's device for the UDP transport, and come back.

The worker's transport reads and writes host memory (the native pump, sockets), while the
round runs where the gradient is. Only packed payloads cross: the encoded lanes go down to the
host as the codec wrote them (4 bits a coordinate for THC), the summed lanes go back up and are
decoded on the device. On a GPU the host side is page-locked (pinned) memory, reused round
after round, and the copies are non-blocking on the current stream; the transport may read an
upstream buffer only after ``ready()`` and a round may reuse a downstream buffer only after the
previous round's uploads are done, which ``ready()`` also waits for (one event each).
On the CPU every method is the identity, so the CPU path is what it was.
"""

from __future__ import annotations

import torch


def pinned_empty(nbytes: int) -> torch.Tensor:
    """A host byte buffer; page-locked where a GPU will copy to and from it."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


class DeviceBoundary:
    """The copies between one device and the transport's host buffers."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.crosses = self.device.type != "cpu"
        self._event = None  # the last copy queued on a CUDA stream

    def to_host(self, tensor: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """``tensor`` (flat) in host memory; with ``into`` (uint8, exactly its bytes), its bytes
        written there. Valid for the transport after ``ready()``."""
        data = tensor.detach().reshape(-1).contiguous()
        if into is not None:
            into.copy_(data.view(torch.uint8), non_blocking=self.crosses)
            host = into
        elif not self.crosses:
            return data
        else:
            host = pinned_empty(data.numel() * data.element_size()).view(data.dtype)
            host.copy_(data, non_blocking=True)
        self._record()
        return host

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device (a non-blocking copy out of pinned memory)."""
        if not self.crosses:
            return host
        moved = host.to(self.device, non_blocking=True)
        self._record()
        return moved

    def payload_to_host(self, payload):
        """A payload with every field and meta value in host memory (a server decodes it
        there; a meta value computed on the device, such as TernGrad's scale, comes down as a
        one-element tensor)."""
        if not self.crosses:
            return payload
        from dataclasses import replace

        fields = {name: self.to_host(t) for name, t in payload.fields.items()}
        meta = {name: self.to_host(v) if isinstance(v, torch.Tensor) else v
                for name, v in payload.meta.items()}  # fmt: skip
        self.ready()
        return replace(payload, fields=fields, meta=meta)

    def payload_to_device(self, payload):
        if not self.crosses:
            return payload
        from dataclasses import replace

        return replace(payload, fields={n: self.to_device(t) for n, t in payload.fields.items()})

    def ready(self) -> None:
        """Wait until every copy queued so far is done (the host may then read or reuse the
        buffers): the one host sync at the boundary, where the host needs the bytes."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def _record(self) -> None:
        if self.crosses and self.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(self.device))
