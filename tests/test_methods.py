"""Method invariants, checked in-process on a ClientActor (plain Python, no Ray)."""

from __future__ import annotations

import pytest
import torch

from rayfed.actors.client import ClientActor
from rayfed.aggregation import EachUpload, presums
from rayfed.config import load_config
from rayfed.method import Method, PartialSum, Upload, mean_as, presum, weighted_mean
from rayfed.types import ReadOnlyTensors, states_to, tensors_to
from conftest import method_class


def _actor(tiny_run: dict, methods: list, **train) -> ClientActor:
    tiny_run["methods"] = methods
    tiny_run["train"].update(optimizer="sgd", **train)
    return ClientActor(load_config(tiny_run).to_dict(), [0, 1])


def test_local_uploads_nothing_and_fedavg_uploads_every_trainable_parameter(tiny_run):
    actor = _actor(tiny_run, ["local", "fedavg"])
    assert actor.start_method(0) == {}
    [local_upload] = actor.train(0, [0], {0: None})
    assert local_upload.tensors == {} and local_upload.nbytes == 0

    shared = actor.start_method(1)
    assert set(shared) == set(actor.model.trainable_names())
    assert any("lora_A" in n for n in shared) and "head.weight" in shared
    assert not any("lora" not in n and not n.startswith("head.") for n in shared)
    [fedavg_upload] = actor.train(0, [0], {0: shared})
    assert set(fedavg_upload.tensors["shared"]) == set(shared)


def test_training_never_changes_the_frozen_backbone(tiny_run):
    actor = _actor(tiny_run, ["fedavg"])
    shared = actor.start_method(0)
    frozen = {n: p.clone() for n, p in actor.model.named_parameters() if not p.requires_grad}
    actor.train(0, [0, 1], {0: shared, 1: shared})
    after = dict(actor.model.named_parameters())
    assert all(torch.equal(after[n], value) for n, value in frozen.items())
    assert set(frozen).isdisjoint(shared)


def test_ditto_personal_update_includes_the_proximal_term(tiny_run):
    """One SGD step: v' = v - lr * (grad CE(v) + lam * (v - w_global)), so lam=L minus lam=0 is -lr*L*(v - w)."""
    lam, lr = 2.0, 0.05
    actor = _actor(
        tiny_run, [{"name": "ditto", "lam": lam, "personal_steps": 1}, {"name": "ditto", "lam": 0.0, "label": "d0", "personal_steps": 1}],
        lr=lr, local_steps=1,
    )
    personal_after = {}
    for index in (0, 1):
        initial = actor.start_method(index)
        global_weights = {n: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) for n, v in initial.items()}
        actor.train(0, [0], {0: global_weights})
        personal_after[index] = actor.states[0]["personal_model"]
    for name, v0 in initial.items():
        expected = -lr * lam * (v0 - global_weights[name])
        assert torch.allclose(personal_after[0][name] - personal_after[1][name], expected, atol=1e-6), name
    assert any(not torch.allclose(personal_after[0][n], personal_after[1][n]) for n in initial)


def test_ditto_evaluates_the_personal_model_and_uploads_the_global_one(tiny_run):
    actor = _actor(tiny_run, [{"name": "ditto", "lam": 0.1}])
    initial = actor.start_method(0)
    [upload] = actor.train(0, [0], {0: initial})
    personal = actor.states[0]["personal_model"]
    assert any(not torch.equal(upload.tensors["shared"][n], personal[n]) for n in initial)
    assert actor.method.eval_params(actor.states[0], initial) is personal


def test_fedprox_penalty_pulls_toward_the_global_model(tiny_run):
    actor = _actor(tiny_run, [{"name": "fedprox", "mu": 0.0}, {"name": "fedprox", "mu": 50.0, "label": "strong"}], lr=0.01)
    distances = []
    for index in (0, 1):
        start = actor.start_method(index)
        [upload] = actor.train(0, [0], {0: start})
        distances.append(sum(((upload.tensors["shared"][n] - v) ** 2).sum().item() for n, v in start.items()))
    assert distances[1] < distances[0]


def test_weighted_mean_is_sample_weighted_and_order_independent():
    a = Upload(2, 30, {"shared": {"w": torch.tensor([1.0, 0.0])}}, 0.0)
    b = Upload(0, 10, {"shared": {"w": torch.tensor([0.0, 4.0])}}, 0.0)
    forward, backward = weighted_mean([a, b], "shared"), weighted_mean([b, a], "shared")
    assert torch.equal(forward["w"], backward["w"])
    assert torch.allclose(forward["w"], torch.tensor([0.75, 1.0]))


