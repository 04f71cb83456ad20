"""Host tensors between Ray processes as raw bytes.

By default Ray pickles a torch tensor the way torch does, through ``torch.save`` of its storage,
which costs a fixed amount per tensor and copies the data several times. Payloads and uploads hold
about fifty tensors each, every round; sent as raw bytes (a uint8 NumPy view, which Ray passes as
an out-of-band buffer) the same values go through the object store in a fraction of the time. The
receiver gets a copy of its own, writable, with the dtype and shape the sender had.
"""

from __future__ import annotations

from typing import Any

import ray
import torch


def use_raw_tensor_transport() -> None:
    """Send this process's plain host tensors through Ray as raw bytes (a no-op outside Ray)."""
    if ray.is_initialized():
        ray.util.register_serializer(torch.Tensor, serializer=_to_bytes, deserializer=_from_bytes)


def _to_bytes(tensor: torch.Tensor) -> tuple[Any, ...]:
    if (tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.requires_grad
            or tensor.is_quantized or tensor.is_conj() or tensor.is_neg()):
        return ("torch", tensor.__reduce_ex__(2))  # what Ray would do without this serializer
    flat = tensor.detach().contiguous().reshape(-1)
    return ("raw", flat.view(torch.uint8).numpy(), tensor.dtype, tuple(tensor.shape))


def _from_bytes(packed: tuple[Any, ...]) -> torch.Tensor:
    if packed[0] == "torch":
        rebuild, args = packed[1]
        return rebuild(*args)
    _, data, dtype, shape = packed
    tensor = torch.empty(shape, dtype=dtype)
    tensor.reshape(-1).view(torch.uint8).numpy()[:] = data  # a copy: Ray's buffer is read-only shared memory
    return tensor
