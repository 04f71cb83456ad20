"""Where a ClientActor keeps its clients' data and states (the GPU or host memory), between rounds and while a round
trains."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import psutil
import torch

from rayfed.data.batches import ClientData, EvalSet
from rayfed.data.clients import Federation
from rayfed.method import ClientState, tensor_bytes
from rayfed.models import Backbone


def resident_device(device: torch.device, setting: str, nbytes: int) -> torch.device:
    """Where hosted clients' data or state (``nbytes`` in all) live between rounds: the GPU when
    ``placement.client_state`` (``setting``) says so, or (auto) when it takes under a quarter of the free GPU
    memory; else host memory. On the GPU no step waits for a host-to-device copy."""
    if device.type != "cuda" or setting == "host":
        return torch.device("cpu")
    return device if setting == "device" or fits_on_gpu(device, nbytes) else torch.device("cpu")


def round_device(device: torch.device, state_device: torch.device, states: Iterable[ClientState]) -> torch.device:
    """Where a round's clients' states (``states``), payloads and uploads stay while the round trains: the training
    device when they fit there, even where states are kept on the host between rounds.

    A copy to or from the host between two clients' updates would make the host wait for the GPU to finish
    one client, and the GPU then wait for the host to set up the next; this way each state crosses once each
    way a round, before the first update and after the last.
    """
    if state_device == device:
        return device
    round_bytes = 4 * sum(tensor_bytes(state) for state in states)  # old and new states, uploads
    return device if fits_on_gpu(device, round_bytes) else state_device


def fits_on_gpu(device: torch.device, nbytes: int) -> bool:
    """Whether ``nbytes`` take under a quarter of the GPU's free memory."""
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes < free / 4


def resident_data(federation: Federation, client_ids: Sequence[int], backbone: Backbone, device: torch.device,
                  setting: str) -> tuple[torch.device, dict[int, ClientData], list[EvalSet]]:
    """The hosted clients' data and the run's evaluation sets, encoded for ``backbone`` and put together on their
    :func:`resident_device`; that device first."""
    data = {cid: federation.client_data(cid, backbone) for cid in client_ids}
    eval_sets = federation.eval_sets(backbone)
    data_device = resident_device(device, setting, sum(client_data.nbytes for client_data in data.values())
                                  + tensor_bytes({i: e.columns for i, e in enumerate(eval_sets)}))
    return data_device, {cid: d.to(data_device) for cid, d in data.items()}, [e.to(data_device) for e in eval_sets]


def gpu_peak_bytes(device: torch.device) -> int:
    """The most GPU memory the process has held so far on ``device`` (0 on a CPU)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def resource_usage(device: torch.device, num_clients: int, states: dict[int, ClientState],
                   data: dict[int, ClientData]) -> dict[str, int]:
    """Peak GPU memory, resident host memory, and the bytes of the hosted clients' state and data."""
    return {
        "num_clients": num_clients,
        "gpu_peak_bytes": gpu_peak_bytes(device),
        "rss_bytes": psutil.Process().memory_info().rss,
        "state_bytes": tensor_bytes(states),
        "data_bytes": sum(client_data.nbytes for client_data in data.values()),
    }
