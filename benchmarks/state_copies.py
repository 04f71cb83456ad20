"""Host <-> GPU copy time of one round's client states: a copy per tensor from pageable and from pinned host memory,
and the round's states moved together (``rayfed.types.states_to``, what a ClientActor does) from pageable memory.

The states are those of 50 Ditto clients of the GPU workload (LoRA r16 on the 24 MLP linears of ViT-B/16: 48 float32
tensors, 5.9 MB a client): what an actor moves in and out of the GPU each round when states are kept on the host.
Prints JSON: seconds for the 50 states to the GPU and back, the second of two passes.

    python -m rayfed.benchmarks.state_copies
"""

from __future__ import annotations

import json
import time

import torch

from rayfed.types import states_to

LORA_SHAPES = [(16, 768), (3072, 16), (16, 3072), (768, 16)] * 12  # c_fc's A, B and c_proj's A, B, 12 blocks


def time_copies(clients: int = 50) -> dict[str, dict[str, float]]:
    states = [[torch.randn(shape) for shape in LORA_SHAPES] for _ in range(clients)]
    timings = {}
    for label, pinned in (("pageable", False), ("pinned", True)):
        on_host = [[t.pin_memory() if pinned else t for t in state] for state in states]
        for _ in range(2):  # the first pass warms the allocators
            torch.cuda.synchronize()
            started = time.perf_counter()
            on_gpu = [[t.to("cuda") for t in state] for state in on_host]
            torch.cuda.synchronize()
            arrived = time.perf_counter()
            [[t.to("cpu") for t in state] for state in on_gpu]
            returned = time.perf_counter()
        timings[label] = {"to_gpu_s": arrived - started, "to_host_s": returned - arrived}
    together = {cid: {"personal": dict(enumerate(state))} for cid, state in enumerate(states)}
    for _ in range(2):
        torch.cuda.synchronize()
        started = time.perf_counter()
        on_gpu = states_to(together, "cuda")
        torch.cuda.synchronize()
        arrived = time.perf_counter()
        states_to(on_gpu, "cpu")
        returned = time.perf_counter()
    timings["states_to"] = {"to_gpu_s": arrived - started, "to_host_s": returned - arrived}
    megabytes = sum(t.numel() * t.element_size() for state in states for t in state) / 1e6
    return {label: {**timing, "mb": megabytes} for label, timing in timings.items()}


if __name__ == "__main__":
    print(json.dumps(time_copies()))
