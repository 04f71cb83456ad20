"""Trees of tensors in state slots (rayfed.state_tree): flattened to the names flat slots had, only for checkpoints
and transport, and rebuilt from them; checkpoints written before trees still load."""

import json

import pytest
import safetensors.torch
import torch

from rayfed.method import Method
from rayfed.results.checkpoint import load_checkpoint, save_checkpoint
from rayfed.state_tree import flatten_tree, map_levels, nested_paths, tree_at, unflatten_tree

from test_aggregation import _driver, _round


def _report() -> dict:
    return {"qwen": {"0": {"self_attn.q_proj": {"l2_before": torch.tensor(2.0), "l2_after": torch.tensor(1.0)}}},
            "llama": {"1": {"mlp.down_proj": {"l2_before": torch.tensor(3.0)}}}}


def test_a_tree_flattens_to_its_paths_joined_by_a_slash_and_back():
    tree = {"weights": torch.eye(2), **_report()}
    flat = flatten_tree(tree)
    assert list(flat) == ["weights", "qwen/0/self_attn.q_proj/l2_before", "qwen/0/self_attn.q_proj/l2_after",
                          "llama/1/mlp.down_proj/l2_before"]
    rebuilt = unflatten_tree(flat, nested_paths(tree))
    assert rebuilt.keys() == tree.keys()
    assert tree_at(rebuilt, ["qwen", "0", "self_attn.q_proj", "l2_after"]) is flat["qwen/0/self_attn.q_proj/l2_after"]
    assert unflatten_tree({"qwen/0": torch.zeros(1)}).keys() == {"qwen/0"}  # no recorded path: one flat name


def test_two_paths_that_join_to_one_name_are_refused():
    with pytest.raises(ValueError, match="'w/a'"):
        flatten_tree({"w/a": torch.zeros(1), "w": {"a": torch.ones(1)}})


def test_map_levels_maps_each_level_and_keeps_the_subtrees_names():
    tree = {"a.weight": 1, "control": {"a.weight": 2, "b.weight": 3}}
    mapped = map_levels(tree, lambda level: {name.upper(): value for name, value in level.items()})
    assert mapped == {"A.WEIGHT": 1, "control": {"A.WEIGHT": 2, "B.WEIGHT": 3}}


def _flat_checkpoint(root, server: dict, clients: dict) -> None:
    """A checkpoint as rayfed wrote it before trees: ``<slot>/<name>`` keys, no recorded paths."""
    round_dir = root / "m" / "round_3"
    round_dir.mkdir(parents=True)
    safetensors.torch.save_file({f"{slot}/{name}": value for slot, values in server.items()
                                 for name, value in values.items()}, round_dir / "server.safetensors")
    safetensors.torch.save_file({f"{cid}/{slot}/{name}": value for cid, state in clients.items()
                                 for slot, values in state.items() for name, value in values.items()},
                                round_dir / "clients.safetensors")
    meta = {"round": 3, "server_slots": sorted(server),
            "client_slots": {str(cid): sorted(state) for cid, state in clients.items()}}
    (round_dir / "meta.json").write_text(json.dumps(meta))
    (root / "m" / "latest.json").write_text(json.dumps({"round": 3, "dir": "round_3"}))


def test_a_checkpoint_written_before_trees_loads_flat_and_a_tree_saves_under_the_same_names(tmp_path):
    flat_alignment = flatten_tree(_report())  # the names FedMosaic's alignment report had, built as strings
    server = {"relevance": {"weights": torch.eye(2)}, "alignment": flat_alignment}
    clients = {0: {"personal": {"w": torch.ones(3)}}, 1: {"personal": {"w": torch.zeros(3)}}}
    _flat_checkpoint(tmp_path / "old", server, clients)
    old = load_checkpoint(tmp_path / "old", "m")
    assert old.round == 3 and old.server["alignment"].keys() == flat_alignment.keys()
    assert torch.equal(old.server["relevance"]["weights"], torch.eye(2))
    assert torch.equal(old.clients[1]["personal"]["w"], torch.zeros(3))

    nested = {**server, "alignment": _report()}
    save_checkpoint(tmp_path / "new", "m", 3, nested, clients, {})
    new_dir = tmp_path / "new" / "m" / "round_3"
    for part in ("server", "clients"):  # the same tensors under the same names as before trees
        before = safetensors.torch.load_file(tmp_path / "old" / "m" / "round_3" / f"{part}.safetensors")
        after = safetensors.torch.load_file(new_dir / f"{part}.safetensors")
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    loaded = load_checkpoint(tmp_path / "new", "m")
    assert torch.equal(loaded.server["alignment"]["llama"]["1"]["mlp.down_proj"]["l2_before"], torch.tensor(3.0))
    got, expected = flatten_tree(loaded.server), flatten_tree(nested)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


def test_a_client_slot_holding_a_tree_round_trips_through_a_checkpoint(tmp_path):
    clients = {4: {"history": {"w": {"text_generation": torch.tensor(1.5, dtype=torch.float64)},
                               "x": {"text_generation": torch.tensor(2.5, dtype=torch.float64)}},
                   "personal": {}}}
    save_checkpoint(tmp_path, "m", 1, {"global": {"w": torch.zeros(1)}}, clients, {})
    loaded = load_checkpoint(tmp_path, "m")
    assert float(loaded.clients[4]["history"]["x"]["text_generation"]) == 2.5
    assert loaded.clients[4]["history"]["w"]["text_generation"].dtype == torch.float64
    assert loaded.clients[4]["personal"] == {}


class SendsATree(Method):
    """FedAvg whose server keeps a tree and sends part of it as a tree of its own next to the parameters."""

    def init_server(self, initial_shared):
        control = {name: torch.full_like(value, 2.0) for name, value in initial_shared.items()}
        return {"global": initial_shared, "extra": {"control": control, "count": {"rounds": torch.zeros(())}}}

    def aggregate(self, server, uploads):
        extra = {**server["extra"], "count": {"rounds": server["extra"]["count"]["rounds"] + 1}}
        return {**super().aggregate(server, uploads), "extra": extra}

    def payload(self, server, client_id):
        return {**server["global"], "control": server["extra"]["control"]}


def test_a_payloads_tree_reaches_each_architecture_under_its_clients_names_and_a_server_tree_is_checked(tiny_run):
    driver = _driver(tiny_run, {"a": {"p": torch.ones(2)}, "b": {"p": torch.ones(3)}}, SendsATree)
    payloads = driver.payloads([0, 2])
    assert payloads[0].keys() == payloads[2].keys() == {"p", "control"}
    assert payloads[0]["control"].keys() == {"p"} and torch.equal(payloads[0]["control"]["p"], torch.full((2,), 2.0))
    assert torch.equal(payloads[2]["control"]["p"], torch.full((3,), 2.0))
    assert driver.down_params == 2 * 2 + 2 * 3  # the tree's tensors are counted with the parameters
    _round(driver, {0: {"p": torch.zeros(2)}})
    assert float(driver.server["extra"]["count"]["rounds"]) == 1.0 and torch.equal(driver.server["global"]["a/p"],
                                                                                   torch.zeros(2))
