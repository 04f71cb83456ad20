"""The engine's per-client mixture (rayfed.aggregation.Mixture) on hand-made uploads: the rows it keeps, each client's
weighted sum of them, within an architecture and, for the groups a method names, across architectures."""

from __future__ import annotations

import ast
import copy

import pytest
import torch

from rayfed.actors import driver as driver_module
from rayfed.actors.client import RoundUploads
from rayfed.actors.driver import DriverActor, KnownFinite
from rayfed.aggregation import _MIX_COLUMNS, Mixture, _mixed
from rayfed.config import load_config
from rayfed.errors import ConfigError
from rayfed.method import Method, Upload, build_method
from rayfed.transport import _to_bytes

from test_plugins import ROOT, SHORT, numbers_at_packings

# Rows of exact binary fractions: every weighted sum below is exact in float32.
W = torch.tensor([[0.5, 0.25, 0.25], [0.0, 1.0, 0.0], [0.25, 0.25, 0.5]])


class FixedMixture(Method):
    """A mixture by the fixed matrix W; ``p`` and ``q`` form one group across architectures."""

    aggregation = Mixture(weights="mix/w", across=lambda names: {n: "pq" for n in names if n in ("p", "q")})

    def init_server(self, initial_shared):
        return {**super().init_server(initial_shared), "mix": {"w": W.clone()}}


# Clients 0, 1 of architecture a, client 2 of b.
TWO = {"a": {"clients": [0, 1], "backbone": "tiny:vit"}, "b": {"clients": [2], "backbone": "tiny:vit"}}


def _driver(tiny_run: dict, initial: dict[str, dict[str, torch.Tensor]], method: type = FixedMixture,
            on_nonfinite: str = "stop") -> DriverActor:
    """A driver of 3 clients running ``method`` from ``initial`` (per architecture: ``""`` alone, or a and b)."""
    run = copy.deepcopy(tiny_run)
    run["data"]["num_clients"] = 3
    run["methods"] = [{"name": method}]
    run["federation"]["on_nonfinite"] = on_nonfinite
    if "" not in initial:
        run["architectures"] = TWO
    config = load_config(run)
    architecture_of = ["", "", ""] if "" in initial else ["a", "a", "b"]
    driver = DriverActor(config, [build_method(config.methods[0], 0, num_clients=3, architecture_of=architecture_of)])
    names = list(initial)
    driver.start_method(0, names, *initial.values(), *({} for _ in names))
    return driver


def _round(driver: DriverActor, uploads: dict[int, dict[str, torch.Tensor]],
           nonfinite: dict[str, list[int]] | None = None) -> dict:
    sent = [Upload(cid, 1, {"shared": tensors}, 0.0) for cid, tensors in uploads.items()]
    return driver.aggregate(RoundUploads(sent, 0, 0, {cid: 0.0 for cid in uploads}, nonfinite=nonfinite or {}))


def test_each_client_receives_its_row_of_w_times_the_latest_uploads(tiny_run):
    driver = _driver(tiny_run, {"": {"w": torch.zeros(2)}})
    x = {0: torch.tensor([4.0, -8.0]), 1: torch.tensor([2.0, 6.0]), 2: torch.tensor([16.0, 0.5])}
    before = driver.payloads([0, 1, 2], count_bytes=False)
    assert all(torch.equal(before[c]["w"], torch.zeros(2)) for c in range(3))  # every row at the initial value
    _round(driver, {c: {"w": x[c]} for c in range(3)})
    payloads = driver.payloads([0, 1, 2], count_bytes=False)
    for i in range(3):
        assert torch.equal(payloads[i]["w"], sum(W[i, j] * x[j] for j in range(3))), i
    assert torch.equal(driver.get_state()["stacks"]["w"], torch.stack([x[0], x[1], x[2]]))
    _round(driver, {1: {"w": torch.tensor([1.0, 1.0])}})  # only client 1 trains: the others' rows stay
    x[1] = torch.tensor([1.0, 1.0])
    payloads = driver.payloads([0, 1, 2], count_bytes=False)
    for i in range(3):
        assert torch.equal(payloads[i]["w"], sum(W[i, j] * x[j] for j in range(3))), i


