"""FedYolo ("You Only Load Once"): one frozen backbone, per-task modules and heads, optionally shared modules.

Seed ``003_040d52d311c5f3b8.txt`` (§4, Algorithm 1), spec ``fedyolo.md`` §3.

One frozen pretrained backbone, loaded once per client; every task has its own modules and head,
and the modules of some blocks may be shared by all tasks:
- ``sharing = none`` (vanilla): every block's module is dedicated (one copy per task);
- ``half``: blocks 0 .. L/2 - 1 share one module, blocks L/2 .. L - 1 are dedicated;
- ``all``: every module is shared; only the heads are per task.

A client trains, uploads and receives only its task's view (the engine filters by the
``task_<index>`` name component), so FedAvg's rule gives the paper's aggregation: a task's modules
are averaged over that task's sampled clients (kept unchanged when none was sampled) and shared
modules over every sampled client.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from rayfed.config import ModelConfig
from rayfed.method import Method
from rayfed.models import Backbone, build_task_model, num_blocks
from rayfed.modules import dedicated_blocks
from rayfed.tasks import Task

SHARING = ("none", "half", "all")


@dataclass(frozen=True)
class FedYoloParams:
    sharing: str = "none"

    def __post_init__(self) -> None:
        if self.sharing not in SHARING:
            raise ValueError(f"sharing must be one of {', '.join(SHARING)}")


class FedYolo(Method):
    Params = FedYoloParams

    def build_model(self, backbone: Backbone, config: ModelConfig, tasks: Sequence[Task], seed: int) -> nn.Module:
        return build_task_model(backbone, config, tasks, seed, dedicated_blocks(self.params.sharing, num_blocks(backbone)))
