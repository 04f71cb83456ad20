"""Trainable modules over a frozen transformer backbone, and per-task module sets.

The modules of the scale & modularity study (seed ``003_040d52d311c5f3b8.txt``, spec
``fedyolo.md`` §1), each on every transformer block:

- ``adapter``: one bottleneck ``d -> dim -> d`` (both linears with bias: ``2 * dim * d + dim + d``
  parameters per block) after the block's MLP, inside its residual:
  ``h = x + A(MLP(LN2(x)))`` with ``A(z) = z + W_up GELU(W_down z)``; ``W_up``, ``b_up`` start at
  zero, so the model at step 0 is the pretrained one;
- ``vpt``: VPT-deep, ``prompts`` learnable tokens inserted after the CLS token at the input of
  every block (the previous block's prompt outputs are replaced), ``prompts * d`` per block,
  initialised uniform(-v, v) with v = sqrt(6 / (3 * 16 * 16 + d)) as in the VPT paper;
- ``lora`` (peft, :mod:`rayfed.models`), ``head`` (the linear head alone) and ``full``.

Multi-task models (FedYolo, spec §3): a module of a block is either *shared* by every task or
*dedicated*: one copy per task, stored under a ``task_<index>`` key. Heads are always per task.
A parameter name with a ``task_<index>`` component belongs to that task only (see
:func:`rayfed.tasks.task_view`); :func:`select_task` switches which copies the forward pass uses.
Every task's copies are initialised from a seed of their own, so a task's initial values do not
depend on which other tasks exist.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from rayfed.errors import ConfigError
from rayfed.tasks import Task, task_key

SHARED = "shared"


class Bottleneck(nn.Module):
    """``z + W_up GELU(W_down z)`` with a zero-initialised up-projection."""

    def __init__(self, width: int, dim: int):
        super().__init__()
        self.down = nn.Linear(width, dim)
        self.up = nn.Linear(dim, width)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z + self.up(nn.functional.gelu(self.down(z)))


class _TaskSelected(nn.Module):
    """A module whose ``copies`` are keyed ``shared`` or ``task_<index>``; forward uses the active task's."""

    active_task: int = 0

    def _key(self, copies: nn.ModuleDict | nn.ParameterDict) -> str:
        return SHARED if SHARED in copies else task_key(self.active_task)


class AdaptedMLP(_TaskSelected):
    """A transformer block's MLP followed by a bottleneck adapter."""

    def __init__(self, mlp: nn.Module, adapters: nn.ModuleDict):
        super().__init__()
        self.mlp = mlp
        self.adapters = adapters

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.adapters[self._key(self.adapters)](self.mlp(hidden))


class PromptedBlock(_TaskSelected):
    """A transformer block whose input carries the block's own prompt tokens right after the CLS token."""

    def __init__(self, block: nn.Module, prompts: nn.ParameterDict, replaces_prompts: bool):
        super().__init__()
        self.block = block
        self.prompts = prompts
        self.replaces_prompts = replaces_prompts  # False for the first block: it inserts them

    def forward(self, hidden: torch.Tensor, *args, **kwargs):
        prompt = self.prompts[self._key(self.prompts)]
        rest = hidden[:, 1 + len(prompt):] if self.replaces_prompts else hidden[:, 1:]
        prompt = prompt.to(hidden.dtype).unsqueeze(0).expand(hidden.shape[0], -1, -1)
        return self.block(torch.cat([hidden[:, :1], prompt, rest], dim=1), *args, **kwargs)


class TaskHeads(nn.ModuleDict):
    """One linear head per task (``task_<index>``); forward uses the active task's."""

    active_task: int = 0

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self[task_key(self.active_task)](features)


def select_task(model: nn.Module, task_index: int) -> None:
    """Make every per-task part of ``model`` use task ``task_index``'s copies (heads, modules, a text
    classifier's label space)."""
    if hasattr(model, "select_task"):
        model.select_task(task_index)
    for module in model.modules():
        if isinstance(module, (_TaskSelected, TaskHeads)):
            module.active_task = task_index


