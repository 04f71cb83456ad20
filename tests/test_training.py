"""The local training step: a step captured as a CUDA graph trains like the eager one."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from rayfed import training
from rayfed.training import graph_capture, penalties, precision
from rayfed.training.plans import graphed_step as graphed_step_plan, step_plans
from rayfed.tasks import kinds
from rayfed.actors.client import ClientActor, _OnDevice
from rayfed.actors.uploads import UploadCollector, to_host
from rayfed.benchmarks.overhead import Workload
from rayfed.data.batches import ClientData, TaskData
from rayfed.config import load_config
from rayfed.errors import ConfigError
from rayfed.method import Upload, post_train_views
from rayfed.models.peft.modules import select_task
from rayfed.training.scoring import Scorer
from rayfed.training.steps import CapturedLoss, Phase
from rayfed.types import ReadOnlyTensors

from conftest import CountedOps

WORKLOAD = Workload(num_clients=3, clients_per_round=3, local_steps=6, batch_size=8, samples_per_client=24)


def _host(cuda_graphs: bool) -> tuple[ClientActor, dict[str, torch.Tensor]]:
    config = dataclasses.replace(WORKLOAD, cuda_graphs=cuda_graphs).config(clients_per_actor=3, gpus_per_actor=0)
    host = ClientActor(config.to_dict(), [0, 1, 2])
    return host, host.start_method(0)


def test_an_actors_data_bytes_count_the_train_and_the_test_columns_of_every_client():
    host, _ = _host(cuda_graphs=False)
    train, test = ([column.numel() * column.element_size() for data in host.data.values() for part in data.parts
                    for column in getattr(part, split).values()] for split in ("train", "test"))
    assert sum(train) > sum(test) > 0
    assert host.resource_usage()["data_bytes"] == sum(train) + sum(test)


def test_a_payload_tensor_that_consecutive_clients_share_reaches_the_device_once():
    shared, own = torch.ones(3), torch.zeros(2)
    payloads = _OnDevice({0: {"w": shared}, 1: {"w": shared, "b": own}, 2: None, 3: {"b": own}, 4: {"w": shared}},
                         torch.device("meta"))
    first, second = payloads[0], payloads[1]
    assert first["w"].device.type == "meta" and first["w"].shape == (3,)
    assert second["w"] is first["w"] and second["b"].shape == (2,)
    assert payloads[1]["b"] is second["b"]  # asked for again: nothing moved again
    assert payloads[2] is None
    assert payloads[3]["b"] is second["b"]
    assert payloads[4]["w"] is not first["w"]  # only the previous client's tensors are kept


def test_a_payload_reaches_the_hooks_as_the_actors_own_copy():
    server = {"w": torch.ones(3)}  # in one process the payloads are the server's tensors
    payloads = _OnDevice({0: server, 1: dict(server)}, torch.device("cpu"))
    received = payloads[0]["w"]
    received.add_(1.0)  # a hook writing into its payload
    assert torch.equal(server["w"], torch.ones(3))
    assert payloads[1]["w"] is received  # copied once for the round's clients that share it


COPIES = frozenset({"aten::_to_copy", "aten::copy_", "aten::cat", "aten::clone"})  # ops that copy values


def test_a_clients_payload_tensors_of_one_dtype_cross_in_one_copy():
    payload = {f"w{i}": torch.full((i + 1, 2), float(i)) for i in range(6)}
    on_device = _OnDevice({0: payload}, torch.device("cpu"))
    with CountedOps(COPIES) as copies:
        received = on_device[0]
    assert copies.count == 1  # one per tensor before
    assert all(torch.equal(received[name], value) for name, value in payload.items())


def _mixed_payload() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Tensors of several dtypes and shapes (0-d, empty, non-contiguous views of ``wide``), and ``wide``."""
    generator = torch.Generator().manual_seed(4)
    wide = torch.randn(4, 6, generator=generator)
    return {"a": torch.randn(3, 5, generator=generator), "scalar": torch.tensor(2.5, dtype=torch.float64),
            "empty": torch.zeros(0, 3), "ids": torch.arange(7), "flags": torch.tensor([True, False, True]),
            "half": torch.randn(5, generator=generator).bfloat16(), "transposed": wide.t(), "strided": wide[:, ::2],
            "b": torch.randn(2, 2, 2, generator=generator, dtype=torch.float64), "no_rows": torch.zeros(0)}, wide


def test_a_payload_copied_in_one_go_keeps_every_value_dtype_and_shape_and_is_the_actors_own():
    payload, wide = _mixed_payload()
    received = _OnDevice({0: payload}, torch.device("cpu"))[0]
    assert list(received) == list(payload)
    for name, value in payload.items():
        got = received[name]
        assert got.dtype == value.dtype and got.shape == value.shape and torch.equal(got, value), name
        assert got.untyped_storage().data_ptr() != value.untyped_storage().data_ptr() or not value.numel(), name
    received["transposed"].add_(1.0)  # a hook writing into its payload changes neither the source nor the others
    assert torch.equal(payload["transposed"], wide.t()) and torch.equal(received["strided"], wide[:, ::2])


def test_a_payload_tensor_a_method_keeps_in_its_state_is_kept_without_the_rest_of_the_payload():
    host, shared = _tiny_host()
    update = host.method.local_update

    def keeping_update(client, state, payload):
        result = update(client, state, payload)
        kept = next(iter(payload))
        return dataclasses.replace(result, state={**result.state, "kept": {kept: payload[kept]}})

    host.method.local_update = keeping_update
    host.train(0, [0], {0: shared})
    (name, kept), = host.states[0]["kept"].items()
    assert torch.equal(kept, shared[name])
    assert kept.untyped_storage().nbytes() == kept.nbytes  # not a view of the payload's buffer


def test_uploads_reach_the_host_each_in_storage_of_its_own_with_their_values():
    storage = torch.arange(20, dtype=torch.float32)  # uploads viewing one buffer, as one copy back would leave them
    uploads = [Upload(cid, 4, {"shared": {"w": storage[cid * 5:cid * 5 + 4].view(2, 2), "s": storage[cid * 5 + 4]}},
                      torch.tensor(0.5 + cid)) for cid in range(2)]
    collected = UploadCollector(presum=False, weight_scale={0: 1.0, 1: 1.0})
    for upload in uploads:
        collected.add(upload)
    assert collected.up_bytes == 2 * 5 * 4
    on_host = collected.on_host()
    for cid, upload in enumerate(on_host):
        assert upload.train_loss == 0.5 + cid and type(upload.train_loss) is float
        for name, value in upload.tensors["shared"].items():
            assert value.untyped_storage().nbytes() == value.nbytes, name
        assert torch.equal(upload.tensors["shared"]["w"], storage[cid * 5:cid * 5 + 4].view(2, 2))
        assert torch.equal(upload.tensors["shared"]["s"], storage[cid * 5 + 4])


