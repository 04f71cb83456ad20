"""The local training step: a step captured as a CUDA graph trains like the eager one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rayfed import training
from rayfed.actors.client import ClientActor
from rayfed.benchmarks.overhead import Workload
from rayfed.data.batches import ClientData, TaskData
from rayfed.errors import ConfigError

WORKLOAD = Workload(num_clients=3, clients_per_round=3, local_steps=6, batch_size=8, samples_per_client=24)


def _host(cuda_graphs: bool) -> tuple[ClientActor, dict[str, torch.Tensor]]:
    config = dataclasses.replace(WORKLOAD, cuda_graphs=cuda_graphs).config(clients_per_actor=3, gpus_per_actor=0)
    host = ClientActor(config.to_dict(), [0, 1, 2])
    return host, host.start_method(0)


@pytest.mark.parametrize("field, value", [("optimizer", "sgd"), ("grad_clip", 1.0)])
def test_cuda_graphs_refuse_what_a_captured_step_cannot_do(field, value):
    config = WORKLOAD.config(clients_per_actor=3, gpus_per_actor=0).to_dict()
    config["train"].update({"cuda_graphs": True, field: value})
    with pytest.raises(ConfigError, match=f"train.cuda_graphs needs train.{field} in"):
        ClientActor(config, [0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_graphed_step_trains_like_the_eager_one_and_each_client_starts_afresh():
    eager, eager_start = _host(cuda_graphs=False)
    graphed, graphed_start = _host(cuda_graphs=True)
    for name, value in eager_start.items():
        assert torch.equal(value, graphed_start[name])
    first = graphed._context(0, 0).train(graphed_start)
    graphed._context(1, 0).train(graphed_start)
    again = graphed._context(0, 0).train(graphed_start)  # the same graph, its optimizer state zeroed
    assert len(training._GRAPHS[graphed.model]) == 1
    reference = eager._context(0, 0).train(eager_start)
    assert again.loss == first.loss
    # bf16 kernels picked under capture may round differently; a wrong step (lr, state, batch) is far larger
    assert first.loss == pytest.approx(reference.loss, rel=1e-3)
    for name, value in reference.params.items():
        assert torch.equal(again.params[name], first.params[name])
        update = value - graphed_start[name].cuda()
        # Adam turns near-zero gradients (LoRA's A while B is zero) into full-size steps of either sign, so
        # compare the whole update (6% apart on an H100): a wrong lr, state or batch changes it by its own size
        assert update.norm() > 0 and (first.params[name] - value).norm() < 0.15 * update.norm(), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_without_a_gpu_cuda_graphs_train_eagerly_to_the_same_numbers():
    eager, eager_start = _host(cuda_graphs=False)
    graphed, graphed_start = _host(cuda_graphs=True)
    reference, result = eager._context(1, 2).train(eager_start), graphed._context(1, 2).train(graphed_start)
    assert result.loss == reference.loss
    for name, value in reference.params.items():
        assert torch.equal(result.params[name], value)


def test_an_actor_keeps_the_most_recently_used_graphs_one_per_trained_set_task_and_batch_shape(monkeypatch):
    captured = []

    class CountingStep:  # stands in for a captured graph: counts captures and optimizer resets
        def __init__(self, model, named, config, lr, batch, task):
            self.shape, self.resets = tuple(batch["pixel_values"].shape), 0
            captured.append(self)

        def reset_optimizer(self):
            self.resets += 1

    monkeypatch.setattr(training, "GraphedStep", CountingStep)
    host, _ = _host(cuda_graphs=False)
    config, model = host.config.train, host.model
    named = dict(model.named_parameters())
    part = host.data[0].parts[0]
    small = ClientData([TaskData(0, {name: column[:5] for name, column in part.train.items()}, part.test)])
    task0, task1 = host.tasks[0], dataclasses.replace(host.tasks[0], index=1)
    first = training._graphed_step(model, named, config, 0.1, host.data[0], task0)
    assert training._graphed_step(model, named, config, 0.1, host.data[1], task0) is first and first.resets == 2
    assert first.shape[0] == config.batch_size
    assert training._graphed_step(model, named, config, 0.1, small, task0).shape[0] == 5  # a batch of all 5
    training._graphed_step(model, named, config, 0.1, host.data[0], task1)
    training._graphed_step(model, named, config, 0.2, host.data[0], task0)
    assert len(captured) == 4 and len(training._GRAPHS[model]) == training.MAX_GRAPHS_PER_MODEL
    training._graphed_step(model, named, config, 0.1, host.data[0], task0)  # used last: stays
    training._graphed_step(model, named, config, 0.3, host.data[0], task0)  # a fifth: the batch-5 graph goes
    assert len(captured) == 5 and first in training._GRAPHS[model].values()
    assert all(step.shape[0] != 5 for step in training._GRAPHS[model].values())


def test_a_step_that_cannot_be_captured_trains_eagerly_with_one_warning(monkeypatch, caplog):
    attempts = []

    def failing_capture(*args):
        attempts.append(args)
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(training, "GraphedStep", failing_capture)
    host, _ = _host(cuda_graphs=False)
    named = dict(host.model.named_parameters())
    with caplog.at_level("WARNING", logger="rayfed.training"):
        for cid in (0, 1):
            assert training._graphed_step(host.model, named, host.config.train, 0.1, host.data[cid], host.tasks[0]) is None
    assert len(attempts) == 1
    [record] = caplog.records
    assert "could not be captured" in record.getMessage() and "stream is capturing);" in record.getMessage()
