"""What a method's hooks return is checked where the engine takes it: tensor shapes and dtypes against the tensors
they replace, and NaN or infinite losses, uploads, server tensors and metrics (``federation.on_nonfinite``)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from rayfed.results.checkpoint import load_checkpoint
from rayfed.config import load_config
from rayfed.errors import ConfigError
from rayfed.method import LocalResult, MethodOutputError, NonFiniteError, weighted_mean
from rayfed.methods.fedavg import FedAvg
from rayfed.methods.local import Local
from rayfed.simulation import Simulation, mean_std


def _broadcastable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor's mean over its first dimension, kept as a dimension of 1: a shape that broadcasts to the right one."""
    return {name: value.mean(dim=0, keepdim=True) for name, value in tensors.items()}


class WrongShapeAggregate(FedAvg):
    def aggregate(self, server, uploads):
        new = super().aggregate(server, uploads)
        return {**new, "global": _broadcastable(new["global"])}


class WrongShapePayload(FedAvg):
    def payload(self, server, client_id):
        return _broadcastable(server["global"])


class WrongShapeUpload(FedAvg):
    def local_update(self, client, state, payload):
        result = super().local_update(client, state, payload)
        result.upload = {"shared": _broadcastable(result.upload["shared"])}
        return result


class NaNFromRoundTwo(FedAvg):
    """FedAvg whose aggregate turns every global tensor into NaN from its second call (round 2) on."""

    def __init__(self, params=None):
        super().__init__(params)
        self.calls = 0

    def aggregate(self, server, uploads):
        self.calls += 1
        new = super().aggregate(server, uploads)
        if self.calls < 2:
            return new
        return {**new, "global": {name: torch.full_like(value, math.nan) for name, value in new["global"].items()}}


def _config(tiny_run: dict, method: type, **federation) -> dict:
    tiny_run["methods"] = [{"name": method, "label": "mine"}]
    tiny_run["placement"]["executor"] = "local"
    tiny_run["federation"].update(federation)
    return tiny_run


@pytest.mark.parametrize("method, hook", [(WrongShapeAggregate, r"hook aggregate, round 1"),
                                          (WrongShapePayload, r"hook payload, client \d, round 1"),
                                          (WrongShapeUpload, r"hook local_update, client \d, round 1")])
def test_a_hook_returning_a_broadcastable_wrong_shape_stops_the_run_naming_it(tiny_run, tmp_path, method, hook):
    with pytest.raises(MethodOutputError) as caught:
        Simulation(_config(tiny_run, method), out_dir=tmp_path, progress=False).run()
    message = str(caught.value)
    assert re.match(f"method 'mine', {hook}: tensor '", message)
    assert "has shape (1, " in message and "(float32), but " in message
    assert message.endswith(").") and "\n" not in message
    name = message.split("tensor '")[1].split("'")[0]
    model_name = name.removeprefix("global/")
    assert model_name in message and "of that name has shape (" in message
    assert not (tmp_path / "summary.json").exists()


