"""rayfed.transport: host tensors sent through Ray as raw bytes come back equal, as their own writable copies (a
ReadOnlyTensors' as views of the object store's copy)."""

from __future__ import annotations

import pytest
import ray
import torch

from rayfed import transport
from rayfed.actors.uploads import RoundUploads, SlotSender, UploadCollector, fetch_sent_slots
from rayfed.method import Upload
from rayfed.types import ReadOnlyTensors

PLAIN = {
    "float32": torch.randn(3, 4),
    "transposed": torch.arange(12.0).reshape(3, 4).t(),
    "bfloat16": torch.randn(5).to(torch.bfloat16),
    "float64 scalar": torch.tensor(2.5, dtype=torch.float64),
    "empty": torch.zeros(0, 3),
    "bool": torch.tensor([True, False, True]),
    "int64": torch.arange(-3, 4),
}


@pytest.mark.parametrize("name", PLAIN)
def test_a_plain_host_tensor_travels_as_raw_bytes_and_comes_back_equal(name):
    tensor = PLAIN[name]
    packed = transport._to_bytes(tensor)
    assert packed[0] == "raw"
    got = transport._from_bytes(packed)
    assert (got.dtype, got.shape, got.requires_grad) == (tensor.dtype, tensor.shape, False)
    assert torch.equal(got, tensor)
    if tensor.numel():
        assert got.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()  # a copy of its own


def test_tensors_that_need_more_than_their_bytes_keep_torchs_own_pickling():
    leaf = torch.randn(4, requires_grad=True)
    sparse = torch.eye(3).to_sparse()
    for tensor in (leaf, sparse):
        packed = transport._to_bytes(tensor)
        assert packed[0] == "torch"
        got = transport._from_bytes(packed)
        assert got.requires_grad == tensor.requires_grad and got.layout == tensor.layout
        assert torch.equal(got.detach().to_dense(), tensor.detach().to_dense())


@pytest.fixture
def raw_transport(ray_local, monkeypatch):
    """The raw transport registered in this process, on a local Ray; yields the tensors it packs."""
    sent, original = [], transport._to_bytes
    monkeypatch.setattr(transport, "_to_bytes", lambda tensor: sent.append(tensor) or original(tensor))
    transport.use_raw_tensor_transport()
    yield sent
    ray.util.deregister_serializer(torch.Tensor)
    ray.util.deregister_serializer(ReadOnlyTensors)


def test_through_the_object_store_a_payload_comes_back_equal_and_writable(raw_transport):
    shared = torch.randn(64, 32)
    payload = {0: {"w": shared, "b": torch.zeros(32)}, 1: {"w": shared}}  # one tensor in two clients' payloads
    got = ray.get(ray.put(payload))
    assert len(raw_transport) == 2  # each distinct tensor once, through the raw path
    assert torch.equal(got[0]["w"], shared) and torch.equal(got[0]["b"], torch.zeros(32))
    assert got[1]["w"] is got[0]["w"]
    got[0]["w"].add_(1.0)  # the object store's buffer is read-only; the tensor received is not
    assert torch.equal(got[1]["w"], shared + 1.0)


def test_read_only_tensors_arrive_as_views_of_the_object_stores_one_copy(raw_transport):
    shared = torch.randn(512, 512)  # large enough to go to the object store, not inline
    payloads = ReadOnlyTensors({0: {"w": shared, "b": torch.arange(3.0, dtype=torch.float64)}, 1: {"w": shared},
                                2: None, 3: {"scalar": torch.tensor(True), "empty": torch.zeros(0, 4)}})
    ref = ray.put(payloads)
    got, again = ray.get(ref), ray.get(ref)
    assert len(raw_transport) == 4  # each distinct tensor once
    assert isinstance(got, ReadOnlyTensors) and list(got) == [0, 1, 2, 3] and got[2] is None
    for cid, tensors in payloads.items():
        for name, value in (tensors or {}).items():
            received = got[cid][name]
            assert (received.dtype, received.shape) == (value.dtype, value.shape) and torch.equal(received, value)
    assert got[1]["w"] is got[0]["w"]
    assert got[0]["w"].data_ptr() == again[0]["w"].data_ptr()  # not a copy each: views of the stored one


def test_a_mixtures_slot_of_a_round_arrives_as_views_and_the_other_slots_as_copies(raw_transport):
    """What an actor sends a mixture's server (UploadCollector's ``read_only_slot``): the slot the server copies into
    its rows crosses as views of the object store's copy, one pass less over every client's upload."""
    collected = UploadCollector(presum=False, weight_scale={0: 1.0}, read_only_slot="shared")
    collected.add(Upload(0, 4, {"shared": {"w": torch.randn(512, 512)}, "relevance": {"g": torch.randn(512, 512)}},
                         torch.tensor(0.5)))
    [upload] = collected.on_host()
    ref = ray.put(RoundUploads([upload], 0, 0, {0: 0.5}))
    [got], [again] = ray.get(ref).uploads, ray.get(ref).uploads
    assert torch.equal(got.tensors["shared"]["w"], upload.tensors["shared"]["w"])
    assert torch.equal(got.tensors["relevance"]["g"], upload.tensors["relevance"]["g"])
    assert got.tensors["shared"]["w"].data_ptr() == again.tensors["shared"]["w"].data_ptr()
    assert got.tensors["relevance"]["g"].data_ptr() != again.tensors["relevance"]["g"].data_ptr()


def test_a_sent_slot_goes_into_the_object_store_as_its_client_finishes_and_the_server_fetches_views(raw_transport):
    """With a SlotSender (a mixture's actor on Ray) each client's read-only slot is put into the object store on a
    thread while the next client trains; the round's uploads then carry its ObjectRef, which the server fetches."""
    put_before_round_end = []
    sender = SlotSender(lambda tensors: put_before_round_end.append(sorted(tensors)) or ray.put(tensors))
    collected = UploadCollector(presum=False, weight_scale={0: 1.0, 1: 1.0}, read_only_slot="shared", sender=sender)
    sent = {cid: {"w": torch.randn(512, 512), "b": torch.randn(3)} for cid in (0, 1)}
    for cid in (0, 1):
        collected.add(Upload(cid, 4, {"shared": sent[cid], "relevance": {"g": torch.randn(4)}}, torch.tensor(0.5)))
    collected.sending[1].result()  # both puts done before the round ends
    assert put_before_round_end == [["b", "w"], ["b", "w"]]
    uploads = collected.on_host()
    assert all(isinstance(upload.tensors["shared"], ray.ObjectRef) for upload in uploads)
    assert all(isinstance(upload.tensors["relevance"]["g"], torch.Tensor) for upload in uploads)
    assert collected.up_bytes == 2 * (512 * 512 + 3 + 4) * 4  # what the clients sent, counted as they came
    arrived = ray.get(ray.put(RoundUploads(uploads, 0, 0, {0: 0.5, 1: 0.5}))).uploads
    fetch_sent_slots(arrived)
    again = ray.get(uploads[0].tensors["shared"])
    for upload in arrived:
        assert isinstance(upload.tensors["shared"], ReadOnlyTensors)
        assert all(torch.equal(upload.tensors["shared"][name], sent[upload.client_id][name]) for name in ("w", "b"))
    assert arrived[0].tensors["shared"]["w"].data_ptr() == again["w"].data_ptr()  # views of the stored copy
