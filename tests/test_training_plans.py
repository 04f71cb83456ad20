"""One train call, one step plan (rayfed.training.plans): which plan a call, config and device get, and the plans'
caches (one LRU class, a cache per plan and model)."""

from __future__ import annotations

import pytest
import torch

from rayfed.actors.client import ClientActor
from rayfed.benchmarks.overhead import Workload
from rayfed.training import ClientContext, Phase, proximal_penalty
from rayfed.training.lru import LeastRecentlyUsed
from rayfed.training.plans import TrainCall, choose_plan, graphed_step, step_plans
from rayfed.training.plans.stacked import Lockstep

WORKLOAD = Workload(num_clients=3, clients_per_round=3, local_steps=2, batch_size=8, samples_per_client=24)


@pytest.fixture(scope="module")
def host() -> ClientActor:
    host = ClientActor(WORKLOAD.config(clients_per_actor=3, gpus_per_actor=0).to_dict(), [0, 1, 2])
    host.start_method(0)
    return host


def _client(host: ClientActor, device: str = "cuda", **train) -> ClientContext:
    """Client 0 as a GPU's would be (nothing here runs on it: only the plan is chosen)."""
    client = host._context(0, 0)
    client.device = torch.device(device)
    client.train_config = client.train_config.model_copy(update={"cuda_graphs": True, **train})
    return client


def _call(client: ClientContext, phases: list[Phase] | None = None, pool: torch.Tensor | None = None,
          optimizer_state: dict | None = None, keep: bool = False, snapshots: tuple[int, ...] = ()) -> TrainCall:
    plain = phases is None
    return TrainCall({}, 2, "train", 0.1, phases or [Phase()], plain, optimizer_state, keep, snapshots, pool)


def test_a_call_gets_the_plan_its_config_and_device_allow(host):
    plans = step_plans(host.model)
    gpu = _client(host)
    assert choose_plan(gpu, _call(gpu)) is plans.graphed_step
    assert choose_plan(_client(host, "cpu"), _call(gpu)) is plans.eager  # no graphs without a GPU
    off = _client(host, cuda_graphs=False)
    assert choose_plan(off, _call(off)) is plans.eager
    declared = [Phase(extra_loss=proximal_penalty({"w": torch.ones(2)}, 0.1))]
    assert choose_plan(gpu, _call(gpu, declared)) is plans.graphed_step  # a term a graph may capture
    undeclared = [Phase(extra_loss=lambda params: params["w"].sum())]
    assert choose_plan(gpu, _call(gpu, undeclared)) is plans.eager
    assert choose_plan(gpu, _call(gpu, [Phase(loss=lambda step: step.task_loss())])) is plans.eager
    # Several micro-batches a step, or a kept optimizer state: the parts replay, the optimizer steps eagerly.
    accumulated = _client(host, grad_accum=2)
    assert choose_plan(accumulated, _call(accumulated)) is plans.graphed_parts
    assert choose_plan(gpu, _call(gpu, keep=True)) is plans.graphed_parts
    assert choose_plan(accumulated, _call(accumulated, declared)) is plans.eager  # parts capture no extra term
    # The parts' optimizer steps eagerly: rates and a trained set of the phase's own replay there, not a whole step.
    own_rates = [Phase(trains=lambda name: "lora" in name, lr_of=lambda name: 0.5 if "lora_A" in name else None)]
    assert choose_plan(gpu, _call(gpu, own_rates)) is plans.graphed_parts
    assert choose_plan(gpu, _call(gpu, [Phase(lr=0.3)], keep=True)) is plans.graphed_parts
    assert choose_plan(gpu, _call(gpu, [Phase(loss=lambda step: step.task_loss())], keep=True)) is plans.eager
    # Nothing arrived yet in a stream: nothing to capture.
    assert choose_plan(gpu, _call(gpu, pool=torch.zeros(0, dtype=torch.long))) is plans.eager
    assert choose_plan(gpu, _call(gpu, pool=torch.arange(4))) is plans.graphed_step


def test_only_a_plain_update_with_rows_and_a_lockstep_trains_stacked(host):
    plans = step_plans(host.model)
    client = _client(host, "cpu")
    assert choose_plan(client, _call(client)) is plans.eager
    client.lockstep = Lockstep(3)
    assert choose_plan(client, _call(client)) is plans.stacked
    assert choose_plan(client, _call(client, [Phase()])) is plans.eager  # phases given: not a plain update
    assert choose_plan(client, _call(client, snapshots=(1,))) is plans.eager
    assert choose_plan(client, _call(client, keep=True)) is plans.eager
    assert choose_plan(client, _call(client, pool=torch.zeros(0, dtype=torch.long))) is plans.eager
    observed = TrainCall({}, 2, "train", 0.1, [Phase()], True, None, False, (), None, lambda step: None)
    assert choose_plan(client, observed) is plans.eager  # an observer sees one client's micro-batches
    gpu = _client(host)
    gpu.lockstep = Lockstep(3)
    assert choose_plan(gpu, _call(gpu)) is plans.stacked
    # A group of one trains by the plan the call would get without a lockstep.
    assert plans.stacked.alone(gpu, _call(gpu)) is plans.graphed_step