def transformer_blocks(encoder: nn.Module) -> nn.ModuleList:
    """The encoder's list of transformer blocks (HF ViT ``layers``, CLIP vision ``encoder.layers``)."""
    for name, module in encoder.named_modules():
        if name.endswith("layers") and isinstance(module, nn.ModuleList) and len(module) and hasattr(module[0], "mlp"):
            return module
    raise ConfigError(
        "model.module = 'adapter' / 'vpt' needs a transformer backbone with blocks (HF ViT or CLIP vision); "
        "this backbone has none."
    )


def copies_for_block(
    block_index: int, dedicated: Callable[[int], bool], tasks: Sequence[Task], seed_of: Callable[[str], int],
    make: Callable[[], nn.Module | nn.Parameter],
) -> list[tuple[str, nn.Module | nn.Parameter]]:
    """(key, module) pairs of one block: one shared copy, or one per task, each built under its own seed."""
    keys = [task_key(t.index) for t in tasks] if dedicated(block_index) else [SHARED]
    built = []
    for key in keys:
        torch.manual_seed(seed_of(f"{key}:block{block_index}"))
        built.append((key, make()))
    return built


def add_adapters(
    encoder: nn.Module, width: int, dim: int, tasks: Sequence[Task], dedicated: Callable[[int], bool],
    seed_of: Callable[[str], int],
) -> None:
    for index, block in enumerate(transformer_blocks(encoder)):
        copies = copies_for_block(index, dedicated, tasks, seed_of, lambda: Bottleneck(width, dim))
        block.mlp = AdaptedMLP(block.mlp, nn.ModuleDict(dict(copies)))


def add_prompts(
    encoder: nn.Module, width: int, prompts: int, patch_size: int, num_channels: int, tasks: Sequence[Task],
    dedicated: Callable[[int], bool], seed_of: Callable[[str], int],
) -> None:
    bound = math.sqrt(6.0 / (num_channels * patch_size * patch_size + width))

    def make() -> nn.Parameter:
        return nn.Parameter(torch.empty(prompts, width).uniform_(-bound, bound))

    blocks = transformer_blocks(encoder)
    for index in range(len(blocks)):
        copies = copies_for_block(index, dedicated, tasks, seed_of, make)
        blocks[index] = PromptedBlock(blocks[index], nn.ParameterDict(dict(copies)), replaces_prompts=index > 0)


def task_heads(width: int, tasks: Sequence[Task], seed_of: Callable[[str], int]) -> TaskHeads:
    heads = {}
    for task in tasks:
        torch.manual_seed(seed_of(f"{task_key(task.index)}:head"))
        heads[task_key(task.index)] = nn.Linear(width, task.num_classes)
    return TaskHeads(heads)


def dedicated_blocks(sharing: str, num_blocks: int) -> Callable[[int], bool]:
    """Which blocks get one module per task: ``none`` shared -> all, ``half`` -> the second half, ``all`` -> none."""
    if sharing == "none":
        return lambda index: True
    if sharing == "half":
        return lambda index: index >= num_blocks // 2
    return lambda index: False


@torch.no_grad()
@torch.no_grad()
def head_features(model: nn.Module, params: dict[str, torch.Tensor], images: torch.Tensor, batch_size: int) -> torch.Tensor:
    """The head's input features of ``images`` with ``params`` loaded (left loaded)."""
    model.eval()
    model.load_trainable(params)
    return torch.cat([model.features(images[start:start + batch_size]).float()
                      for start in range(0, len(images), batch_size)])


def feature_shift(before: torch.Tensor, after: torch.Tensor) -> float:
    """``1 - mean_x cos(before(x), after(x))`` (spec §4)."""
    return 1.0 - nn.functional.cosine_similarity(before, after, dim=1).mean().item()


def representation_shift(
    model: nn.Module, initial: dict[str, torch.Tensor], current: dict[str, torch.Tensor], images: torch.Tensor,
    batch_size: int,
) -> float:
    """The shift of the head's input features over ``images`` from ``initial`` to ``current`` parameters."""
    before = head_features(model, initial, images, batch_size)
    return feature_shift(before, head_features(model, current, images, batch_size))
