"""FedYolo ("You Only Load Once"): one frozen backbone, per-task modules and heads, optionally shared modules.

*Augmenting Federated Learning with Pretrained Transformers* (arXiv 2307.04905), Sec. 4 and Algorithm 1;
docs/fedyolo.md#fedyolo-and-multi-task-runs.

One frozen pretrained backbone, loaded once per client; every task has its own modules and head,
and the modules of some blocks may be shared by all tasks:
- ``sharing = none`` (vanilla): every block's module is dedicated (one copy per task);
- ``half``: blocks 0 .. L/2 - 1 share one module, blocks L/2 .. L - 1 are dedicated;
- ``all``: every module is shared; only the heads are per task.

A client trains, uploads and receives only its task's view (the engine filters by the
``task_<index>`` name component), so FedAvg's rule gives the paper's aggregation: a task's modules
are averaged over that task's sampled clients (kept unchanged when none was sampled) and shared
modules over every sampled client.

``private_uploads`` is the paper's privacy variant: every client uploads every task's dedicated
slots, zeros but its own, and a vector of K per-task sample counts (its own n_m, zeros elsewhere), so
that under secure aggregation the server learns the sums but not which task a client belongs to;
task k's slots become sum(u_k) / sum(c_k). The resulting parameters are those of the default; only
the upload grows (all tasks' slots + K counts per client).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from rayfed.config import ModelConfig
from rayfed.method import (ClientState, EachUpload, LocalResult, Method, ServerState, TensorDict, Upload, WeightedMean,
                           mean_as, weighted_sums)
from rayfed.params import hyperparameters
from rayfed.registry import register_method
from rayfed.models import Backbone, build_task_model, num_blocks
from rayfed.models.peft.modules import dedicated_blocks
from rayfed.param_names import task_of_name
from rayfed.tasks import Task
from rayfed.training import ClientContext
from rayfed.types import Slot

Sharing = Literal["none", "half", "all"]


@hyperparameters
class FedYoloParams:
    sharing: Sharing = "none"
    private_uploads: bool = False  # the privacy variant: every task's slots (zeros but one's own) + task counts


@register_method("fedyolo")
class FedYolo(Method):
    Params = FedYoloParams

    def build_model(self, backbone: Backbone, config: ModelConfig, tasks: Sequence[Task], seed: int) -> nn.Module:
        return build_task_model(backbone, config, tasks, seed,
                                dedicated_blocks(self.params.sharing, num_blocks(backbone)))

    def local_update(self, client: ClientContext, state: ClientState, payload: TensorDict | None) -> LocalResult:
        result = super().local_update(client, state, payload)
        if not self.params.private_uploads:
            return result
        sent = dict(result.upload.get(Slot.SHARED, {}))
        for name, value in client.model.trainable_params().items():
            if task_of_name(name) not in (None, client.task):
                sent[name] = torch.zeros_like(value)
        counts = torch.zeros(len(client.model.head), dtype=torch.float64)
        counts[client.task] = client.num_samples
        return LocalResult(result.state, {Slot.SHARED: sent, "task_counts": {"counts": counts}}, result.train_loss)

    @property
    def aggregation(self) -> WeightedMean | EachUpload:
        # The default keeps FedAvg's weighted mean, which actors may pre-sum; the privacy variant's
        # counts need every upload.
        return EachUpload() if self.params.private_uploads else WeightedMean()

    def aggregate(self, server: ServerState, uploads: list[Upload]) -> ServerState:
        if not self.params.private_uploads:
            return super().aggregate(server, uploads)
        sums, totals = weighted_sums(uploads, Slot.SHARED)
        # sum(c_k): the weight of task k's own clients only (the zeros others sent carry none).
        task_totals = sum(u.tensors["task_counts"]["counts"] * u.weight_scale for u in uploads)
        merged = dict(server[Slot.GLOBAL])
        for name, total in sums.items():
            task = task_of_name(name)
            weight = totals[name] if task is None else float(task_totals[task])
            if weight > 0:  # a task without sampled clients keeps its slots
                merged[name] = mean_as(total, weight, server[Slot.GLOBAL][name].dtype)
        return {**server, Slot.GLOBAL: merged}
