"""Host tensors between Ray processes as raw bytes.

By default Ray pickles a torch tensor the way torch does, through ``torch.save`` of its storage,
which costs a fixed amount per tensor and copies the data several times. Payloads and uploads hold
about fifty tensors each, every round; sent as raw bytes (a uint8 NumPy view, which Ray passes as
an out-of-band buffer) the same values go through the object store in a fraction of the time. The
receiver gets a copy of its own, writable, with the dtype and shape the sender had; the tensors of a
:class:`~rayfed.types.ReadOnlyTensors` arrive as views of the object store's read-only copy instead.
"""

from __future__ import annotations

import warnings
from typing import Any

import ray
import torch

from rayfed.types import ReadOnlyTensors


def use_raw_tensor_transport() -> None:
    """Send this process's plain host tensors through Ray as raw bytes (a no-op outside Ray)."""
    if ray.is_initialized():
        ray.util.register_serializer(torch.Tensor, serializer=_to_bytes, deserializer=_from_bytes)
        ray.util.register_serializer(ReadOnlyTensors, serializer=_pack_read_only, deserializer=_unpack_read_only)


def in_ray_actor() -> bool:
    """Whether this process runs a Ray actor (not the driver script, nor an actor of the local executor)."""
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def _to_bytes(tensor: torch.Tensor) -> tuple[Any, ...]:
    if (tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.requires_grad
            or tensor.is_quantized or tensor.is_conj() or tensor.is_neg()):
        return ("torch", tensor.__reduce_ex__(2))  # what Ray would do without this serializer
    flat = tensor.detach().contiguous().reshape(-1)
    return ("raw", flat.view(torch.uint8).numpy(), tensor.dtype, tuple(tensor.shape))


def _from_bytes(packed: tuple[Any, ...], copy: bool = True) -> torch.Tensor:
    if packed[0] == "torch":
        rebuild, args = packed[1]
        return rebuild(*args)
    _, data, dtype, shape = packed
    if not copy:
        with warnings.catch_warnings():  # torch warns that the array is read-only: the receiver only reads it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(data).view(dtype).view(shape)
    tensor = torch.empty(shape, dtype=dtype)
    tensor.reshape(-1).view(torch.uint8).numpy()[:] = data  # a copy: Ray's buffer is read-only shared memory
    return tensor


class _TensorAt(int):
    """In a packed ReadOnlyTensors, the place of a tensor: its index in the list of distinct tensors."""


def _pack_read_only(tensors: ReadOnlyTensors) -> tuple[dict, list[tuple[Any, ...]]]:
    """The dicts with each tensor replaced by its index, and each distinct tensor's bytes once (a round's clients
    often receive the same tensors)."""
    packed: list[tuple[Any, ...]] = []
    index: dict[int, _TensorAt] = {}

    def pack(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: pack(item) for key, item in value.items()}
        if isinstance(value, torch.Tensor):
            if id(value) not in index:
                index[id(value)] = _TensorAt(len(packed))
                packed.append(_to_bytes(value))
            return index[id(value)]
        return value

    return pack(tensors), packed


def _unpack_read_only(packed: tuple[dict, list[tuple[Any, ...]]]) -> ReadOnlyTensors:
    structure, arrays = packed
    tensors = [_from_bytes(array, copy=False) for array in arrays]

    def unpack(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: unpack(item) for key, item in value.items()}
        return tensors[value] if isinstance(value, _TensorAt) else value

    return ReadOnlyTensors(unpack(structure))