def test_each_tensor_is_averaged_over_the_uploads_that_contain_it_and_the_rest_keep_their_value():
    a = Upload(0, 10, {"shared": {"w": torch.tensor([1.0]), "head_a": torch.tensor([2.0])}}, 0.0)
    b = Upload(1, 30, {"shared": {"w": torch.tensor([5.0]), "head_b": torch.tensor([8.0])}}, 0.0)
    mean = weighted_mean([a, b], "shared")
    assert mean == {"w": torch.tensor([4.0]), "head_a": torch.tensor([2.0]), "head_b": torch.tensor([8.0])}
    server = {"global": {"w": torch.zeros(1), "head_a": torch.zeros(1), "head_b": torch.zeros(1), "head_c": torch.ones(1)}}
    assert method_class("fedavg")().aggregate(server, [a, b])["global"]["head_c"] == torch.ones(1)


def test_partial_sums_from_actors_give_the_same_float32_mean_as_every_upload():
    generator = torch.Generator().manual_seed(0)
    # values spread over many orders of magnitude and signs, as trained parameters are
    uploads = [
        Upload(cid, int(torch.randint(5, 500, (1,), generator=generator)),
               {"shared": {"w": torch.randn(4096, generator=generator) * 10.0 ** torch.randint(-8, 3, (4096,), generator=generator)}},
               0.0, weight_scale=0.5 if cid == 3 else 1.0)
        for cid in range(8)
    ]
    expected = weighted_mean(uploads, "shared")
    for groups in ([list(range(8))], [[0, 1, 2, 3], [4, 5, 6, 7]], [[0], [1, 2], [3, 4, 5, 6], [7]],
                   [[7, 0], [3, 1, 6], [2, 5, 4]]):
        partials = [presum([uploads[cid] for cid in group]) for group in groups]
        sent = [p.tensors["shared"]["w"].clone() for p in partials]
        got = weighted_mean(partials, "shared")
        assert got["w"].dtype == torch.float32 and torch.equal(got["w"], expected["w"])
        # the first partial sum starts the driver's sum without a copy and must not be written to
        assert all(torch.equal(p.tensors["shared"]["w"], before) for p, before in zip(partials, sent))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_a_mean_rounds_once_from_float64_as_dividing_then_casting_does(dtype):
    total = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 1e3
    mean = mean_as(total, 7.0, dtype)
    assert mean.dtype == dtype and torch.equal(mean, (total / 7.0).to(dtype))


def test_pre_summing_is_what_each_method_declares_and_the_old_flag_is_refused_in_one_sentence():
    class CountsUploads(Method):
        aggregation = EachUpload()

        def aggregate(self, server, uploads):
            return server

    assert presums(method_class("fedavg")().aggregation) and presums(method_class("ditto")().aggregation)
    assert not presums(method_class("feddyn")().aggregation) and not presums(CountsUploads().aggregation)
    assert not presums(method_class("fedmosaic")().aggregation)
    with pytest.raises(TypeError, match=r"^Legacy sets presums_uploads, which rayfed no longer reads: declare "
                                        r"aggregation = rayfed\.WeightedMean\(\) instead of True, or "
                                        r"rayfed\.EachUpload\(\) instead of False\.$"):
        type("Legacy", (Method,), {"presums_uploads": False})
    with pytest.raises(TypeError, match=r"^Unbatched sets batchable_updates, which rayfed no longer reads: a method "
                                        r"whose hook .* runs with train\.batch_clients: 1 instead of False\.$"):
        type("Unbatched", (Method,), {"batchable_updates": False})
    with pytest.raises(TypeError, match="Method.aggregation is a bool; it must be a rayfed.aggregation WeightedMean"):
        presums(True)


@pytest.mark.parametrize("packing", [[0], [0, 1]])
def test_a_client_trains_the_same_whichever_actor_hosts_it(tiny_run, packing):
    reference = _actor(tiny_run, ["fedavg"])
    start = reference.start_method(0)
    [expected] = reference.train(5, [0], {0: start})
    tiny_run["placement"]["clients_per_actor"] = len(packing)
    other = ClientActor(load_config(tiny_run).to_dict(), packing)
    other.start_method(0)
    [got] = other.train(5, [0], {0: start})
    assert all(torch.equal(got.tensors["shared"][n], v) for n, v in expected.tensors["shared"].items())


