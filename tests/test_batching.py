"""train.batch_clients: several clients of an actor trained in one forward / backward (the stacked step plan,
rayfed.training.plans.stacked)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch._inductor import config as inductor_config

from rayfed.training.plans import stacked
from rayfed.actors.client import ClientActor
from rayfed.benchmarks.overhead import Workload
from rayfed.config import load_config
from rayfed.errors import ConfigError
from rayfed.method import LocalResult, Method

IMAGES = Workload(num_clients=5, clients_per_round=5, local_steps=4, batch_size=6, samples_per_client=12)
TEXT = Workload(backbone="llama:tiny", task="text_generation", lora_targets=("q_proj", "v_proj", "down_proj"),
                seq_len=24, target_words=4, num_clients=3, clients_per_round=3, local_steps=3, batch_size=4,
                samples_per_client=8)


def _config(workload: Workload, method: Any, batch_clients: int, **train: Any) -> dict:
    config = dataclasses.replace(workload, batch_clients=batch_clients).config(
        clients_per_actor=workload.num_clients, gpus_per_actor=0).to_dict()
    config["methods"] = [method]
    config["train"].update(train)
    return config


def _round(config: dict, methods: list[Method] | None = None):
    clients = list(range(config["data"]["num_clients"]))
    actor = ClientActor(config, clients, methods=methods)
    shared = actor.start_method(0)
    uploads = actor.train(1, clients, {cid: shared for cid in clients})
    return uploads, actor.states


@pytest.fixture
def stacked_groups(monkeypatch) -> list[list[int]]:
    """The client ids of each group that trained stacked."""
    groups: list[list[int]] = []
    train_stacked = stacked._train_stacked

    def spy(requests):
        groups.append([r.client.client_id for r in requests])
        return train_stacked(requests)

    monkeypatch.setattr(stacked, "_train_stacked", spy)
    return groups


def _assert_close(batched: dict[str, torch.Tensor], sequential: dict[str, torch.Tensor],
                  start: dict[str, torch.Tensor]) -> None:
    for name, value in sequential.items():
        update = value - start[name] if name in start else value
        assert (batched[name] - value).norm() <= 1e-4 * update.norm() + 1e-7, name


@pytest.mark.parametrize("method", ["fedavg", {"name": "ditto", "lam": 0.5}, {"name": "fedprox", "mu": 0.1}])
def test_batched_clients_train_as_each_one_alone(method, stacked_groups):
    train = {"optimizer": "adamw", "weight_decay": 0.01, "grad_clip": 0.05}  # small enough that clipping acts
    sequential_uploads, sequential_states = _round(_config(IMAGES, method, 1, **train))
    assert stacked_groups == []
    batched_uploads, batched_states = _round(_config(IMAGES, method, 3, **train))
    # Every client's plain update trains stacked, three and then two at a time (Ditto: both of its updates).
    updates_per_client = 2 if isinstance(method, dict) and method["name"] == "ditto" else 1
    assert stacked_groups == [[0, 1, 2], [3, 4]] * updates_per_client
    start = ClientActor(_config(IMAGES, method, 1, **train), [0]).start_method(0)
    for sequential, batched in zip(sequential_uploads, batched_uploads):
        assert sequential.client_id == batched.client_id
        assert batched.train_loss == pytest.approx(sequential.train_loss, rel=1e-5)
        _assert_close(batched.tensors["shared"], sequential.tensors["shared"], start)
    for cid, state in sequential_states.items():
        for slot, values in state.items():
            _assert_close(batched_states[cid][slot], values, start)


def test_text_clients_batch_when_compiled_and_fall_back_to_one_at_a_time_when_vmap_cannot_run(stacked_groups, caplog):
    sequential, _ = _round(_config(TEXT, "fedavg", 1))
    # Eager: Hugging Face's causal mask reads the padding mask's values to pick a path, which vmap refuses.
    with caplog.at_level("WARNING", logger="rayfed.training.plans.stacked"):
        eager, _ = _round(_config(TEXT, "fedavg", 3))
    assert stacked_groups == [[0, 1, 2]]
    assert "cannot run under torch.func.vmap (vmap: It looks like" in caplog.text
    for alone, fallback in zip(sequential, eager):
        assert fallback.train_loss == alone.train_loss
        assert all(torch.equal(fallback.tensors["shared"][n], v) for n, v in alone.tensors["shared"].items())
    # Compiled: traced, the mask takes the path that reads no values, and the three clients train stacked.
    stacked_groups.clear()
    with inductor_config.patch(compile_threads=1):  # no pool of compile workers on 2 cores
        compiled, _ = _round(_config(TEXT, "fedavg", 3, compile=True))
    assert stacked_groups == [[0, 1, 2]]
    start = ClientActor(_config(TEXT, "fedavg", 1), [0]).start_method(0)
    for alone, together in zip(sequential, compiled):
        assert together.train_loss == pytest.approx(alone.train_loss, rel=1e-5)
        _assert_close(together.tensors["shared"], alone.tensors["shared"], start)


class _Recording(Method):
    """Each client: one update with a loss of its own (trained alone), then a plain one (trained stacked)."""

    def __init__(self, events: list[tuple[str, int]], fail_client: int | None = None):
        super().__init__()
        self.events = events
        self.fail_client = fail_client

    def local_update(self, client, state, payload) -> LocalResult:
        self.events.append(("hook", client.client_id))
        if client.client_id == self.fail_client:
            raise ValueError(f"client {client.client_id} fails")
        client.train(payload, steps=1, purpose="own", loss=lambda step: step.task_loss())
        self.events.append(("own loss done", client.client_id))
        result = client.train(payload)
        self.events.append(("plain done", client.client_id))
        return LocalResult(state, {"shared": result.params}, result.loss)


def test_hooks_take_turns_in_client_order_and_only_plain_updates_train_together(stacked_groups):
    events: list[tuple[str, int]] = []
    config = _config(IMAGES, "fedavg", 5)
    uploads, _ = _round(config, [_Recording(events)])
    clients = range(5)
    # Each hook runs until its plain update, in client order; the stacked update then returns to each in turn.
    assert events == ([event for c in clients for event in (("hook", c), ("own loss done", c))]
                      + [("plain done", c) for c in clients])
    assert stacked_groups == [[0, 1, 2, 3, 4]]
    sequential, _ = _round(_config(IMAGES, "fedavg", 1), [_Recording([])])
    for alone, together in zip(sequential, uploads):
        assert together.train_loss == pytest.approx(alone.train_loss, rel=1e-5)


def test_a_failing_hook_raises_in_the_actor_and_the_other_clients_finish(stacked_groups):
    events: list[tuple[str, int]] = []
    with pytest.raises(ValueError, match="client 2 fails"):
        _round(_config(IMAGES, "fedavg", 5), [_Recording(events, fail_client=2)])
    assert stacked_groups == [[0, 1, 3, 4]]
    assert {cid for event, cid in events if event == "plain done"} == {0, 1, 3, 4}


def test_batch_clients_must_be_a_positive_count():
    config = _config(IMAGES, "fedavg", 1)
    config["train"]["batch_clients"] = 0
    with pytest.raises(ConfigError, match="train.batch_clients"):
        load_config(config)
