"""flowerbench: the workload of `rayfed bench`, as a Flower app's task module.

Everything that decides the amount of work comes from rayfed itself, so both frameworks run the
same model, data, partition, local steps and optimizer:

* the workload (`WORKLOADS`) and its `RunConfig` from rayfed.benchmarks.overhead;
* the data: rayfed's synthetic source and partition (`build_federation`), the client's train split
  (text tokenized by the backbone's tokenizer);
* the model: rayfed's backbone (`build_backbone`), with the same seeds, + LoRA + the task's head
  (`build_client_model`: a linear head for images, the LM's own head for text);
* the local update: `ClientContext.train` (seeded batches, Adam, bf16 autocast on CUDA; the GPU
  workload's CUDA graphs for the cached client, the plain eager loop for the documented one).

The workload is chosen by the environment variable FLOWERBENCH_WORKLOAD (a name of `rayfed bench
--workload`, or a JSON object of `Workload` fields), which the Ray workers running the ClientApps inherit.
"""

from __future__ import annotations

import dataclasses
import json
import os

import psutil
import torch
from rayfed.benchmarks.overhead import WORKLOADS, Workload

from rayfed.config import RunConfig
from rayfed.data.clients import Federation, build_federation
from rayfed.models import Backbone, ClientModel, build_backbone, build_client_model
from rayfed.seeding import SERVER, torch_seed
from rayfed.data.batches import ClientData
from rayfed.training import ClientContext, TrainResult

WORKLOAD_ENV = "FLOWERBENCH_WORKLOAD"


def workload_spec(workload: Workload) -> str:
    """The value of FLOWERBENCH_WORKLOAD that selects ``workload``."""
    return json.dumps(dataclasses.asdict(workload))


def get_workload() -> Workload:
    spec = os.environ.get(WORKLOAD_ENV, "cpu")
    if spec in WORKLOADS:
        return WORKLOADS[spec]
    fields = json.loads(spec)
    fields["lora_targets"] = tuple(fields.get("lora_targets", Workload.lora_targets))
    return Workload(**fields)


def get_config() -> RunConfig:
    """rayfed's config of the workload (placement fields unused here)."""
    return get_workload().config(clients_per_actor=1, gpus_per_actor=0)


fds: Federation | None = None  # cached per process, like the `fds` FederatedDataset of Flower's examples


def load_federation() -> Federation:
    global fds
    if fds is None:
        config = get_config()
        fds = build_federation(config.data, config.seed)
    return fds


def load_data(partition_id: int, backbone: Backbone) -> ClientData:
    """The client's own examples (its train and test split), encoded for ``backbone``, as tensors on the CPU."""
    return load_federation().client_data(partition_id, backbone)


def get_backbone() -> Backbone:
    """The frozen backbone, random parts seeded exactly as rayfed's ClientActor seeds them."""
    config = get_config()
    return build_backbone(config.model, torch_seed(config.seed, 0, SERVER, "backbone"))


def get_model(backbone: Backbone | None = None) -> ClientModel:
    """Backbone + LoRA + head with rayfed's initial values, less rayfed's deep copy of the backbone: here
    the backbone is built for this model alone, so copying it would only add work."""
    config = get_config()
    seed = torch_seed(config.seed, 0, SERVER, "client_model")
    return build_client_model(backbone or get_backbone(), config.model, load_federation().tasks[0], seed,
                              private_copy=False)


def get_device() -> torch.device:
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def train(model: ClientModel, data: ClientData, params: dict[str, torch.Tensor], partition_id: int,
          server_round: int, device: torch.device) -> TrainResult:
    """The workload's local update: `local_steps` Adam steps of `batch_size`, seeded like rayfed's."""
    config = get_config()
    client = ClientContext(partition_id, server_round - 1, config.seed, data, model, config.train, device,
                           tasks=load_federation().tasks)
    return client.train(params)


def test(model: ClientModel, data: ClientData, params: dict[str, torch.Tensor], partition_id: int,
         server_round: int, device: torch.device) -> dict[str, float]:
    config = get_config()
    client = ClientContext(partition_id, server_round - 1, config.seed, data, model, config.train, device,
                           tasks=load_federation().tasks)
    return client.evaluate(params)


def memory_metrics(device: torch.device) -> dict[str, int]:
    """This process's peak GPU memory (PyTorch's allocator, as rayfed's bench reads it) and its RSS now."""
    gpu_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {"gpu-peak-bytes": int(gpu_peak), "rss-bytes": int(psutil.Process().memory_info().rss)}