def test_a_mixtures_slot_reaches_the_host_as_views_to_be_sent_and_the_other_slots_each_in_storage_of_its_own():
    storage = torch.arange(20, dtype=torch.float32)
    upload = Upload(0, 4, {"shared": {"w": storage[:4]}, "relevance": {"g": storage[4:8]}}, 0.5)
    collected = UploadCollector(presum=False, weight_scale={0: 1.0}, read_only_slot="shared")
    collected.add(upload)
    [on_host] = collected.on_host()
    mixed, other = on_host.tensors["shared"]["w"], on_host.tensors["relevance"]["g"]
    assert isinstance(on_host.tensors["shared"], ReadOnlyTensors)
    assert not isinstance(on_host.tensors["relevance"], ReadOnlyTensors)
    assert mixed.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()  # no copy: Ray ships its bytes
    assert other.untyped_storage().nbytes() == other.nbytes and torch.equal(other, storage[4:8])
    assert torch.equal(mixed, storage[:4])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_payload_crosses_to_the_gpu_and_uploads_back_with_their_values_each_upload_tensor_its_own():
    payload, _ = _mixed_payload()
    on_gpu = _OnDevice({0: payload}, torch.device("cuda"))[0]
    uploads = [Upload(cid, 1, {"shared": dict(on_gpu)}, torch.tensor(0.5 + cid, device="cuda")) for cid in range(2)]
    to_host(uploads)
    for upload in uploads:
        assert upload.train_loss == 0.5 + upload.client_id
        for name, value in payload.items():
            assert on_gpu[name].is_cuda and on_gpu[name].dtype == value.dtype and on_gpu[name].shape == value.shape
            back = upload.tensors["shared"][name]
            assert back.device.type == "cpu" and back.dtype == value.dtype and torch.equal(back, value), name
            assert back.untyped_storage().nbytes() == back.nbytes, name


def test_an_actor_reads_a_rounds_losses_after_its_last_client_has_trained(monkeypatch):
    """Reading a loss waits for the device; read between clients, the GPU would idle while the host sets up
    the next one."""
    events: list[str] = []

    class Recorded(torch.Tensor):
        def __float__(self) -> float:
            events.append("read")
            return super().__float__()

    host, shared = _tiny_host()
    update = host.method.local_update

    def recording_update(client, state, payload):
        result = update(client, state, payload)
        assert isinstance(result.train_loss, torch.Tensor) and result.train_loss.dim() == 0
        events.append(f"update {client.client_id}")
        return dataclasses.replace(result, train_loss=result.train_loss.as_subclass(Recorded))

    monkeypatch.setattr(host.method, "local_update", recording_update)
    part = host.train_round(0, [0, 1, 2], {cid: shared for cid in (0, 1, 2)}, {cid: 1.0 for cid in (0, 1, 2)})
    assert events == ["update 0", "update 1", "update 2", "read", "read", "read"]
    assert all(type(loss) is float and loss > 0 for loss in part.train_losses.values())
    reference = _tiny_host()[0]._context(1, 0).train(shared)
    assert part.train_losses[1] == float(reference.loss)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_states_kept_on_the_host_train_on_the_gpu_for_the_round_and_come_back_as_if_kept_there():
    rounds = {}
    for client_state in ("host", "device"):
        config = dataclasses.replace(WORKLOAD, method="ditto").config(3, 0, client_state=client_state)
        host = ClientActor(config.to_dict(), [0, 1, 2])
        shared = host.start_method(0)
        uploads = host.train_round(0, [0, 2], {0: shared, 2: shared}, {0: 1.0, 2: 1.0}).uploads
        rounds[client_state] = host, uploads
    (on_host, host_uploads), (on_device, device_uploads) = rounds["host"], rounds["device"]
    assert on_host.device.type == "cuda" and on_host.state_device.type == "cpu"
    for cid in (0, 2):
        for slot, values in on_device.states[cid].items():
            for name, value in values.items():
                kept = on_host.states[cid][slot][name]
                assert kept.device.type == "cpu" and torch.equal(kept, value.cpu())
    for host_upload, device_upload in zip(host_uploads, device_uploads, strict=True):
        for slot, values in device_upload.tensors.items():
            assert all(torch.equal(host_upload.tensors[slot][name], value) for name, value in values.items())


def test_cuda_graphs_take_any_optimizer_schedule_and_clipping():
    config = WORKLOAD.config(clients_per_actor=3, gpus_per_actor=0)
    for optimizer in ("sgd", "adam", "adamw"):
        taken = load_config(config, ["train.cuda_graphs=true", f"train.optimizer={optimizer}", "train.grad_clip=1.0",
                                     "train.schedule=round_warmup"]).train
        assert taken.cuda_graphs and taken.optimizer == optimizer and taken.schedule == "round_warmup"


def test_sgd_from_a_zeroed_momentum_buffer_takes_a_fresh_sgds_first_step_exactly():
    """What a replayed SGD step relies on: its optimizer state is zeroed for each train call, not emptied."""
    torch.manual_seed(0)
    start, grads = torch.randn(5, 7), [torch.randn(5, 7) for _ in range(3)]
    params = []
    for zeroed in (False, True):
        param = start.clone().requires_grad_(True)
        optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9, weight_decay=0.01, foreach=True)
        if zeroed:
            optimizer.state[param]["momentum_buffer"] = torch.zeros_like(param)
        for grad in grads:
            param.grad = grad.clone()
            optimizer.step()
        params.append(param.detach())
    assert torch.equal(params[0], params[1])


def test_train_autocast_is_bf16_by_default_and_names_its_values_when_unknown():
    config = WORKLOAD.config(clients_per_actor=3, gpus_per_actor=0)
    assert config.train.autocast == "bf16"
    raw = config.to_dict()
    raw["train"]["autocast"] = "fp16"
    with pytest.raises(ConfigError, match=r"train.autocast = 'fp16' is invalid: Input should be 'bf16' or 'off'"):
        ClientActor(raw, [0])
    for written in ("off", "'off'", "false"):  # YAML reads an unquoted off as False
        assert load_config(config, [f"train.autocast={written}"]).train.autocast == "off"
    with pytest.raises(ConfigError, match=r"train.autocast = True is invalid: Input should be 'bf16' or 'off'"):
        load_config(config, ["train.autocast=on"])