@pytest.mark.parametrize("method", ["fedavg", "ditto"])
def test_an_actors_running_partial_sum_equals_the_presum_of_its_clients_uploads(tiny_run, method):
    reference, actor = _actor(tiny_run, [method]), _actor(tiny_run, [method])
    shared = reference.start_method(0)
    actor.start_method(0)
    payloads, scale = {0: shared, 1: shared}, {0: 1.0, 1: 0.3}
    uploads = reference.train(4, [0, 1], payloads)
    for upload in uploads:
        upload.weight_scale = scale[upload.client_id]
    expected = presum(uploads)
    part = actor.train_round(4, [1, 0], payloads, scale)  # summed in client-id order whatever the order given
    [got] = part.uploads
    assert (got.client_id, got.num_samples, got.weight_sums, got.dtypes) == (
        expected.client_id, expected.num_samples, expected.weight_sums, expected.dtypes)
    assert got.tensors.keys() == expected.tensors.keys() == {"shared"}
    assert isinstance(got.tensors, ReadOnlyTensors)  # received as views of the object store's copy
    for name, value in expected.tensors["shared"].items():
        assert value.dtype == torch.float64 and got.tensors["shared"][name].device.type == "cpu"
        assert torch.equal(got.tensors["shared"][name], value)
    assert part.train_losses == {u.client_id: u.train_loss for u in uploads}
    assert part.up_bytes == sum(u.nbytes for u in uploads)
    [timing] = actor.round_times
    assert timing["round"] == 4 and 0 < timing["update_s"] <= timing["end"] - timing["start"]


def test_a_partial_sum_takes_uploads_in_increasing_client_order_only():
    partial = PartialSum()
    partial.add(Upload(3, 10, {"shared": {"w": torch.ones(2)}}, 0.0))
    with pytest.raises(ValueError, match="client 1 after client 3"):
        partial.add(Upload(1, 10, {"shared": {"w": torch.ones(2)}}, 0.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_partial_sum_made_on_the_gpu_is_bitwise_the_one_made_on_the_host():
    generator = torch.Generator().manual_seed(1)
    uploads = [
        Upload(cid, 17 + cid, {"shared": {"w": torch.randn(4096, generator=generator) * 10.0 ** torch.randint(-8, 3, (4096,), generator=generator)}},
               0.0, weight_scale=0.3 if cid == 2 else 1.0)
        for cid in range(6)
    ]
    on_gpu = [Upload(u.client_id, u.num_samples, {"shared": {"w": u.tensors["shared"]["w"].cuda()}}, 0.0, u.weight_scale)
              for u in uploads]
    assert torch.equal(presum(on_gpu).tensors["shared"]["w"].cpu(), presum(uploads).tensors["shared"]["w"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_tensors_moved_to_the_host_in_one_copy_per_dtype_keep_their_values_shapes_and_dtypes():
    generator = torch.Generator().manual_seed(2)
    tensors = {"a": torch.randn(3, 5, generator=generator), "b": torch.randn(7, generator=generator, dtype=torch.float64),
               "c": torch.randn(2, 2, 2, generator=generator), "on_host": torch.arange(4), "d": torch.randn(0, 3)}
    moved = tensors_to({name: value if name == "on_host" else value.cuda() for name, value in tensors.items()}, "cpu")
    assert list(moved) == list(tensors)
    for name, value in tensors.items():
        assert moved[name].device.type == "cpu" and moved[name].dtype == value.dtype
        assert torch.equal(moved[name], value)


def test_states_moved_together_move_a_tensor_they_share_once_and_keep_what_is_there():
    initial = torch.ones(4)  # the initial parameters clients hold until they first train
    states = {0: {"personal": {"w": initial}}, 1: {"personal": {"w": initial, "b": torch.zeros(2)}}, 2: {}}
    moved = states_to(states, "meta")
    assert list(moved) == [0, 1, 2] and moved[2] == {}
    assert moved[0]["personal"]["w"] is moved[1]["personal"]["w"] and moved[0]["personal"]["w"].device.type == "meta"
    again = states_to(moved, "meta")
    assert all(again[cid]["personal"][n] is moved[cid]["personal"][n] for cid in (0, 1) for n in moved[cid]["personal"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_states_cross_to_the_gpu_and_back_with_their_values_each_client_in_its_own_host_buffer():
    generator = torch.Generator().manual_seed(3)
    initial = torch.randn(5, 3, generator=generator)
    states = {cid: {"personal": {"w": initial if cid == 0 else torch.randn(5, 3, generator=generator),
                                 "step": torch.tensor(cid), "h": torch.randn(7, generator=generator).bfloat16()},
                    "empty": {"e": torch.zeros(0, 2)}} for cid in range(3)}
    on_gpu = states_to(states, "cuda")
    back = states_to(on_gpu, "cpu")
    for cid, state in states.items():
        for slot, values in state.items():
            for name, value in values.items():
                assert on_gpu[cid][slot][name].is_cuda
                got = back[cid][slot][name]
                assert got.device.type == "cpu" and got.dtype == value.dtype and torch.equal(got, value)
    first, second = (back[cid]["personal"]["w"] for cid in (1, 2))
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr() and not first.is_pinned()