def test_across_architectures_only_a_named_group_mixes_and_the_rest_mixes_within_renormalized(tiny_run):
    """``w`` (a: 2 wide, b: 3 wide) mixes within each architecture; ``p`` of a and ``q`` of b form one group over all
    three clients."""
    driver = _driver(tiny_run, {"a": {"w": torch.zeros(2), "p": torch.zeros(2)},
                                "b": {"w": torch.zeros(3), "q": torch.ones(2)}})
    before = driver.payloads([0], count_bytes=False)[0]["p"]
    assert torch.equal(before, torch.tensor([0.25, 0.25]))  # W_02 times b's initial q, the others' p being 0
    w = {0: torch.tensor([4.0, 8.0]), 1: torch.tensor([2.0, -2.0]), 2: torch.tensor([1.0, 2.0, 3.0])}
    pq = {0: torch.tensor([8.0, 0.0]), 1: torch.tensor([0.0, 4.0]), 2: torch.tensor([-4.0, 16.0])}
    _round(driver, {0: {"w": w[0], "p": pq[0]}, 1: {"w": w[1], "p": pq[1]}, 2: {"w": w[2], "q": pq[2]}})
    payloads = driver.payloads([0, 1, 2], count_bytes=False)
    assert set(payloads[0]) == set(payloads[1]) == {"w", "p"} and set(payloads[2]) == {"w", "q"}
    for i, shared in ((0, "p"), (1, "p"), (2, "q")):
        assert torch.equal(payloads[i][shared], sum(W[i, j] * pq[j] for j in range(3))), i
    # within a: client 0's weights 0.5 and 0.25 over a's clients, renormalized to 2/3 and 1/3
    assert torch.allclose(payloads[0]["w"], (2 * w[0] + w[1]) / 3)
    assert torch.equal(payloads[1]["w"], w[1])
    assert torch.equal(payloads[2]["w"], w[2])  # alone in b: its own row, whatever its weight on a's clients


def test_a_group_that_an_architecture_lacks_or_holds_in_another_shape_is_refused_in_one_sentence(tiny_run):
    with pytest.raises(ConfigError, match=r"^method 'FixedMixture' mixes group 'pq' across architectures, but "
                                          r"architecture 'a' has no tensor of it; every architecture needs one"):
        _driver(tiny_run, {"a": {"w": torch.zeros(2)}, "b": {"q": torch.zeros(2)}})
    with pytest.raises(ConfigError, match=r"its tensors have shapes \(2,\), \(3,\); every architecture needs"):
        _driver(tiny_run, {"a": {"p": torch.zeros(2)}, "b": {"q": torch.zeros(3)}})


def test_the_fedamp_example_gives_the_same_numbers_at_1_and_at_4_clients_per_actor(tmp_path, monkeypatch, capsys):
    """examples/fedamp.py, a user's mixture: the engine keeps every client's upload whatever the packing, so the
    attention and each client's cloud model, and every number, are the same with one client per actor or four."""
    overrides = [*SHORT, "federation.clients_per_round=3", "methods=[fedamp]", "placement.executor=local"]
    numbers = numbers_at_packings("fedamp.py", overrides, tmp_path, monkeypatch)
    assert numbers[0] == numbers[1]
    assert "fedamp: local_acc" in capsys.readouterr().out
    module = ast.parse((ROOT / "examples" / "fedamp.py").read_text())
    classes = [node for node in module.body if isinstance(node, ast.ClassDef)]
    assert sum(node.end_lineno - min(d.lineno for d in [node, *node.decorator_list]) + 1 for node in classes) <= 40


@pytest.mark.parametrize("width", [1, _MIX_COLUMNS - 1, _MIX_COLUMNS, _MIX_COLUMNS + 1, 3 * _MIX_COLUMNS + 7])
def test_a_stack_mixed_in_column_blocks_equals_one_float64_product_bitwise(width):
    torch.manual_seed(width)
    weights = torch.rand(4, 5, dtype=torch.float64)
    stack = torch.randn(5, width, 3)
    whole = (weights @ stack.flatten(1).double()).view(4, width, 3).float()
    assert torch.equal(_mixed(weights, stack), whole)