@pytest.mark.parametrize("cudnn_attention", [False, True])
def test_an_actor_lets_attention_use_cudnn_only_when_train_cudnn_attention_says_so(cudnn_attention):
    # A process-wide switch of torch's (each ClientActor is a process of its own on Ray): put back after the test.
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(not cudnn_attention)
    try:
        assert WORKLOAD.config(clients_per_actor=3, gpus_per_actor=0).train.cudnn_attention is False
        _tiny_host(cudnn_attention=cudnn_attention)
        assert torch.backends.cuda.cudnn_sdp_enabled() is cudnn_attention
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_mixed_precision_is_bf16_autocast_on_a_gpu_unless_train_autocast_is_off(monkeypatch):
    # A CPU-only torch disables a CUDA autocast as it is built; let it build one as on a GPU, without entering it.
    monkeypatch.setattr(torch.cuda.amp.common, "amp_definitely_not_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    gpu = torch.device("cuda")
    bf16 = precision.mixed_precision(gpu, "bf16")
    assert bf16.device == "cuda" and bf16._enabled and bf16.fast_dtype == torch.bfloat16
    assert not precision.mixed_precision(gpu, "off")._enabled
    assert not precision.mixed_precision(torch.device("cpu"), "bf16")._enabled


@pytest.mark.parametrize("autocast", ["bf16", "off"])
def test_train_autocast_reaches_every_training_step_and_evaluation(monkeypatch, autocast):
    from rayfed.training import scoring
    from rayfed.training.plans import eager

    seen = []

    def recorded(device, autocast, cache_enabled=True):
        seen.append(autocast)
        return precision.mixed_precision(device, autocast, cache_enabled)

    for module in (eager, scoring):
        monkeypatch.setattr(module, "mixed_precision", recorded)
    host, start = _tiny_host(autocast=autocast)
    client = host._context(0, 0)
    client.train(start)
    trained = len(seen)
    client.evaluate(start)
    assert 0 < trained < len(seen) and set(seen) == {autocast}


def test_train_autocast_off_refuses_a_model_stored_in_bf16_on_a_gpu():
    config = WORKLOAD.config(clients_per_actor=3, gpus_per_actor=0).train
    off = config.model_copy(update={"autocast": "off"})
    model = torch.nn.Linear(2, 2)
    gpu = torch.device("cuda")
    precision.check_precision(model, off, gpu, "methods[0] (fedavg)")  # float32 weights: float32 steps
    model.to(torch.bfloat16)
    precision.check_precision(model, config, gpu, "methods[0] (fedavg)")
    precision.check_precision(model, off, torch.device("cpu"), "methods[0] (fedavg)")
    with pytest.raises(ConfigError, match=r"train.autocast = 'off' .* methods\[0\] \(fedavg\) stores weights in "
                                          "bfloat16 on a GPU.*must be 'bf16'"):
        precision.check_precision(model, off, gpu, "methods[0] (fedavg)")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_graphed_step_trains_like_the_eager_one_and_each_client_starts_afresh():
    eager, eager_start = _host(cuda_graphs=False)
    graphed, graphed_start = _host(cuda_graphs=True)
    for name, value in eager_start.items():
        assert torch.equal(value, graphed_start[name])
    first = graphed._context(0, 0).train(graphed_start)
    graphed._context(1, 0).train(graphed_start)
    again = graphed._context(0, 0).train(graphed_start)  # the same graph, its optimizer state zeroed
    assert len(step_plans(graphed.model).graphed_step.graphs) == 1
    reference = eager._context(0, 0).train(eager_start)
    assert float(again.loss) == float(first.loss)
    # bf16 kernels picked under capture may round differently; a wrong step (lr, state, batch) is far larger
    assert float(first.loss) == pytest.approx(float(reference.loss), rel=1e-3)
    for name, value in reference.params.items():
        assert torch.equal(again.params[name], first.params[name])
        update = value - graphed_start[name].cuda()
        # Adam turns near-zero gradients (LoRA's A while B is zero) into full-size steps of either sign, so
        # compare the whole update (6% apart on an H100): a wrong lr, state or batch changes it by its own size
        assert update.norm() > 0 and (first.params[name] - value).norm() < 0.15 * update.norm(), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_graphed_sgd_step_with_momentum_trains_like_a_fresh_eager_sgd_in_each_call():
    train = {"optimizer": "sgd", "momentum": 0.9, "weight_decay": 0.01, "lr": 0.05, "autocast": "off"}
    eager, start = _tiny_host(**train)
    graphed, _ = _tiny_host(cuda_graphs=True, **train)
    first = graphed._context(0, 0).train(start)
    graphed._context(1, 0).train(start)
    again = graphed._context(0, 0).train(start)  # the same graph, its momentum buffers zeroed
    assert len(step_plans(graphed.model).graphed_step.graphs) == 1
    reference = eager._context(0, 0).train(start)
    for name, value in reference.params.items():
        assert torch.equal(again.params[name], first.params[name])
        update = value - start[name].cuda()
        # float32: a momentum buffer carried over from the previous call would move the update by about its size
        assert update.norm() > 0 and (first.params[name] - value).norm() < 1e-3 * update.norm(), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("capture", ["torch.cuda.graph", "capturing"])
def test_after_a_capture_fails_dropout_draws_eagerly_and_an_earlier_graph_that_draws_still_replays(capture):
    """A forward that reads a value back to the host cannot be captured; its step then trains eagerly. Left as
    torch.cuda.graph leaves it, the device's generator would stay in capture mode and both of these would raise.
    The parts' own capture (graph_capture.capturing: no device-wide synchronize first) is left the same way."""
    device = torch.device("cuda")
    stream = torch.cuda.current_stream(device)
    ones = torch.ones(4096, device=device)

    def graph(into: torch.cuda.CUDAGraph):
        if capture == "capturing":
            return graph_capture.capturing(into, torch.cuda.graph_pool_handle(), torch.cuda.Stream(device))
        return torch.cuda.graph(into)

    earlier = torch.cuda.CUDAGraph()
    with graph(earlier):
        kept = torch.nn.functional.dropout(ones, 0.5)
    with pytest.raises(RuntimeError):
        with graph_capture.eager_after_a_failed_capture(device), graph(torch.cuda.CUDAGraph()):
            torch.nn.functional.dropout(ones, 0.5)
            float(ones.sum())  # a host read: not allowed under capture
    assert torch.cuda.current_stream(device) == stream
    eager = torch.nn.functional.dropout(ones, 0.5)
    earlier.replay()
    first = kept.clone()
    earlier.replay()
    assert 0 < int((eager == 0).sum()) < len(ones)
    assert not torch.equal(kept, first)  # each replay draws anew


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_model_whose_step_was_captured_is_freed_with_its_actor():
    import gc
    import weakref

    host, start = _host(cuda_graphs=True)
    host._context(0, 0).train(start)
    assert len(step_plans(host.model).graphed_step.graphs) == 1
    model = weakref.ref(host.model)
    del host
    gc.collect()
    assert model() is None  # the graph its step plan keeps in the model's attachments held no reference to it


def _shifted(values: dict[str, torch.Tensor], by: float) -> dict[str, torch.Tensor]:
    return {name: value + by for name, value in values.items()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_graphed_step_with_a_proximal_term_trains_like_the_eager_one_for_each_clients_anchor():
    eager, start = _host(cuda_graphs=False)
    graphed, _ = _host(cuda_graphs=True)
    anchors = [_shifted(start, 0.5), _shifted(start, -0.5)]  # far enough for the term to move the update
    results = [graphed._context(0, 0).train(start, extra_loss=training.proximal_penalty(anchor, 1.0))
               for anchor in anchors]
    assert len(step_plans(graphed.model).graphed_step.graphs) == 1  # one graph, each call's anchor copied into it
    for anchor, result in zip(anchors, results):
        reference = eager._context(0, 0).train(start, extra_loss=training.proximal_penalty(anchor, 1.0))
        assert float(result.loss) == pytest.approx(float(reference.loss), rel=1e-3)  # bf16 kernels, as above
        for name, value in reference.params.items():
            update = value - start[name].cuda()
            assert (result.params[name] - value).norm() < 0.15 * update.norm(), name
    gap = sum(float((results[0].params[n] - results[1].params[n]).norm()) for n in start)
    assert gap > 0  # the second anchor reached the graph


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_graphed_step_clips_follows_the_schedule_and_feeds_a_recorded_loss_like_the_eager_one():
    # A clip this tight scales every gradient below Adam's eps, so that clipping moves the update by its own size.
    schedule = {"grad_clip": 1e-7, "schedule": "round_warmup", "warmup_rounds": 4, "warmup_start_lr": 1e-3}
    eager, start = _tiny_host(optimizer="adamw", lr=1e-2, **schedule)
    graphed, _ = _tiny_host(optimizer="adamw", lr=1e-2, cuda_graphs=True, **schedule)
    for round_idx in (1, 3):  # two rates, one graph
        recorders = _TaskLosses(), _TaskLosses()
        reference = eager._context(0, round_idx).train(start, loss=recorders[0])
        result = graphed._context(0, round_idx).train(start, loss=recorders[1])
        assert len(step_plans(graphed.model).graphed_step.graphs) == 1
        assert float(result.loss) == pytest.approx(float(reference.loss), rel=1e-3)  # bf16 kernels, as above
        recorded = [float(loss) for _, losses in recorders[1].seen for loss in losses]
        # bf16 logits: about 1e-3 apart; another step's batch is several percent away
        assert recorded == pytest.approx([float(loss) for _, losses in recorders[0].seen for loss in losses], rel=5e-3)
        assert len(set(recorded)) == len(recorded) == WORKLOAD.local_steps  # each step's own loss, not the last one
        for name, value in reference.params.items():
            update = value - start[name].cuda()
            assert update.norm() > 0 and (result.params[name] - value).norm() < 0.15 * update.norm(), name
    unclipped = _tiny_host(optimizer="adamw", lr=1e-2, **{**schedule, "grad_clip": None})[0]._context(0, 3).train(start)
    assert any((unclipped.params[n] - reference.params[n]).norm() > (reference.params[n] - start[n].cuda()).norm()
               for n in start)  # the clipping took part


def test_a_task_whose_part_cannot_be_captured_is_not_tried_again_and_its_calls_train_eagerly(monkeypatch):
    """A part whose capture fails (its forward reads a value back to the host) would fail for every row count:
    its task is not tried again, and a call holding it trains eagerly; the other tasks' parts still replay."""
    from types import SimpleNamespace

    tried = []

    class Part:  # stands for a capture: fails for task 1
        def __init__(self, forward, task, batch, total, config, owner):
            tried.append((task.index, len(batch["x"])))
            if task.index == 1:
                raise RuntimeError("operation not permitted when stream is capturing")
            self.reached = frozenset()

    monkeypatch.setattr(graph_capture, "_GraphedPart", Part)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("pool", len(tried)))
    host, _ = _tiny_host()
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: None)  # after the imports that annotate with it
    model, config = host.model, host.config.train
    parts = graph_capture.GraphedParts({"w": torch.zeros(3)})
    first, second = SimpleNamespace(index=0, name="a"), SimpleNamespace(index=1, name="b")

    def capture(*wanted: tuple[SimpleNamespace, int]) -> bool:
        batches = [(task, {"x": torch.zeros(rows, 2)}, 4) for task, rows in wanted]
        keys = [parts.key(model, *part) for part in batches]
        return parts.capture(model, config, keys, {k: part for k, part in zip(keys, batches) if k not in parts.parts})

    assert capture((first, 2))
    pool = parts.pool
    assert not capture((first, 1), (second, 3))
    assert parts.pool != pool  # the failed capture's pool is left behind
    assert not capture((second, 2))
    assert capture((first, 2), (first, 1))
    assert tried == [(0, 2), (0, 1), (1, 3)]  # neither task 1 again nor a part captured before


