"""Host seconds of a mixture's server side (``rayfed.Mixture``) at a given size, on this machine's CPU:

- **mix**: every client's mix of the rows (``rayfed.aggregation._mixed``, float64 in column blocks) against the same
  float64 product of the whole stack at once (what it replaced; bitwise the same result);
- **uploads**: one ClientActor-like Ray actor sends a round of uploads, and a server actor writes them into its rows,
  with the mixed slot crossing as read-only views (``UploadCollector``'s ``read_only_slot``, what a ClientActor does
  for a mixture) against each upload arriving as a copy of its own;
- **round**: the same actor trains each client for ``--train-s`` seconds (a sleep: a GPU's update leaves the actor's
  thread free the same way) and the server stores the round's uploads, from the round's call to the rows' store: with
  the mixed slot sent on ahead as each client finishes (``SlotSender``, what a ClientActor on Ray does) against all
  uploads returned with the call, each in an object store that holds the round (4x its uploads) and in one that
  holds a quarter of them (at least Ray's 80 MB; Ray spills the rest to disk).

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
from rayfed.actors.uploads import RoundUploads, SlotSender, UploadCollector, fetch_sent_slots
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

    def send(self, read_only: bool, sent_ahead: bool = False, train_s: float = 0.0) -> RoundUploads:
        collected = UploadCollector(False, dict.fromkeys(range(self.clients), 1.0),
                                    read_only_slot="shared" if read_only else None,
                                    sender=SlotSender(ray.put) if sent_ahead else None)
        for cid in range(self.clients):
            time.sleep(train_s)
            shared = {f"t{i}": value + cid for i, value in enumerate(self.values)}
            collected.add(Upload(cid, 1, {"shared": shared}, 0.0))
        return RoundUploads(collected.on_host(), 0, 0, {})


@ray.remote
class _Server:
    def __init__(self, clients: int, tensors: int, numel: int):
        transport.use_raw_tensor_transport()
        self.rows = {f"t{i}": torch.zeros(clients, numel) for i in range(tensors)}

    def store(self, part: RoundUploads) -> None:
        fetch_sent_slots(part.uploads)
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


def time_rounds(clients: int, tensors: int, numel: int, repeats: int, train_s: float) -> dict[str, float]:
    """Seconds from a round's call on the actor to the end of the server's store, against the clients' training
    alone (``clients * train_s``)."""
    sender, server = _Sender.remote(clients, tensors, numel), _Server.remote(clients, tensors, numel)
    ray.get(server.store.remote(sender.send.remote(True)))
    timings = {"training_s": clients * train_s}
    for label, sent_ahead in (("returned_with_the_call_s", False), ("sent_ahead_s", True)):
        timings[label] = _best(lambda: ray.get(server.store.remote(sender.send.remote(True, sent_ahead, train_s))),
                               repeats)
    ray.kill(sender)
    ray.kill(server)
    return timings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--tensors", type=int, default=60, help="stacks (one per shared tensor) a client's row spans")
    parser.add_argument("--numel", type=int, default=1 << 18, help="float32 values of each tensor")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--train-s", type=float, default=0.2, help="seconds each client trains in the round timings")
    args = parser.parse_args(argv)
    sizes = (args.clients, args.tensors, args.numel)
    torch.set_num_threads(1)  # as on a DriverActor with placement.driver_cpus at its default
    result = {"rows_gb": args.clients * args.tensors * args.numel * 4 / 1e9, "threads": 1,
              "mix": time_mix(*sizes, args.repeats)}
    rows_bytes = int(result["rows_gb"] * 1e9)
    stores = {"round_store_holds_it": 4 * rows_bytes + (1 << 28), "round_store_quarter": max(rows_bytes // 4, 80 << 20)}
    for label, store in stores.items():
        init_local_ray(num_cpus=2, object_store_memory=store)
        try:
            if "uploads" not in result:
                result["uploads"] = time_uploads(*sizes, args.repeats)
            result[label] = {"object_store_gb": store / 1e9, **time_rounds(*sizes, args.repeats, args.train_s)}
        finally:
            ray.shutdown()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
