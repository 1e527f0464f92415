"""Host tensors to the device without a wait: on CUDA a copy from pageable memory first waits
for the work already queued on the device, so a step's many small host-built tensors go through
pinned memory, packed into one buffer and copied once, without blocking. A step's results come
back through pinned memory with one wait. On a CPU nothing moves.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")


def device_tensor(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.tensor(data, dtype) on `device`, from pinned memory without blocking on CUDA."""
    host = torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def to_host(tensors: list[torch.Tensor]) -> list[list]:
    """The step's results as host lists, waiting for the device once: on CUDA each tensor is
    copied into pinned memory without blocking and the stream synchronised a single time (one
    `.tolist()` each would wait once per tensor)."""
    if not tensors or tensors[0].device.type != "cuda":
        return [t.tolist() for t in tensors]
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for h, t in zip(host, tensors):
        h.copy_(t, non_blocking=True)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return [h.tolist() for h in host]


def to_device(host: T, device: torch.device, pin: bool | None = None) -> T:
    """A dataclass of host tensors (nested dataclasses and tuples of them included) with every
    tensor moved to `device` through one packed buffer (pinned for CUDA), in one copy."""
    found: list[torch.Tensor] = []

    def collect(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    map_tensors(host, collect)
    buffer, fields = pack(found, pin=device.type == "cuda" if pin is None else pin)
    # torch's pinned-memory cache keeps `buffer` from reuse until the copy has run
    moved = iter(unpack(buffer.to(device, non_blocking=True), fields))
    return map_tensors(host, lambda t: next(moved))


def map_tensors(obj: T, fn: Callable[[torch.Tensor], torch.Tensor]) -> T:
    """obj with fn applied to every tensor in it, in field order (dataclasses, tuples)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(map_tensors(x, fn) for x in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: map_tensors(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


@dataclass(frozen=True)
class PackedField:
    """Where one tensor lies in a packed buffer."""
    offset: int                    # bytes from the buffer's start (a multiple of PACK_ALIGN)
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


PACK_ALIGN = 16        # every field starts aligned for any dtype's view (and for vector loads)


def pack(tensors: list[torch.Tensor], pin: bool) -> tuple[torch.Tensor, list[PackedField]]:
    """Tensors of any dtypes -> one uint8 buffer holding them all, and where each lies."""
    fields, offset = [], 0
    for t in tensors:
        fields.append(PackedField(offset, t.dtype, tuple(t.shape)))
        offset += -(-fields[-1].nbytes // PACK_ALIGN) * PACK_ALIGN
    buffer = torch.empty(offset, dtype=torch.uint8, pin_memory=pin)
    for t, f in zip(tensors, fields):
        _view(buffer, f).copy_(t)
    return buffer, fields


def unpack(buffer: torch.Tensor, fields: list[PackedField]) -> list[torch.Tensor]:
    """The tensors `pack` put into buffer, as views of it (wherever it now lives)."""
    return [_view(buffer, f) for f in fields]


def _view(buffer: torch.Tensor, f: PackedField) -> torch.Tensor:
    return buffer[f.offset:f.offset + f.nbytes].view(f.dtype).view(f.shape)