def test_the_parts_of_a_task_read_their_rows_from_one_copy_of_its_inputs(monkeypatch):
    """A graph per row count, one static copy of a task's micro-batch inputs: each part reads its first rows."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: None)
    parts = graph_capture.GraphedParts({"w": torch.zeros(3)})
    task, other = SimpleNamespace(index=0), SimpleNamespace(index=1)
    rows = torch.arange(12.0).reshape(6, 2)
    three, two = parts.static_rows(task, {"x": rows[:3]}, 6), parts.static_rows(task, {"x": rows[3:5]}, 6)
    assert three["x"].data_ptr() == two["x"].data_ptr() and torch.equal(two["x"], rows[3:5])
    assert torch.equal(three["x"][2], rows[2])  # past the rows the later copy wrote
    elsewhere = [parts.static_rows(other, {"x": rows[:2]}, 6), parts.static_rows(task, {"x": rows[:2]}, 4),
                 parts.static_rows(task, {"x": rows[:2].long()}, 6)]  # another task, micro-batch size, dtype
    assert len({view["x"].data_ptr() for view in elsewhere} | {two["x"].data_ptr()}) == 4


def test_a_step_is_captured_only_with_declared_losses_and_terms_at_the_calls_rate():
    from rayfed.training.plans.graphed_step import captures_step

    config = WORKLOAD.config(clients_per_actor=3, gpus_per_actor=0).train.model_copy(update={"cuda_graphs": True})
    gpu, start = torch.device("cuda"), {"w": torch.ones(3)}
    declared = training.proximal_penalty(start, 0.1)
    assert isinstance(declared, penalties.TensorPenalty)
    assert captures_step(config, gpu, [Phase()]) and captures_step(config, gpu, [Phase(extra_loss=declared)])
    assert not captures_step(config, torch.device("cpu"), [Phase()])
    assert not captures_step(config.model_copy(update={"cuda_graphs": False}), gpu, [Phase()])
    assert captures_step(config, gpu, [Phase(loss=_TaskLosses(), extra_loss=declared)])  # a declared recording loss
    own = CapturedLoss(lambda step: step.task_loss(), key=("own", 1.0))
    # Phases with their own trained sets and declared losses: each phase's optimizer over its own tensors.
    for phases in ([Phase(trains=["w"])], [Phase(), Phase()], [Phase(loss=own)],
                   [Phase(trains=["w"], loss=own), Phase(trains=lambda name: name != "w", loss=own)]):
        assert captures_step(config, gpu, phases), phases
    for phases in ([Phase(extra_loss=lambda params: params["w"].sum())],  # undeclared: eager
                   [Phase(loss=lambda step: step.task_loss())], [Phase(lr=0.1)], [Phase(lr_of=lambda name: None)],
                   [Phase(loss=own), Phase(loss=lambda step: step.task_loss())],
                   [Phase(extra_loss=declared), Phase()],  # a penalty is captured with one phase only
                   [Phase(loss=_TaskLosses()), Phase()]):
        assert not captures_step(config, gpu, phases), phases


class _TaskLosses(training.RecordedTaskLoss):
    """Keeps each micro-batch's part losses and row counts."""

    def __init__(self):
        self.seen: list[tuple[list[int], list[torch.Tensor]]] = []

    def record(self, step, losses):
        self.seen.append(([len(batch["labels"]) for _, batch in step.parts], [loss.detach() for loss in losses]))