def test_a_train_call_runs_its_one_plan(host, monkeypatch):
    start = host.start_method(0)
    client = host._context(1, 0)
    plans = step_plans(client.model)
    ran = []
    for name in ("eager", "graphed_step", "graphed_parts", "stacked"):
        plan = getattr(plans, name)
        monkeypatch.setattr(plan, "run", lambda client, call, name=name, run=plan.run: ran.append(name)
                            or run(client, call))
    result = client.train(start)
    assert ran == ["eager"] and float(result.loss) > 0


@pytest.mark.parametrize("plan", ["eager", "graphed_step", "graphed_parts"])
def test_an_observer_sees_each_micro_batch_once_its_step_is_taken_whichever_plan_runs_it(host, plan, request):
    # the replays stand in for graphs on the CPU (conftest), so the graphed plans run here as on a GPU
    replays = request.getfixturevalue({"graphed_step": "replayed_on_cpu", "graphed_parts": "parts_replayed_on_cpu",
                                       "eager": "tmp_path"}[plan])
    start = host.start_method(0)
    client = host._context(1, 0)
    client.train_config = client.train_config.model_copy(update={"cuda_graphs": plan != "eager", "optimizer": "sgd"})
    seen: list[tuple[int, torch.Tensor, dict[str, torch.Tensor]]] = []

    def observe(step) -> None:
        [(task, batch)] = step.parts
        seen.append((step.index, batch["labels"].clone(), {n: p.detach().clone() for n, p in step.params.items()}))

    result = client.train(start, steps=3, snapshot_steps=(1, 2, 3), observe=observe,
                          keep_optimizer_state=plan == "graphed_parts")
    assert plan == "eager" or replays  # the plan named ran
    assert [index for index, _, _ in seen] == [0, 1, 2]
    orders = list(client.batch_order(3, "train", None))
    labels = next(iter(client.data.parts)).train["labels"]
    for (index, batch_labels, params), rows in zip(seen, orders):
        assert torch.equal(batch_labels, labels[rows])  # the step's own micro-batch
        after = result.snapshots[index + 1]  # the values once its step is taken
        assert all(torch.equal(params[name], after[name]) for name in after)


def test_the_lru_drops_the_least_recently_used_but_keeps_what_a_caller_still_needs():
    cache: LeastRecentlyUsed[str, int] = LeastRecentlyUsed(2)
    made = []

    def make(value: int):
        return lambda: made.append(value) or value

    assert cache.get_or_make("a", make(1)) == 1 and cache.get_or_make("b", make(2)) == 2
    assert cache.get_or_make("a", make(9)) == 1 and made == [1, 2]  # kept: not made again, now the most recent
    cache.get_or_make("c", make(3))
    assert list(cache) == ["a", "c"]  # b was the least recently used
    cache.use("a")
    cache.get_or_make("d", make(4), keep={"c"})  # c, the oldest, is still needed: the cache grows past 2
    assert list(cache) == ["c", "a", "d"]
    cache.get_or_make("e", make(5))
    assert list(cache) == ["d", "e"] and cache.values() == [4, 5]

    def failing():
        raise RuntimeError("cannot capture")

    with pytest.raises(RuntimeError):
        cache.get_or_make("f", failing)
    assert "f" not in cache and len(cache) == 1  # room was made first; a failed make keeps nothing
    with pytest.raises(ValueError, match="at least one value"):
        LeastRecentlyUsed(0)


def test_each_plan_keeps_its_own_cache_per_model(monkeypatch):
    made = []

    class Captured:  # stands in for a captured graph
        def __init__(self, client, named, config, batch, task, phases, penalty=None):
            made.append(client.model)

        def reset_optimizers(self):
            pass

        def load_penalty(self, penalty):
            pass

    monkeypatch.setattr(graphed_step, "GraphedStep", Captured)
    hosts = [ClientActor(WORKLOAD.config(clients_per_actor=3, gpus_per_actor=0).to_dict(), [0, 1, 2]) for _ in range(2)]
    for host in hosts:
        host.start_method(0)
    plans = [step_plans(host.model) for host in hosts]
    assert plans[0] is not plans[1] and plans[0] is step_plans(hosts[0].model)
    caches = [plan.graphed_step.graphs for plan in plans] + [plan.graphed_parts.families for plan in plans]
    assert len({id(cache) for cache in caches}) == 4
    for host in hosts:
        named = dict(host.model.named_parameters())
        step_plans(host.model).graphed_step.graph(host._context(0, 0), named, [Phase()])
    assert made == [hosts[0].model, hosts[1].model]  # one capture each: the second model did not reuse the first's
    assert [len(plan.graphed_step.graphs) for plan in plans] == [1, 1]
    assert [len(plan.graphed_parts.families) for plan in plans] == [0, 0]
