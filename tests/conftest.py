"""Shared fixtures: offline environment, one local Ray instance, tiny run configs."""

from __future__ import annotations

import os

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Where FedMosaic's paper configs read DRAKE and HFLB (`hf:${DRAKE_ROOT}/...`), as a user exports it: the configs load
# (their data is not read here).
for _var in ("DRAKE_ROOT", "HFLB_ROOT"):
    os.environ.setdefault(_var, f"/data/{_var.removesuffix('_ROOT').lower()}")

import contextlib  # noqa: E402
import copy  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402

import pytest  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
import torch.utils._python_dispatch  # noqa: E402

from rayfed.simulation import init_local_ray  # noqa: E402

# The papers' reproduction and config scripts (benchmarks/papers/, outside the installed package) import as the
# top-level modules they are when run as `python benchmarks/papers/<script>.py`.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "papers"))

TINY_RUN = {
    "name": "tiny",
    "seed": 3,
    "data": {
        "source": "synthetic",
        "synthetic": {"num_samples": 240, "num_classes": 4, "image_size": 8},
        "num_clients": 4,
        "partition": {"name": "dirichlet", "alpha": 0.5, "min_samples": 12},
    },
    "model": {"backbone": "tiny:vit", "image_size": 8, "lora": {"rank": 2, "alpha": 4}},
    "federation": {"rounds": 4, "clients_per_round": 3, "eval_every": 2},
    "train": {"local_steps": 3, "batch_size": 8, "lr": 0.01, "optimizer": "adam"},
    "methods": ["fedavg"],
    "placement": {"clients_per_actor": 2, "cpus_per_actor": 0.5},
}


@pytest.fixture
def tiny_run() -> dict:
    """A config dict that runs in a few seconds; tests edit their own copy."""
    return copy.deepcopy(TINY_RUN)


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance for the whole session (starting Ray costs seconds)."""
    init_local_ray(num_cpus=4, object_store_memory=5 * 10**8)
    yield
    ray.shutdown()


@contextlib.contextmanager
def ray_paused() -> Iterator[None]:
    """No Ray inside (for code that starts its own); a Ray running before is shut down, then started again."""
    paused = ray.cluster_resources() if ray.is_initialized() else None
    if paused is not None:
        ray.shutdown()
    try:
        yield
    finally:
        ray.shutdown()
        if paused is not None:
            init_local_ray(num_cpus=int(paused["CPU"]), num_gpus=int(paused.get("GPU", 0)),
                           object_store_memory=int(paused["object_store_memory"]))


def load_data(source, seed: int = 0, *, synthetic: dict | None = None, group_column: str | None = None, **fields):
    """``load_source`` of a data config with these fields (``synthetic``: the source's options)."""
    from rayfed.config import build_config
    from rayfed.data import load_source

    data = {"source": source, "options": synthetic, **fields}
    if group_column is not None:
        data["partition"] = {"column": group_column}
    return load_source(build_config({"data": data}).data, seed)


def method_class(name: str) -> type:
    """The registered method class ``name``."""
    from rayfed import registry

    return registry.resolve("method", name).obj


_EXIT_STATUS: list[int] = []


@pytest.fixture
def replayed_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list:
    """``train.cuda_graphs``' whole-step plan on the CPU, chosen as on a GPU, with each "replay" running the captured
    step's function again instead of a CUDA graph: what a capture can get wrong besides the graph itself (the phases,
    their optimizers, trained sets and losses, the static inputs, the rate, the reset between calls) shows as a
    difference from the eager update. A CPU optimizer reads a rate held in a tensor only as SGD (train.optimizer:
    sgd). Each replay runs as under a capture and counts the values it reads back to the host and the tensors it
    makes from the host's data (:func:`parts_replayed_on_cpu`). Gives the steps captured, each with ``host_reads``,
    that count per replay."""
    from unittest import mock

    import torch

    from rayfed.models.families import llava
    from rayfed.training import graph_capture, plans
    from rayfed.training.plans import graphed_step

    captured: list = []

    def rerun(step, optimizers, device):
        result = torch.zeros(())
        reads = CountedOps(CountedOps.HOST_READS | {"aten::lift_fresh"})
        for optimizer in optimizers:  # a CPU optimizer reads its rate back; a GPU's fused one reads nothing
            optimizer.step = uncounted(reads, optimizer.step)

        class Replay:
            def __init__(self) -> None:
                self.host_reads: list[int] = []

            def replay(self) -> None:
                reads.count = 0
                with mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: True), \
                        mock.patch.object(llava, "capturing", lambda: True), reads:
                    result.copy_(step())
                self.host_reads.append(reads.count)

        step()  # the warm-up before a capture: what a first step sets up (GraphedStep restores the values after it)
        replay = Replay()
        captured.append(replay)
        return replay, result

    monkeypatch.setattr(graph_capture, "warm_up_and_capture", rerun)
    monkeypatch.setattr(plans, "captures_step",
                        lambda config, device, phases: graphed_step.captures_step(config, torch.device("cuda"), phases))
    return captured