def test_a_recorded_task_loss_trains_as_the_task_loss_and_sees_every_steps_losses():
    host, start = _tiny_host(optimizer="adamw", lr=1e-2)
    plain = host._context(0, 1).train(start)
    recorder = _TaskLosses()
    recorded = host._context(0, 1).train(start, loss=recorder)
    assert all(torch.equal(recorded.params[name], plain.params[name]) for name in start)
    steps = WORKLOAD.local_steps
    assert [rows for rows, _ in recorder.seen] == [[WORKLOAD.batch_size]] * steps
    assert float(sum(losses[0] for _, losses in recorder.seen) / steps) == pytest.approx(float(plain.loss), rel=1e-6)

    class Unrecorded(training.RecordedTaskLoss):  # a recording loss must say what it keeps
        pass

    with pytest.raises(TypeError, match="abstract method 'record'|abstract methods? record"):
        Unrecorded()


def test_a_steps_learning_rate_follows_the_schedule_only_in_a_local_update():
    from rayfed.training.steps import step_lr

    config = WORKLOAD.config(clients_per_actor=3, gpus_per_actor=0).train
    warmup = config.model_copy(update={"schedule": "round_warmup", "warmup_rounds": 4, "warmup_start_lr": 0.01})
    assert step_lr(warmup, 0.05, 2, 6, 3, "train") == pytest.approx(0.03)  # halfway from 0.01 to 0.05
    assert step_lr(warmup, 0.05, 9, 6, 3, "train") == 0.05
    assert step_lr(warmup, 0.05, 2, 6, 3, "post_train") == 0.05  # another purpose keeps its given rate
    assert step_lr(config, 0.05, 2, 6, 3, "train") == 0.05
    cosine = config.model_copy(update={"schedule": "warmup_cosine", "warmup_steps": 4, "decay_steps": 20})
    assert [step_lr(cosine, 1.0, 0, 6, step, "train") for step in range(2)] == [0.25, 0.5]
    assert step_lr(cosine, 1.0, 1, 6, 0, "train") == pytest.approx(0.5 * (1 + math.cos(math.pi * 2 / 16)))


def test_a_tensor_penalty_is_a_function_of_its_arguments_and_its_graph_key_holds_what_a_capture_bakes_in():
    anchor = {"w": torch.ones(3)}
    penalty = training.proximal_penalty(anchor, 0.1)
    params = {"w": torch.full((3,), 3.0, requires_grad=True)}
    assert float(penalty(params)) == pytest.approx(0.5 * 0.1 * 3 * 2.0**2)
    assert penalty.key() == training.proximal_penalty({"w": torch.zeros(3)}, 0.1).key()  # values: refilled
    assert penalty.key() != training.proximal_penalty(anchor, 0.2).key()  # a number baked into the graph
    assert penalty.key() != training.proximal_penalty({"w": torch.ones(4)}, 0.1).key()
    strength = 0.1
    with pytest.raises(TypeError, match="closes over variables"):
        penalties.TensorPenalty(lambda params, inputs: strength * params["w"].sum(), {})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_without_a_gpu_cuda_graphs_train_eagerly_to_the_same_numbers():
    eager, eager_start = _host(cuda_graphs=False)
    graphed, graphed_start = _host(cuda_graphs=True)
    reference, result = eager._context(1, 2).train(eager_start), graphed._context(1, 2).train(graphed_start)
    assert float(result.loss) == float(reference.loss)
    for name, value in reference.params.items():
        assert torch.equal(result.params[name], value)


PLAIN = [Phase()]


def _as_client(model, config, data, task) -> SimpleNamespace:
    """What a graph is looked up by: a client's model, training config, data and current task."""
    return SimpleNamespace(model=model, train_config=config, data=data, tasks={task.index: task}, task=task.index)


def test_an_actor_keeps_the_most_recently_used_graphs_one_per_trained_set_task_and_batch_shape(monkeypatch):
    captured = []

    class CountingStep:  # stands in for a captured graph: counts captures and optimizer resets
        def __init__(self, client, named, config, batch, task, phases, penalty=None):
            self.shape, self.resets = tuple(batch["pixel_values"].shape), 0
            captured.append(self)

        def reset_optimizers(self):
            self.resets += 1

        def load_penalty(self, penalty):
            pass

    monkeypatch.setattr(graphed_step_plan, "GraphedStep", CountingStep)
    host, _ = _host(cuda_graphs=False)
    config, model = host.config.train, host.model
    named = dict(model.named_parameters())
    part = host.data[0].parts[0]
    small = ClientData([TaskData(0, {name: column[:5] for name, column in part.train.items()}, part.test)])
    task0, task1 = host.tasks[0], dataclasses.replace(host.tasks[0], index=1)
    graph = step_plans(model).graphed_step.graph
    first = graph(_as_client(model, config, host.data[0], task0), named, PLAIN)
    assert graph(_as_client(model, config, host.data[1], task0), named, PLAIN) is first and first.resets == 2
    assert first.shape[0] == config.batch_size
    assert graph(_as_client(model, config, small, task0), named, PLAIN).shape[0] == 5  # a batch of all 5
    graph(_as_client(model, config, host.data[0], task1), named, PLAIN)
    clipped = config.model_copy(update={"grad_clip": 1.0})  # clipping is captured with the step
    graph(_as_client(model, clipped, host.data[0], task0), named, PLAIN)
    assert len(captured) == 4 and len(step_plans(model).graphed_step.graphs) == graphed_step_plan.MAX_GRAPHS_PER_MODEL
    graph(_as_client(model, config, host.data[0], task0), named, PLAIN)  # used last: stays
    decayed = config.model_copy(update={"weight_decay": 0.1})
    graph(_as_client(model, decayed, host.data[0], task0), named, PLAIN)  # a fifth: the batch-5 graph goes
    assert len(captured) == 5 and first in step_plans(model).graphed_step.graphs.values()
    assert all(step.shape[0] != 5 for step in step_plans(model).graphed_step.graphs.values())
    other_rate = config.model_copy(update={"schedule": "round_warmup", "lr": 0.5})  # a step sets its rate
    assert graph(_as_client(model, other_rate, host.data[0], task0), named, PLAIN) is first and len(captured) == 5
    # A method's captured loss: a graph per key, whatever closure carries it; a phase's own trained set too.
    client = _as_client(model, config, host.data[0], task0)
    own = graph(client, named, [Phase(loss=CapturedLoss(lambda step: step.task_loss(), key=("own", 0.5)))])
    assert own is not first and len(captured) == 6
    assert graph(client, named, [Phase(loss=CapturedLoss(lambda step: 2 * step.task_loss(), key=("own", 0.5)))]) is own
    graph(client, named, [Phase(loss=CapturedLoss(lambda step: step.task_loss(), key=("own", 0.7)))])
    graph(client, named, [Phase(trains=list(named)[:1])])
    assert len(captured) == 8