def test_a_nan_aggregate_stops_the_run_and_keeps_the_last_good_checkpoint(tiny_run, tmp_path):
    config = _config(tiny_run, NaNFromRoundTwo, checkpoint_every=1, rounds=4)
    with pytest.raises(NonFiniteError) as caught:
        Simulation(config, out_dir=tmp_path, progress=False).run()
    message = str(caught.value)
    assert message.startswith("method 'mine' went non-finite in round 2: server tensor 'global/")
    assert "(clients " in message and "federation.on_nonfinite" in message
    checkpoint = load_checkpoint(tmp_path / "checkpoints", "mine")
    assert checkpoint.round == 1
    tensors = [v for values in checkpoint.server.values() for v in values.values()]
    tensors += [v for state in checkpoint.clients.values() for values in state.values() for v in values.values()]
    assert tensors and all(bool(torch.isfinite(v).all()) for v in tensors)
    rounds = [json.loads(line)["round"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(rounds) == 1  # nothing of round 2 was logged as if it were a result


def test_warn_runs_to_the_end_and_marks_the_nan_in_the_summary_and_report(tiny_run, tmp_path):
    config = _config(tiny_run, NaNFromRoundTwo, on_nonfinite="warn")
    with pytest.warns(RuntimeWarning, match="went non-finite") as warned:
        summary = Simulation(config, out_dir=tmp_path, progress=False).run()
    assert len([w for w in warned if "went non-finite" in str(w.message)]) == 1  # once per method
    result = summary["methods"]["mine"]
    clients = sorted(result["clients"], key=int)
    assert all(math.isnan(result["clients"][c]["local_loss"]) for c in clients)
    assert result["nonfinite"]["local_loss"] == [int(c) for c in clients]
    assert math.isnan(result["mean"]["local_loss"])  # no client has a finite loss: the mean is undefined, and marked
    rows = [line for line in (tmp_path / "report.md").read_text().splitlines() if line.startswith("| mine |")]
    assert f"({len(clients)} non-finite)" in rows[0]
    rounds = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    second, third = (next(e for e in rounds if e["event"] == "round" and e["round"] == r) for r in (2, 3))
    assert any(what.startswith("server tensor 'global/") for what in second["nonfinite"])
    assert "training loss" not in second["nonfinite"]  # round 2 trained from round 1's finite model
    assert third["nonfinite"]["training loss"] == third["participants"]  # then from the NaN one
    assert any(what.startswith("upload tensor 'shared/") for what in third["nonfinite"])
    assert third["train_loss"] is None  # no client's loss was finite: no mean


def test_on_nonfinite_is_validated(tiny_run):
    tiny_run["federation"]["on_nonfinite"] = "ignore"
    with pytest.raises(ConfigError, match=r"federation.on_nonfinite = 'ignore' is invalid: .*'stop' or 'warn'"):
        load_config(tiny_run)


def test_a_mean_leaves_non_finite_values_out():
    means, stds = mean_std({0: {"local_acc": 0.5, "num_test": 3}, 1: {"local_acc": math.nan, "num_test": 3},
                             2: {"local_acc": 0.75, "num_test": 3}})
    assert means["local_acc"] == 0.625 and stds["local_acc"] == 0.125
    assert math.isnan(mean_std({0: {"local_acc": math.inf}})[0]["local_acc"])


@pytest.mark.usefixtures("ray_local")
def test_on_ray_the_sentence_of_a_client_side_check_arrives_unwrapped(tiny_run, tmp_path):
    config = _config(tiny_run, WrongShapePayload)
    config["placement"].update(executor="ray", clients_per_actor=4)  # one ClientActor: less to start
    config["federation"]["rounds"] = 1
    with pytest.raises(MethodOutputError) as caught:
        Simulation(config, out_dir=tmp_path, progress=False).run()
    message = str(caught.value)
    assert message.startswith("method 'mine', hook payload, client ") and "\n" not in message


# Four mistakes that ran to the end (or failed later, elsewhere) before the engine checked what a method returns
# against what it declared: each now stops at the hook and client where it happens, in one sentence.

class UploadsUnderAnUnreadSlot(FedAvg):
    def local_update(self, client, state, payload):
        result = super().local_update(client, state, payload)
        result.upload = {"body": result.upload["shared"]}  # the default aggregate reads "shared"
        return result


def _is_head(name: str) -> bool:
    return name.startswith("head")


class UploadsItsPersonalHead(FedAvg):
    """FedRep's split with its mistake: the head is personal and kept in the state, and uploaded too."""

    def is_shared(self, name):
        return not _is_head(name)

    def local_update(self, client, state, payload):
        result = client.train({**state["personal"], **(payload or {})})
        _, personal = self.split(result.params)
        return LocalResult({**state, "personal": personal}, {"shared": result.params}, result.loss)


class SendsTheHeadsBack(FedAvg):
    """The head personal, uploaded under a slot of its own that the server averages into the payload."""

    def is_shared(self, name):
        return not _is_head(name)

    def local_update(self, client, state, payload):
        result = super().local_update(client, state, payload)
        result.upload["heads"] = {n: v for n, v in result.state["personal"].items() if _is_head(n)}
        return result

    def aggregate(self, server, uploads):
        new = super().aggregate(server, uploads)
        return {**new, "global": {**new["global"], **weighted_mean(uploads, "heads")}}


class WritesIntoItsPayload(FedAvg):
    def local_update(self, client, state, payload):
        payload[next(iter(payload))].mul_(0.5)
        return super().local_update(client, state, payload)


# A client's payload tensors of one dtype reach it as views of one buffer, which share one version counter.
WRITTEN = r"one of \d+ payload tensors that share a buffer \(the first: '[\w.]+'\) was written in place"


class UploadsNamesTheModelLacks(FedAvg):
    def local_update(self, client, state, payload):
        result = super().local_update(client, state, payload)
        result.upload = {"shared": {f"model.{n}": v for n, v in result.upload["shared"].items()}}
        return result


class NeverMoves(FedAvg):
    """Reads its uploads, and returns the server state as it was."""

    def aggregate(self, server, uploads):
        [upload.tensors.get("shared") for upload in uploads]
        return server


@pytest.mark.parametrize("method, says", [
    (UploadsUnderAnUnreadSlot, r"hook local_update, client \d, round 1: upload slot 'body' is read by neither the "
                               r"engine nor UploadsUnderAnUnreadSlot.aggregate \(WeightedMean; it read 'shared'\)"),
    (UploadsItsPersonalHead, r"hook local_update, client \d, round 1: parameter 'head\.\w+' is both personal "
                             r"\(UploadsItsPersonalHead.is_shared says so"),
    (SendsTheHeadsBack, r"hook aggregate, round 1: server tensor 'global/head\.\w+' is of parameter 'head\.\w+', "
                        r"which SendsTheHeadsBack.is_shared calls personal"),
    (WritesIntoItsPayload, r"hook local_update, client \d, round 1: " + WRITTEN),
    (UploadsNamesTheModelLacks, r"hook local_update, client \d, round 1: upload tensor 'model\.[\w.]+' in slot "
                                r"'shared' is no trainable parameter of the client model"),
])
def test_a_method_breaking_its_contract_stops_where_it_happens_in_one_sentence(tiny_run, tmp_path, method, says):
    config = _config(tiny_run, method, rounds=2)
    with pytest.raises(MethodOutputError) as caught:
        Simulation(config, out_dir=tmp_path, progress=False).run()
    message = str(caught.value)
    assert re.match(f"method 'mine', {says}", message), message
    assert "\n" not in message and message.endswith(".")
    assert not (tmp_path / "summary.json").exists()


def test_a_method_whose_server_state_never_changes_says_so_once(tiny_run, tmp_path):
    config = _config(tiny_run, NeverMoves, rounds=3)
    with pytest.warns(RuntimeWarning, match="did not change") as warned:
        Simulation(config, out_dir=tmp_path, progress=False).run()
    said = [str(w.message) for w in warned if "did not change" in str(w.message)]
    assert said == ["method 'mine' (NeverMoves): its server state did not change in its first round with uploads; if "
                    "it should learn from them, check that aggregate reads the uploads and returns new tensors."]


@pytest.mark.parametrize("method", [FedAvg, Local])
def test_a_method_that_moves_its_server_or_uploads_nothing_is_not_told_otherwise(tiny_run, tmp_path, recwarn, method):
    Simulation(_config(tiny_run, method, rounds=2), out_dir=tmp_path, progress=False).run()
    assert not [w for w in recwarn if "did not change" in str(w.message)]


@pytest.mark.usefixtures("ray_local")
def test_on_ray_writing_into_a_payload_stops_the_run_too(tiny_run, tmp_path):
    config = _config(tiny_run, WritesIntoItsPayload, rounds=1)
    config["placement"].update(executor="ray", clients_per_actor=4)
    with pytest.raises(MethodOutputError) as caught:
        Simulation(config, out_dir=tmp_path, progress=False).run()
    assert re.match(r"method 'mine', hook local_update, client \d, round 1: " + WRITTEN, str(caught.value))
