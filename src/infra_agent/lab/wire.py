"""What crosses between the kernel lab and its worker processes, and how it is read.

The candidate's worker runs model-written code, so anything it sends may be crafted.
A pickle runs code when it is loaded, so a reply from that worker is never unpickled
in the judge's process: it is read with torch's restricted loader (tensors, dtypes,
numbers, strings and plain containers only, ``weights_only=True``).  Jobs going *to* a
worker are the lab's own and may carry any picklable data (tolerances, shapes).

Tensors travel as CPU copies in the message bytes: the receiver never shares memory
with the sender (no CUDA IPC handle, no shared storage), so a candidate can neither
read the reference's buffers nor change the inputs the reference was computed on.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Mapping
from typing import Any

import torch

# The one-byte answers of the timing loop, kept out of torch.save's zip framing so a
# round trip costs tens of microseconds, not hundreds (see ``judge_clock``).
RAN = b"R"
END = b"E"


class Garbled(Exception):
    """A worker's reply the lab cannot read; the message says why."""


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor (in dicts, lists and tuples) copied to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, Mapping):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


def to_device(value: Any, device: str) -> Any:
    """``value`` with every tensor moved to ``device`` (a copy on another device)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, Mapping):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value


def pack(message: Any) -> bytes:
    """A worker's reply: torch's format, readable without unpickling code."""
    buf = io.BytesIO()
    torch.save(message, buf)
    return buf.getvalue()


def unpack_reply(data: bytes, *, trusted: bool) -> tuple[Any, ...]:
    """A reply as a tuple whose first item names its kind.

    ``trusted`` is for the pristine worker only (it loads no candidate file): its inputs
    may hold any object the spec's input factory returns.  Anything else is read with
    the restricted loader, and a reply that is not a ``(kind, ...)`` tuple is ``Garbled``.
    """
    try:
        with warnings.catch_warnings():
            # torch warns about a pickle protocol it did not write: a candidate's garbage, refused below.
            warnings.simplefilter("ignore")
            message = torch.load(io.BytesIO(data), weights_only=not trusted, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - whatever the bytes were, they are not a reply
        raise Garbled(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}") from None
    if not (isinstance(message, tuple) and message and isinstance(message[0], str)):
        raise Garbled(f"expected a (kind, ...) tuple, got {type(message).__name__}")
    return message


def pack_job(job: Any) -> bytes:
    # The lab's own data, read by its own worker code.
    return pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)


def unpack_job(data: bytes) -> Any:
    return pickle.loads(data)  # noqa: S301 - sent by the lab process that started this worker


def tensors_by_name(value: Any) -> dict[str, torch.Tensor]:
    """A candidate's outputs as received: a non-empty ``{name: tensor}``, else ``Garbled``."""
    if isinstance(value, dict) and value and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items()):
        return value
    raise Garbled(f"expected named tensors, got {type(value).__name__}")
