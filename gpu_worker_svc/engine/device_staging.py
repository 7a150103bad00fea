"""A step's small tensors between host and GPU in one copy each way, without waiting for the GPU.

A copy from pageable host memory may wait for everything queued on the stream before it, and
each copy is a call of its own: a decode step's inputs took about ten of them. The host builds
the step's inputs as CPU tensors, packs their bytes into a pinned buffer, and one asynchronous
copy moves them all; on the device each tensor is a view of the copy. The sampled tokens come
back the same way, into pinned memory, waited for by an event: the wait then covers only the
work queued before them, not a step launched after them (lookahead.py launches one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_ALIGN = 16  # every tensor starts at a multiple of the largest element size


@dataclass(slots=True)
class _Slot:
    buffer: torch.Tensor  # pinned uint8
    done: torch.cuda.Event | None  # recorded after the last copy out of the buffer


class DeviceStaging:
    """Moves tensors to a CUDA device and back through pinned buffers, used in turn.

    Two buffers each way: the one being filled is never the one a queued copy still reads.
    """

    def __init__(self, device: torch.device | str, slots: int = 2) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"  # elsewhere (tests) plain memory and no events
        self._up = [_Slot(torch.empty(0, dtype=torch.uint8), None) for _ in range(slots)]
        self._down = [_Slot(torch.empty(0, dtype=torch.uint8), None) for _ in range(slots)]
        self._turn_up = self._turn_down = 0

    @torch.inference_mode()  # its buffers are then always inference tensors, whoever calls
    def to_device(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Device copies of CPU tensors, in one host-to-device copy."""
        flat = [t.contiguous().view(-1).view(torch.uint8) for t in tensors]
        offsets, total = [], 0
        for f in flat:
            offsets.append(total)
            total += -(-f.numel() // _ALIGN) * _ALIGN
        slot = self._next(self._up, "_turn_up", total)
        for f, off in zip(flat, offsets):
            slot.buffer[off : off + f.numel()].copy_(f)
        packed = torch.empty(total, dtype=torch.uint8, device=self.device)
        packed.copy_(slot.buffer[:total], non_blocking=True)
        slot.done = self._record()
        return [packed[off : off + f.numel()].view(t.dtype).view(t.shape) for t, f, off in zip(tensors, flat, offsets)]

    @torch.inference_mode()
    def start_fetch(self, tokens: torch.Tensor) -> TokenFetch:
        """Starts copying a [n] long device tensor to the host; TokenFetch.wait() gives its values."""
        slot = self._next(self._down, "_turn_down", tokens.numel() * tokens.element_size())
        host = slot.buffer[: tokens.numel() * tokens.element_size()].view(tokens.dtype)
        host.copy_(tokens, non_blocking=True)
        slot.done = self._record()
        return TokenFetch(host, slot.done)

    def _next(self, slots: list[_Slot], turn: str, nbytes: int) -> _Slot:
        i = getattr(self, turn)
        setattr(self, turn, (i + 1) % len(slots))
        slot = slots[i]
        if slot.done is not None:
            slot.done.synchronize()  # a copy queued two uses ago; long done in a steady step loop
        if slot.buffer.numel() < nbytes:
            size = max(nbytes, 2 * slot.buffer.numel(), 4096)
            slot.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self._cuda)
        return slot

    def _record(self) -> torch.cuda.Event | None:
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event


@dataclass(slots=True)
class TokenFetch:
    """Token ids on their way to the host."""

    host: torch.Tensor  # pinned, filled once `done` has passed
    done: torch.cuda.Event | None

    def wait(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()

    @classmethod
    def ready(cls, tokens: torch.Tensor) -> TokenFetch:
        """A CPU tensor's values, already there."""
        return cls(tokens, None)