def test_a_step_captured_under_bf16_autocast_is_not_replayed_with_train_autocast_off(monkeypatch):
    captured = []

    class RecordedStep:  # stands in for a captured graph: records the autocast it was captured under
        def __init__(self, client, named, config, batch, task, phases, penalty=None):
            captured.append(config.autocast)

        def reset_optimizers(self):
            pass

        def load_penalty(self, penalty):
            pass

    monkeypatch.setattr(graphed_step_plan, "GraphedStep", RecordedStep)
    host, _ = _host(cuda_graphs=False)
    named, off = dict(host.model.named_parameters()), host.config.train.model_copy(update={"autocast": "off"})
    graph = step_plans(host.model).graphed_step.graph
    for config in (host.config.train, off, host.config.train, off):
        graph(_as_client(host.model, config, host.data[0], host.tasks[0]), named, PLAIN)
    assert captured == ["bf16", "off"]


def test_a_step_that_cannot_be_captured_trains_eagerly_with_one_warning(monkeypatch, caplog):
    attempts = []

    def failing_capture(*args):
        attempts.append(args)
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(graphed_step_plan, "GraphedStep", failing_capture)
    host, _ = _host(cuda_graphs=False)
    named, graph = dict(host.model.named_parameters()), step_plans(host.model).graphed_step.graph
    with caplog.at_level("WARNING", logger="rayfed.training"):
        for cid in (0, 1):
            assert graph(_as_client(host.model, host.config.train, host.data[cid], host.tasks[0]), named, PLAIN) is None
    assert len(attempts) == 1
    [record] = caplog.records
    assert "could not be captured" in record.getMessage() and "stream is capturing);" in record.getMessage()


# The training hook: losses over the batch and other parameter views, phases, accumulation, state --------
def _tiny_host(**train) -> tuple[ClientActor, dict[str, torch.Tensor]]:
    config = WORKLOAD.config(clients_per_actor=3, gpus_per_actor=0).to_dict()
    config["train"].update(train)
    host = ClientActor(config, [0, 1, 2])
    return host, host.start_method(0)


def test_a_kl_term_to_a_frozen_teacher_view_leaves_the_teacher_untouched():
    host, start = _tiny_host()
    client = host._context(0, 0)
    teacher = {name: value + 0.1 for name, value in start.items()}  # another parameter set of the same model
    kept = {name: value.clone() for name, value in teacher.items()}

    def loss_with_kd(step: training.Step) -> torch.Tensor:
        student = step.outputs()
        with_teacher = step.forward(teacher)
        assert not with_teacher.requires_grad  # no graph through the teacher's values
        return step.task_loss() + training.distillation_loss(student, with_teacher, temperature=2.0)

    result = client.train(start, loss=loss_with_kd)
    assert all(torch.equal(teacher[name], kept[name]) for name in teacher)
    assert all(value.grad is None for value in teacher.values())
    plain = host._context(0, 0).train(start)
    assert any(not torch.equal(result.params[n], plain.params[n]) for n in start)  # the KD term took part


def test_distillation_is_tau_squared_kl_from_teacher_to_student_per_sample():
    student, teacher = torch.randn(3, 5), torch.randn(3, 5)
    p_teacher = torch.softmax(teacher / 2, -1)
    expected = 4 * (p_teacher * (p_teacher.log() - torch.log_softmax(student / 2, -1))).sum(-1).mean()
    assert training.distillation_loss(student, teacher, 2.0).item() == pytest.approx(expected.item(), rel=1e-5)
    assert training.distillation_loss(teacher, teacher, 3.0).item() == pytest.approx(0.0, abs=1e-6)


def test_phases_take_one_optimizer_step_each_over_their_own_parameters():
    host, start = _tiny_host(optimizer="sgd", lr=0.1)
    head = {name for name in start if name.startswith("head.")}
    seen = []

    def remember(step: training.Step) -> torch.Tensor:
        seen.append((step.phase, step.index, "logits" in step.memory))  # phase 1 sees what phase 0 kept
        step.memory.setdefault("logits", step.outputs().detach())
        return step.task_loss()

    lora_then_head = [training.Phase(trains=lambda n: n not in head, loss=remember), training.Phase(trains=head, loss=remember)]
    host._context(0, 0).train(start, steps=2, phases=lora_then_head)
    assert seen == [(0, 0, False), (1, 0, True), (0, 1, False), (1, 1, True)]  # two sequential updates per batch
    both = host._context(0, 0).train(start, steps=1, phases=lora_then_head)
    # by hand: a LoRA step from the start, then a head step from the new LoRA and the old head, on the same batch
    lora_step = host._context(0, 0).train(start, steps=1, phases=[training.Phase(trains=lambda n: n not in head)])
    assert all(torch.equal(lora_step.params[n], start[n]) for n in head)
    moved = {**lora_step.params, **{n: start[n] for n in head}}
    head_step = host._context(0, 0).train(moved, steps=1, phases=[training.Phase(trains=head)])
    assert all(torch.equal(both.params[n], head_step.params[n]) for n in start)
    assert all(not torch.equal(both.params[n], start[n]) for n in head)