def test_a_payload_row_is_shipped_alone_not_with_its_stack(tiny_run):
    driver = _driver(tiny_run, {"": {"w": torch.zeros(64)}})
    _round(driver, {c: {"w": torch.full((64,), float(c))} for c in range(3)})
    row = driver.payloads([1], count_bytes=False)[1]["w"]
    assert torch.equal(row, sum(W[1, j] * torch.full((64,), float(j)) for j in range(3)))
    assert _to_bytes(row)[1].nbytes == 64 * 4  # what Ray sends: the row's bytes, not the stack's three rows


def test_payloads_mix_only_their_architectures_stacks_each_once_until_its_rows_or_the_weights_change(tiny_run,
                                                                                                    monkeypatch):
    from rayfed import aggregation

    mixed_rows = []

    def counted(weights, stack):
        mixed_rows.append(len(weights))  # a's within block is 2 x 2, b's 1 x 1, the group's 3 x 3
        return _mixed(weights, stack)

    monkeypatch.setattr(aggregation, "_mixed", counted)
    driver = _driver(tiny_run, {"a": {"w": torch.zeros(2), "p": torch.zeros(2)},
                                "b": {"w": torch.zeros(3), "q": torch.ones(2)}})
    driver.payloads([2], count_bytes=False)  # b's client first: b's w and the group, not a's w
    assert sorted(mixed_rows) == [1, 3]
    driver.payloads([0, 1], count_bytes=False)  # then a's w alone: the group is mixed already
    assert sorted(mixed_rows) == [1, 2, 3]
    _round(driver, {2: {"w": torch.ones(3), "q": torch.zeros(2)}})  # b's rows and the group's change, a's w stays
    mixed_rows.clear()
    after = driver.payloads([0, 1, 2], count_bytes=False)
    assert sorted(mixed_rows) == [1, 3]
    assert torch.equal(after[2]["w"], torch.ones(3)) and torch.equal(after[0]["p"], torch.zeros(2))
    driver.get_state()["mix"]["w"].mul_(1.0)  # the weights changed in place (same values, a new version)
    mixed_rows.clear()
    driver.payloads([0], count_bytes=False)
    assert sorted(mixed_rows) == [2, 3]


class InPlaceNaN(FixedMixture):
    """Sets its own mixing matrix to NaN in place at the second aggregation (the same tensor, a new version)."""

    def aggregate(self, server, uploads):
        self.rounds = getattr(self, "rounds", 0) + 1
        if self.rounds == 2:
            server["mix"]["w"].fill_(float("nan"))
        return server


def test_the_server_check_reads_only_what_is_not_known_finite_and_finds_what_a_full_check_finds(tiny_run,
                                                                                                 monkeypatch):
    read: list[list[str]] = []
    check = driver_module.largest_magnitudes

    def recorded(slots):
        read.append(sorted(f"{slot}/{name}" for slot, values in slots.items() for name in values))
        return check(slots)

    monkeypatch.setattr(driver_module, "largest_magnitudes", recorded)
    driver = _driver(tiny_run, {"": {"w": torch.zeros(2)}}, InPlaceNaN, on_nonfinite="warn")
    finite = {c: {"w": torch.ones(2)} for c in range(3)}
    assert "nonfinite" not in _round(driver, finite)
    assert read[-1] == ["mix/w", "stacks/w"]  # the first check reads everything
    stats = _round(driver, finite)  # the rows stored from finite uploads are known finite: not read again
    assert read[-1] == ["mix/w"] and list(stats["nonfinite"]) == ["server tensor 'mix/w'"]
    assert list(_round(driver, finite)["nonfinite"]) == ["server tensor 'mix/w'"]  # a NaN stays reported
    assert read[-1] == ["mix/w"]
    nan_upload = {0: {"w": torch.full((2,), float("nan"))}}
    stats = _round(driver, nan_upload, nonfinite={"upload tensor 'shared/w'": [0]})
    assert read[-1] == ["mix/w", "stacks/w"]  # a round with a non-finite upload reads the rows it stored
    assert set(stats["nonfinite"]) == {"upload tensor 'shared/w'", "server tensor 'mix/w'", "server tensor 'stacks/w'"}


def test_an_inference_tensor_which_has_no_version_is_read_at_every_check():
    known = KnownFinite()
    with torch.inference_mode():
        value = torch.ones(2)
    server = {"slot": {"x": value}}
    assert known.nonfinite_names(server) == []
    with torch.inference_mode():
        value.fill_(float("nan"))
    assert known.nonfinite_names(server) == ["slot/x"]
