"""Plain-tensor state shared by every layer: what clients and the server keep and send.

State is plain tensors so that it can be checkpointed as safetensors:
- ``ClientState``: named slots of tensors kept for one client between rounds (e.g. "personal");
- ``ServerState``: named slots kept by the server (e.g. "global");
- an upload: named slots a client sends to the server in one round (e.g. "shared").
"""

from __future__ import annotations

from typing import Any

import torch

TensorDict = dict[str, torch.Tensor]
ClientState = dict[str, TensorDict]
ServerState = dict[str, TensorDict]
Batch = dict[str, torch.Tensor]
"""Named columns of one minibatch (``pixel_values``, ``input_ids``, ``attention_mask``, ``labels``, ...)."""
Loss = torch.Tensor | float
"""A training loss: a 0-d tensor on the training device (or a float). ``float(loss)`` reads it, waiting for the
device to finish the steps behind it; an actor reads a round's losses together after its last client, so that
the host never waits for the GPU between two clients."""


def tensor_params(tree: Any) -> int:
    """The number of parameters (elements) in a tensor or a nested dict of tensors."""
    if isinstance(tree, torch.Tensor):
        return tree.numel()
    if isinstance(tree, dict):
        return sum(tensor_params(value) for value in tree.values())
    return 0


def tensor_bytes(tree: Any) -> int:
    """The bytes of a tensor or a nested dict of tensors."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(value) for value in tree.values())
    return 0


def tensors_to(tensors: TensorDict, device: torch.device | str) -> TensorDict:
    """``tensors`` on ``device``. From a GPU to the host, the tensors of each dtype go in one copy into pinned
    memory, several times faster than a synchronous copy per tensor into pageable memory
    (``benchmarks/state_copies.py``); the results are views of that copy."""
    if torch.device(device).type != "cpu" or not any(value.is_cuda for value in tensors.values()):
        return {name: value.to(device) for name, value in tensors.items()}
    on_host = {name: value for name, value in tensors.items() if not value.is_cuda}
    groups: dict[tuple[torch.device, torch.dtype], list[str]] = {}
    for name, value in tensors.items():
        if value.is_cuda:
            groups.setdefault((value.device, value.dtype), []).append(name)
    for (gpu, dtype), names in groups.items():
        flat = torch.cat([tensors[name].detach().reshape(-1) for name in names])
        pinned = torch.empty(flat.numel(), dtype=dtype, pin_memory=True)
        pinned.copy_(flat, non_blocking=True)
        torch.cuda.current_stream(gpu).synchronize()
        for name, part in zip(names, pinned.split([tensors[name].numel() for name in names])):
            on_host[name] = part.view(tensors[name].shape)
    return {name: on_host[name] for name in tensors}