def test_gradient_accumulation_over_two_micro_batches_is_one_step_on_both():
    host, start = _tiny_host(optimizer="sgd", lr=0.1, batch_size=4)
    accumulated = host._context(1, 3)
    accumulated.train_config = accumulated.train_config.model_copy(update={"grad_accum": 2})
    double = host._context(1, 3)
    double.train_config = double.train_config.model_copy(update={"batch_size": 8})
    a, b = accumulated.train(start, steps=1), double.train(start, steps=1)
    assert all(torch.allclose(a.params[n], b.params[n], atol=1e-6) for n in start)
    assert float(a.loss) == pytest.approx(float(b.loss), rel=1e-5)


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_a_cpu_optimizer_steps_every_tensor_at_once_to_bitwise_the_per_tensor_steps(optimizer):
    config = WORKLOAD.config(clients_per_actor=3, gpus_per_actor=0).train.model_copy(
        update={"optimizer": optimizer, "momentum": 0.9 if optimizer == "sgd" else 0.0, "weight_decay": 0.01})
    per_tensor = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[optimizer]
    generator = torch.Generator().manual_seed(0)
    shapes = [(4, 64), (64, 4), (64,), (10, 64)]
    start = [torch.randn(shape, generator=generator) for shape in shapes]
    grads = [[torch.randn(shape, generator=generator) * scale for shape in shapes] for scale in (1.0, 1e-3, 1e-6)]
    ours, theirs = ([torch.nn.Parameter(value.clone()) for value in start] for _ in range(2))
    stepped = training.build_optimizer(config, ours, 3e-3)
    reference = per_tensor(theirs, lr=3e-3, weight_decay=0.01, foreach=False,
                           **({"momentum": 0.9} if optimizer == "sgd" else {}))
    assert stepped.defaults["foreach"]
    for step_grads in grads:
        for params, optim in ((ours, stepped), (theirs, reference)):
            for param, grad in zip(params, step_grads):
                param.grad = grad.clone()
            optim.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_optimizer_state_is_kept_across_calls_when_asked():
    host, start = _tiny_host()
    first = host._context(0, 0).train(start, steps=2, keep_optimizer_state=True)
    state = first.optimizer_state
    assert state and all(key.startswith("0/") for key in state)
    assert {key.rsplit("/", 1)[1] for key in state} == {"step", "exp_avg", "exp_avg_sq"}
    assert all(float(value) == 2.0 for key, value in state.items() if key.endswith("/step"))
    resumed = host._context(0, 1).train(first.params, steps=1, optimizer_state=state, keep_optimizer_state=True)
    fresh = host._context(0, 1).train(first.params, steps=1)
    assert all(float(v) == 3.0 for k, v in resumed.optimizer_state.items() if k.endswith("/step"))
    assert any(not torch.equal(resumed.params[n], fresh.params[n]) for n in start)


def test_the_parameters_after_k_steps_of_a_longer_call_are_bitwise_a_call_of_k_steps():
    host, start = _tiny_host(grad_clip=1.0)

    def dropped_out(step: training.Step) -> torch.Tensor:  # draws dropout masks: the seeded stream must line up
        outputs = torch.nn.functional.dropout(step.outputs(), 0.5)
        return step.task.kind.loss(outputs, step.batch)

    long = host._context(0, 2).train(start, steps=6, purpose="post_train", loss=dropped_out, snapshot_steps=[2, 6])
    assert sorted(long.snapshots) == [2, 6]
    short = host._context(0, 2).train(start, steps=2, purpose="post_train", loss=dropped_out)
    assert all(torch.equal(long.snapshots[2][n], short.params[n]) for n in start)
    assert all(torch.equal(long.snapshots[6][n], long.params[n]) for n in start)
    assert any(not torch.equal(long.snapshots[2][n], long.params[n]) for n in start)
    views = post_train_views(host._context(0, 2), start, microbatches=3, lr=1e-3, multiples=(1, 2))
    one_by_one = {k: host._context(0, 2).train(start, steps=k * 3, lr=1e-3, purpose="post_train").params
                  for k in (1, 2)}
    assert all(torch.equal(views["view:pt"][n], one_by_one[1][n]) for n in start)
    assert all(torch.equal(views["view:pt2"][n], one_by_one[2][n]) for n in start)
    with pytest.raises(ValueError, match="snapshot_steps"):
        host._context(0, 2).train(start, steps=2, snapshot_steps=[3])


def test_the_round_warmup_schedule_rises_linearly_over_rounds_then_stays():
    from rayfed.config import TrainConfig

    config = TrainConfig(schedule="round_warmup", warmup_rounds=20, warmup_start_lr=1e-4, lr=3e-4)
    lrs = [training.scheduled_lr(config, 3e-4, r, 0) for r in (0, 10, 20, 50)]
    assert lrs == pytest.approx([1e-4, 2e-4, 3e-4, 3e-4])


def test_a_compiled_step_trains_like_the_eager_one_and_compiles_once_for_every_client():
    from torch._inductor import config as inductor_config

    eager, eager_start = _host(cuda_graphs=False)
    config = dataclasses.replace(WORKLOAD, compile=True).config(clients_per_actor=3, gpus_per_actor=0)
    compiled = ClientActor(config.to_dict(), [0, 1, 2])
    compiled_start = compiled.start_method(0)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with inductor_config.patch(compile_threads=1):  # no pool of compile workers on 2 cores
        results = [compiled._context(cid, 0).train(compiled_start) for cid in (0, 1, 2)]
        frames = torch._dynamo.utils.counters["frames"]["ok"]
        compiled._context(0, 1).train(compiled_start)  # another client and round: the same compiled code
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames > 0
    assert any(isinstance(module, training.PatchMatmul) for module in compiled.model.modules())
    for cid, result in zip((0, 1, 2), results):
        reference = eager._context(cid, 0).train(eager_start)
        assert float(result.loss) == pytest.approx(float(reference.loss), rel=1e-5)
        for name, value in reference.params.items():
            update = value - eager_start[name]
            assert (result.params[name] - value).norm() <= 1e-4 * update.norm() + 1e-7, name


def test_a_forward_that_fails_to_compile_trains_eagerly_after_one_warning(monkeypatch, caplog):
    calls = []

    def failing_compile(model, **options):
        def compiled(*args, **kwargs):
            calls.append(args)
            raise torch._dynamo.exc.TorchDynamoException("cannot trace this\nmore detail")
        return compiled

    eager, start = _host(cuda_graphs=False)
    config = dataclasses.replace(WORKLOAD, compile=True).config(clients_per_actor=3, gpus_per_actor=0)
    compiled = ClientActor(config.to_dict(), [0, 1, 2])
    compiled_start = compiled.start_method(0)
    monkeypatch.setattr(torch, "compile", failing_compile)
    with caplog.at_level("WARNING", logger="rayfed.training.compiled_forward"):
        results = [compiled._context(cid, 0).train(compiled_start) for cid in (0, 1)]
    assert len(calls) == 1  # tried once, then the model itself
    [record] = caplog.records
    assert record.getMessage().endswith("could not be compiled (TorchDynamoException: cannot trace this); it trains "
                                        "eagerly.")
    for cid, result in zip((0, 1), results):  # the eager update, up to the patch product's round-off
        reference = eager._context(cid, 0).train(start)
        for name, value in reference.params.items():
            update = value - start[name]
            assert (result.params[name] - value).norm() <= 1e-4 * update.norm() + 1e-7, name


