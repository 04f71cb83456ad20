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
