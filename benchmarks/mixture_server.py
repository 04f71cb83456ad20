"""Host seconds of a mixture's server side (``rayfed.Mixture``) at a given size, on this machine's CPU:

- **mix**: every client's mix of the rows (``rayfed.aggregation._mixed``, float64 in column blocks) against the same
  float64 product of the whole stack at once (what it replaced; bitwise the same result);
- **uploads**: one ClientActor-like Ray actor sends a round of uploads, and a server actor writes them into its rows,
  with the mixed slot crossing as read-only views (``UploadCollector``'s ``read_only_slot``, what a ClientActor does
  for a mixture) against each upload arriving as a copy of its own.

The default size is about a tenth of FedMosaic's LLaVA mix at paper size (10 clients, 5.1 GB of rows there). Prints
JSON; each timing is the best of ``--repeats`` passes.

    python -m rayfed.benchmarks.mixture_server --clients 10 --tensors 60 --numel 262144
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import ray
import torch

from rayfed import transport
from rayfed.actors.uploads import RoundUploads, UploadCollector
from rayfed.aggregation import _mixed
from rayfed.method import Upload
from rayfed.simulation.ray_setup import init_local_ray


def _best(run: Callable[[], object], repeats: int) -> float:
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        timings.append(time.perf_counter() - started)
    return min(timings)


def time_mix(clients: int, tensors: int, numel: int, repeats: int) -> dict[str, float]:
    weights = torch.rand(clients, clients, dtype=torch.float64)
    weights /= weights.sum(dim=1, keepdim=True)
    stacks = [torch.randn(clients, numel) for _ in range(tensors)]

    def whole_stack() -> list[torch.Tensor]:
        return [(weights @ stack.double()).float() for stack in stacks]

    return {"blocks_s": _best(lambda: [_mixed(weights, stack) for stack in stacks], repeats),
            "whole_stack_s": _best(whole_stack, repeats)}


@ray.remote
class _Sender:
    def __init__(self, clients: int, tensors: int, numel: int):
        transport.use_raw_tensor_transport()
        self.clients, self.values = clients, [torch.randn(numel) for _ in range(tensors)]

    def send(self, read_only: bool) -> RoundUploads:
        collected = UploadCollector(False, dict.fromkeys(range(self.clients), 1.0),
                                    read_only_slot="shared" if read_only else None)
        for cid in range(self.clients):
            shared = {f"t{i}": value + cid for i, value in enumerate(self.values)}
            collected.add(Upload(cid, 1, {"shared": shared}, 0.0))
        return RoundUploads(collected.on_host(), 0, 0, {})


@ray.remote
class _Server:
    def __init__(self, clients: int, tensors: int, numel: int):
        transport.use_raw_tensor_transport()
        self.rows = {f"t{i}": torch.zeros(clients, numel) for i in range(tensors)}

    def store(self, part: RoundUploads) -> None:
        for upload in part.uploads:
            for name, value in upload.tensors["shared"].items():
                self.rows[name][upload.client_id] = value


def time_uploads(clients: int, tensors: int, numel: int, repeats: int) -> dict[str, float]:
    """Seconds from the server's call to its end, the round's uploads already in the object store."""
    sender, server = _Sender.remote(clients, tensors, numel), _Server.remote(clients, tensors, numel)
    ray.get(server.store.remote(sender.send.remote(False)))  # the rows' pages, touched once
    timings = {}
    for label, read_only in (("copies_s", False), ("read_only_views_s", True)):
        passes = []
        for _ in range(repeats):
            sent = sender.send.remote(read_only)
            ray.wait([sent])
            started = time.perf_counter()
            ray.get(server.store.remote(sent))
            passes.append(time.perf_counter() - started)
        timings[label] = min(passes)
    return timings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--tensors", type=int, default=60, help="stacks (one per shared tensor) a client's row spans")
    parser.add_argument("--numel", type=int, default=1 << 18, help="float32 values of each tensor")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    sizes = (args.clients, args.tensors, args.numel)
    torch.set_num_threads(1)  # as on a DriverActor with placement.driver_cpus at its default
    result = {"rows_gb": args.clients * args.tensors * args.numel * 4 / 1e9, "threads": 1,
              "mix": time_mix(*sizes, args.repeats)}
    init_local_ray(num_cpus=2, object_store_memory=4 * int(result["rows_gb"] * 1e9) + (1 << 28))
    try:
        result["uploads"] = time_uploads(*sizes, args.repeats)
    finally:
        ray.shutdown()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