def test_a_forward_compiled_in_pieces_says_where_once(monkeypatch, caplog):
    from torch._dynamo.utils import counters

    def breaking_compile(model, **options):
        def compiled(*args, **kwargs):
            counters["graph_break"]["a value read back to the host\nmore detail"] += 1
            return model(*args, **kwargs)
        return compiled

    config = dataclasses.replace(WORKLOAD, compile=True).config(clients_per_actor=3, gpus_per_actor=0)
    host = ClientActor(config.to_dict(), [0, 1])
    start = host.start_method(0)
    monkeypatch.setattr(torch, "compile", breaking_compile)
    counters.clear()
    with caplog.at_level("WARNING", logger="rayfed.training.compiled_forward"):
        for cid in (0, 1):
            host._context(cid, 0).train(start)
    [record] = caplog.records
    assert "compiles in pieces, with the code at 1 place(s) running eagerly between them (a value read back to the " \
           "host)." in record.getMessage()


@pytest.mark.parametrize("bias", [False, True])
def test_a_patch_convolution_as_a_matrix_product_equals_the_convolution(bias):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 12, kernel_size=4, stride=4, bias=bias)
    reference = torch.nn.Conv2d(3, 12, kernel_size=4, stride=4, bias=bias)
    reference.load_state_dict(conv.state_dict())
    assert training.PatchMatmul.replaces(conv)
    conv.__class__ = training.PatchMatmul
    for shape in [(2, 3, 16, 16), (1, 3, 18, 13)]:  # the second leaves pixels past the last whole patch
        images = torch.randn(shape)
        expected = reference(images)
        assert conv(images).shape == expected.shape
        torch.testing.assert_close(conv(images), expected, rtol=1e-5, atol=1e-5)
    assert list(conv.state_dict()) == list(reference.state_dict())


def test_only_convolutions_over_non_overlapping_patches_become_matrix_products():
    assert not training.PatchMatmul.replaces(torch.nn.Conv2d(3, 8, kernel_size=3, stride=1))
    assert not training.PatchMatmul.replaces(torch.nn.Conv2d(3, 8, kernel_size=4, stride=4, padding=1))
    assert not training.PatchMatmul.replaces(torch.nn.Conv2d(4, 8, kernel_size=4, stride=4, groups=2))
    assert not training.PatchMatmul.replaces(torch.nn.Conv2d(3, 8, kernel_size=4, stride=2))
    assert training.PatchMatmul.replaces(torch.nn.Conv2d(3, 8, kernel_size=(2, 4), stride=(2, 4)))


def _two_text_tasks_host() -> tuple[ClientActor, dict[str, torch.Tensor]]:
    """One client holding two text-generation tasks on the tiny LLaVA: colors answered with the color alone and counts
    as "Answer: <count>" (targets of other lengths)."""
    def task(name: str, question: str, answer_only: bool) -> dict:
        return {"name": name, "source": "task-groups:vqa", "kind": "text_generation", "clients": [0],
                "partition": {"name": "iid"}, "max_text_length": 28,
                "options": {"group": 0, "num_samples": 20, "question_types": [question], "styles": ["noisy"],
                            "answer_only": answer_only}}

    config = {"name": "two-tasks", "seed": 3,
              "data": {"tasks": [task("colors", "color", True), task("counts", "count", False)]},
              "model": {"backbone": "tiny-pretrained:llava", "lora": {"rank": 4, "alpha": 8}},
              "federation": {"rounds": 1, "clients_per_round": 1},
              "train": {"local_steps": 2, "batch_size": 8, "eval_batch_size": 64}, "methods": ["fedavg"],
              "placement": {"executor": "local"}}
    host = ClientActor(config, [0])
    return host, host.start_method(0)


def test_a_clients_tasks_that_share_the_forward_train_stacked_with_the_losses_and_gradients_of_one_forward_each():
    host, start = _two_text_tasks_host()
    client = host._context(0, 0)
    client.model.load_trainable(start)
    named = {name: p for name, p in client.model.named_parameters() if name in start}
    parts = client.micro_batch(next(client.batch_order(1, "train", None)))
    assert len(parts) == 2 and training.stacked_forward_batch(client.model, parts) is not None
    step = training.Step(client, parts, named, 0, 0, {})

    def losses_and_grads(losses: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        for param in named.values():
            param.grad = None
        sum(losses).backward()
        return [loss.detach() for loss in losses], {name: p.grad.clone() for name, p in named.items()}

    stacked, stacked_grads = losses_and_grads(step.part_losses())
    one_each, one_each_grads = losses_and_grads(step.part_losses([step.outputs(i) for i in range(len(parts))]))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(stacked, one_each))
    for name, grad in one_each_grads.items():
        assert torch.allclose(stacked_grads[name], grad, rtol=1e-4, atol=1e-6), name


def test_a_clients_text_generation_tasks_are_scored_in_one_pass_with_each_tasks_own_metrics(monkeypatch):
    host, start = _two_text_tasks_host()
    client = host._context(0, 0)
    client.model.load_trainable(start)
    client.model.eval()
    one_each = {}
    for part in client.data.parts:
        task = client.tasks[part.task]
        select_task(client.model, part.task)
        with torch.no_grad():
            scorer = Scorer(client.model, client.tasks, client.device, client.train_config.eval_batch_size,
                            client.train_config.autocast)
            one_each[task.name] = task.kind.summarize(*scorer.score(task, part.test))
    widths = {part.test["target_ids"].shape[1] for part in client.data.parts}
    assert len(widths) == 2  # the tasks' answers differ in length: the merged set pads them
    calls = []
    generate = kinds.generate
    monkeypatch.setattr(kinds, "generate", lambda *args, **kwargs: calls.append(1) or generate(*args, **kwargs))
    metrics = client.evaluate(start)
    assert len(calls) == 1  # both test sets (fewer rows than eval_batch_size) in one batch of generations
    for name, values in one_each.items():
        for metric, value in values.items():
            merged = metrics[f"{name}/local_{metric}"]
            assert merged == pytest.approx(value, rel=1e-5) if metric == "perplexity" else merged == value, metric


def test_a_models_module_lists_are_kept_across_a_slice_of_its_layers_and_made_again_after_a_registration():
    """HF's decoders run ``self.layers[:n]`` at every forward, which registers each layer into a new ModuleList: that
    changes no model, so the lists select_task and shares_forward walk for stay kept; a module registered into the
    model makes them again."""
    from torch import nn

    from rayfed.models.module_walks import modules_of_type

    model = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2), nn.ReLU()]))
    kept = modules_of_type(model, (nn.Linear,))
    assert len(kept) == 2
    model[1][:1]  # what a forward of HF's decoders does
    nn.Sequential(nn.Linear(2, 2))  # a model built elsewhere
    assert modules_of_type(model, (nn.Linear,)) is kept
    model[1].append(nn.Linear(2, 2))
    assert len(modules_of_type(model, (nn.Linear,))) == 3
