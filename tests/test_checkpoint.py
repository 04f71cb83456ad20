from __future__ import annotations

import json

import torch

from rayfed.checkpoint import load_checkpoint, save_checkpoint


def test_round_trip_keeps_every_slot_including_empty_ones(tmp_path):
    server = {"global": {"head.weight": torch.randn(3, 2)}}
    clients = {0: {"personal": {}, "personal_model": {"head.weight": torch.randn(3, 2)}},
               7: {"personal": {}, "personal_model": {"head.weight": torch.randn(3, 2)}}}
    save_checkpoint(tmp_path, "ditto", 4, server, clients, {"counters": {"up_bytes": 10}})
    restored = load_checkpoint(tmp_path, "ditto")
    assert restored.round == 4 and restored.meta["counters"] == {"up_bytes": 10}
    assert torch.equal(restored.server["global"]["head.weight"], server["global"]["head.weight"])
    assert set(restored.clients) == {0, 7}
    for cid, state in clients.items():
        assert restored.clients[cid]["personal"] == {}
        assert torch.equal(restored.clients[cid]["personal_model"]["head.weight"], state["personal_model"]["head.weight"])


def test_a_newer_checkpoint_replaces_the_older_one_only_when_complete(tmp_path):
    state = {0: {"personal": {"w": torch.zeros(2)}}}
    save_checkpoint(tmp_path, "fedavg", 1, {}, state, {})
    save_checkpoint(tmp_path, "fedavg", 2, {}, {0: {"personal": {"w": torch.ones(2)}}}, {})
    assert json.loads((tmp_path / "fedavg" / "latest.json").read_text())["round"] == 2
    assert sorted(p.name for p in (tmp_path / "fedavg").glob("round_*")) == ["round_2"]
    assert torch.equal(load_checkpoint(tmp_path, "fedavg").clients[0]["personal"]["w"], torch.ones(2))


def test_no_checkpoint_is_none(tmp_path):
    assert load_checkpoint(tmp_path, "fedavg") is None