@pytest.fixture
def parts_replayed_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list:
    """``train.cuda_graphs``' graphed parts plan on the CPU, chosen as on a GPU, each part's "replay" running the
    captured part's function again instead of a CUDA graph: what the parts can get wrong besides the graph itself
    (the gradients each part adds and to what, the static rows, the losses, the eager optimizer steps between) shows
    as a difference from the eager update. Each replay runs as under a capture (as transformers and rayfed's LLaVA
    tell one) and counts the values it reads back to the host and the tensors it makes from the host's data (on a
    GPU a copy from the host), neither of which a capture can hold. Gives the parts captured, each with
    ``host_reads``, that count per replay."""
    import contextlib
    from unittest import mock

    import torch

    from rayfed.models.families import llava
    from rayfed.training import graph_capture, plans
    from rayfed.training.plans import graphed_parts

    captured: list = []

    class Rerun:
        def __init__(self, body, pool, stream, device) -> None:
            self.body, self.host_reads = body, []
            captured.append(self)

        def replay(self) -> None:
            with (mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: True),
                  mock.patch.object(llava, "capturing", lambda: True),
                  CountedOps(CountedOps.HOST_READS | {"aten::lift_fresh"}) as reads):
                self.body()
            self.host_reads.append(reads.count)

    class NoStream:  # a class: a module imported later may annotate with torch.cuda.Stream | None
        def __init__(self, device=None) -> None:
            self.device = device

    monkeypatch.setattr(graph_capture, "captured_part", Rerun)
    monkeypatch.setattr(graph_capture, "on_stream", lambda stream, device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", NoStream)
    monkeypatch.setattr(plans, "captures_parts", lambda config, device, *rest: graphed_parts.captures_parts(
        config, torch.device("cuda"), *rest))
    return captured


def uncounted(counter: CountedOps, function: Callable) -> Callable:
    """``function``, whose ops ``counter`` does not count."""

    def call(*args, **kwargs):
        counter.paused += 1
        try:
            return function(*args, **kwargs)
        finally:
            counter.paused -= 1

    return call


def made_instances(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list:
    """Every instance of the class ``owner.<name>`` made from now on: a subclass that keeps them, patched in."""
    made: list = []

    class Kept(getattr(owner, name)):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(owner, name, Kept)
    return made


class CountedOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops named ``names`` (aten schema names) run while it is active."""

    HOST_READS = frozenset({"aten::_local_scalar_dense", "aten::nonzero", "aten::unique_dim", "aten::_unique2",
                            "aten::is_nonzero"})  # each reads values back to the host: a sync on a GPU

    def __init__(self, names: frozenset[str] = HOST_READS):
        super().__init__()
        self.names, self.count, self.paused = names, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not self.paused and func._schema.name in self.names
        return func(*args, **(kwargs or {}))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave with pytest's status once every plug-in has finished, without the interpreter's own teardown: a clone's
    whole suite once passed and then crashed there (a segmentation fault in the native threads Ray and torch leave
    behind), which turns a passing run into a failing exit code."""
    if _EXIT_STATUS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])


def compiled_update_gap(run: dict, clients: list[int], monkeypatch: pytest.MonkeyPatch) -> float:
    """How far ``clients``' first uploads under ``train.compile`` are from the eager ones, relative to the update
    (:func:`rayfed.benchmarks.fast_steps_check.largest_relative_difference`), after checking that the step compiled
    and that the update moved the parameters well past round-off.

    Compiled with the ``aot_eager`` backend: dynamo's tracing and AOTAutograd's graphs, where a method's step could
    go wrong (Python state baked into a graph, a hook or branch left out), without inductor's kernels, whose
    numbers tests/test_training.py checks and whose compilation takes minutes per model on 2 cores."""
    import functools

    import torch

    from rayfed.benchmarks.fast_steps_check import compiled_gap

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    gap, moved = compiled_gap(run, clients)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # it compiled
    assert moved > 1e-4  # the update is far above float32 round-off
    return gap
