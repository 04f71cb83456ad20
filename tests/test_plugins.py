"""Plug-ins brought by a driver script: methods, data sources, partitioners, backbones, client models, task
kinds; the examples; one build per method; the package's layering."""

from __future__ import annotations

import ast
import importlib
import json
import re
import runpy
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import rayfed
from rayfed import registry
from rayfed.config import load_config
from rayfed.errors import ConfigError
from rayfed.method import Method, build_method
from rayfed.simulation import Simulation

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"rayfed": ROOT / "rayfed", "rayfed.actors": ROOT / "actors", "rayfed.methods": ROOT / "methods",
            "rayfed.benchmarks": ROOT / "benchmarks"}
LOWER_LAYERS = ("rayfed.config", "rayfed.data", "rayfed.models", "rayfed.training", "rayfed.tasks", "rayfed.types",
                "rayfed.registry", "rayfed.method", "rayfed.zoo")


def _in_layer(module: str, layers: tuple[str, ...]) -> bool:
    return any(module == layer or module.startswith(layer + ".") for layer in layers)


@dataclass(frozen=True)
class CountingParams:
    scale: float = 1.0


class ScaledAverage(Method):
    """Lives only in this test module: the server takes the mean update times ``scale``. It checks, on the
    actors, that it was built once in the driver with the federation's size and tasks."""

    Params = CountingParams

    def local_update(self, client, state, payload):
        assert self.num_clients == 4 and [t.name for t in self.tasks] == ["task"], "built without the run's fields"
        return super().local_update(client, state, payload)

    def aggregate(self, server, uploads):
        new = super().aggregate(server, uploads)
        scale = self.params.scale
        return {"global": {n: server["global"][n] + scale * (v - server["global"][n]) for n, v in new["global"].items()}}


@pytest.mark.usefixtures("ray_local")
def test_a_method_defined_only_in_this_module_runs_on_ray_actors(tiny_run, tmp_path):
    tiny_run["methods"] = ["fedavg", {"name": ScaledAverage, "label": "same"},
                           {"name": ScaledAverage, "label": "half", "scale": 0.5}]
    summary = Simulation(tiny_run, out_dir=tmp_path, progress=False).run()
    methods = summary["methods"]
    for cid, fedavg in methods["fedavg"]["clients"].items():  # scale 1 is FedAvg (w + (v - w): up to rounding)
        assert methods["same"]["clients"][cid] == pytest.approx(fedavg, rel=1e-4)
    assert methods["half"]["clients"] != methods["fedavg"]["clients"]
    saved = (tmp_path / "config.yaml").read_text()
    assert "test_plugins:ScaledAverage" in saved  # the dump names it by its import path


class FailingUpdate(Method):
    """Lives only in this test module: its local update raises, as a bug in a user's method would."""

    def local_update(self, client, state, payload):
        raise ValueError(f"a bug in the user's update of client {client.client_id}")  # FAILING_LINE


FAILING_LINE = next(number for number, line in enumerate(Path(__file__).read_text().splitlines(), 1)
                    if line.endswith("# FAILING_LINE"))


def _failing_run(tiny_run: dict, executor: str) -> dict:
    tiny_run["methods"] = [FailingUpdate]
    tiny_run["federation"]["rounds"] = 1
    tiny_run["placement"].update(executor=executor, clients_per_actor=4)
    return tiny_run


@pytest.mark.usefixtures("ray_local")
def test_an_error_in_a_users_hook_on_a_ray_actor_shows_the_users_line_the_hook_the_client_and_the_round(
        tiny_run, tmp_path):
    with pytest.raises(ValueError, match="a bug in the user's update of client") as info:
        Simulation(_failing_run(tiny_run, "ray"), out_dir=tmp_path, progress=False).run()
    shown = str(info.value)
    assert f'{__file__}", line {FAILING_LINE}, in local_update' in shown
    assert re.search(r"raised in FailingUpdate\.local_update for client \d in round 1", shown)


def test_an_error_in_a_users_hook_in_process_notes_the_hook_the_client_and_the_round(tiny_run, tmp_path):
    with pytest.raises(ValueError, match="a bug in the user's update of client") as info:
        Simulation(_failing_run(tiny_run, "local"), out_dir=tmp_path, progress=False).run()
    client = re.search(r"client (\d)", str(info.value)).group(1)
    assert info.value.__notes__ == [f"rayfed: raised in FailingUpdate.local_update for client {client} in round 1"]
    assert info.traceback[-1].path == Path(__file__) and info.traceback[-1].lineno + 1 == FAILING_LINE


def test_an_error_raised_on_an_actor_keeps_its_traceback_unless_it_is_a_config_error():
    from ray.exceptions import OwnerDiedError, RayActorError, RayTaskError

    from rayfed.simulation import is_actor_failure, unwrap_actor_error

    sentence = ConfigError("data.label_column = 'y' is not a column of the source.")
    assert unwrap_actor_error(RayTaskError("f", "remote traceback", sentence).as_instanceof_cause()) is sentence
    bug = ValueError("a bug")
    bug.add_note("rayfed: raised in X.local_update for client 0 in round 1")
    wrapped = unwrap_actor_error(RayTaskError("f", 'File "mine.py", line 3\nValueError: a bug', bug).as_instanceof_cause())
    assert isinstance(wrapped, ValueError) and 'File "mine.py", line 3' in str(wrapped)
    assert wrapped.__notes__ == []  # the note is in the remote traceback once already
    assert is_actor_failure(RayActorError()) and not is_actor_failure(RayActorError(actor_init_failed=True))
    # the DriverActor fetching an upload sent on ahead by an actor that died since: the run restores, as for the actor
    owner_died = OwnerDiedError("ab" * 14, "", "")
    assert is_actor_failure(RayTaskError("aggregate", "traceback", owner_died).as_instanceof_cause())


def test_a_class_given_by_import_path_or_object_or_name_is_the_same_method(tmp_path, monkeypatch):
    (tmp_path / "my_methods.py").write_text(
        "import rayfed\n\n@rayfed.register_method('scaled-x')\nclass Scaled(rayfed.Method):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config({"methods": ["my_methods:Scaled"], "imports": ["my_methods"]})
    by_path = build_method(config.methods[0], 0)
    by_name = build_method(load_config({"methods": ["scaled-x"]}).methods[0], 0)
    by_object = build_method(load_config({"methods": [type(by_path)]}).methods[0], 0)
    assert type(by_path) is type(by_name) is type(by_object)


@pytest.mark.parametrize(("name", "message"), [
    ("no_such_module_xyz:Method", r"methods\[0\]\.name = 'no_such_module_xyz:Method': module 'no_such_module_xyz' "
                                  r"cannot be imported"),
    ("json:nope", r"methods\[0\]\.name = 'json:nope': module 'json' has no attribute 'nope'"),
    ("json:dumps", r"methods\[0\]\.name = 'json:dumps' is a function, not a rayfed\.Method subclass \(it lacks "
                   r"local_update, aggregate, payload\)"),
    ("fedavgg", r"methods\[0\]\.name = 'fedavgg' is not known \(did you mean 'fedavg'\?\)"),
])
def test_a_bad_method_plug_in_is_one_sentence(name, message):
    with pytest.raises(ConfigError, match=message) as info:
        build_method(load_config({"methods": [name]}).methods[0], 0)
    assert "\n" not in str(info.value)


def test_an_unknown_hyperparameter_of_a_plug_in_method_names_it():
    with pytest.raises(ConfigError, match=r"methods\[0\] \(.*ScaledAverage\) has no hyperparameter 'scal' "
                                          r"\(did you mean 'scale'\?\); allowed: scale\."):
        build_method(load_config({"methods": [{"name": ScaledAverage, "scal": 2}]}).methods[0], 0)


def _data_run(tiny_run: dict, source) -> dict:
    tiny_run["data"] = {"source": source, "num_clients": 4, "partition": {"name": "iid"}}
    tiny_run["model"]["image_size"] = 8
    return tiny_run


@pytest.mark.parametrize(("returned", "message"), [
    ({"image": np.zeros((40, 8)), "label": np.zeros(40)},
     r"column 'image' holds float64 values of shape \(40, 8\); expected images \(N, H, W, C\) or \(N, H, W\)"),
    ({"image": np.zeros((40, 8, 8)), "label": np.zeros(30)},
     r"returned columns that do not fit together: column labels has 30 values but the dataset has 40 samples"),
    ({"image": np.full((40, 8, 8), 2.0), "label": np.zeros(40)}, r"column 'image' has pixel values outside \[0, 1\]"),
    ([1, 2, 3], r"returned a list; a source returns an ArrayDataset, a dict of columns"),
    ({"picture": np.zeros((40, 8, 8))}, r"returned a column 'picture' rayfed does not read"),
])
def test_a_data_source_returning_the_wrong_shapes_says_what_it_got(tiny_run, tmp_path, returned, message):
    def source(request):
        return returned

    with pytest.raises(ConfigError, match=r"data\.source = '.*source' " + message):
        Simulation(_data_run(tiny_run, source), out_dir=tmp_path, progress=False).run()


def test_a_partitioner_plug_in_must_return_one_disjoint_index_array_per_client(tiny_run, tmp_path):
    tiny_run["data"]["partition"] = {"name": lambda request: [np.arange(10)] * request.num_clients}
    with pytest.raises(ConfigError, match=r"returned indices that repeat or fall outside the 240 samples"):
        Simulation(tiny_run, out_dir=tmp_path, progress=False).run()
    tiny_run["data"]["partition"] = {"name": lambda request: [np.arange(10)]}
    with pytest.raises(ConfigError, match=r"returned 1 index arrays; expected a list of data\.num_clients = 4"):
        Simulation(tiny_run, out_dir=tmp_path / "b", progress=False).run()


def test_a_backbone_builder_must_return_a_backbone(tiny_run, tmp_path):
    tiny_run["model"] = {"backbone": lambda request: nn.Linear(4, 4)}
    with pytest.raises(ConfigError, match=r"returned a bare Linear; a backbone builder returns rayfed\.models\.Backbone"):
        Simulation(tiny_run, out_dir=tmp_path, progress=False).run()


class ScaledHead(nn.Module):
    """A head whose outputs a trainable scalar multiplies."""

    def __init__(self, head: nn.Module, scale: float):
        super().__init__()
        self.head = head
        self.scale = nn.Parameter(torch.tensor(scale))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.scale * self.head(features)


@rayfed.register_client_model("test-scaled-head")
def scaled_head_model(request):
    """Lives only in this test module: the engine's model, its head scaled by ``model.client_options.scale``."""
    from rayfed.models import default_client_model

    unknown = sorted(set(request.options) - {"scale"})
    if unknown:
        raise ConfigError(f"model.client_options has no option {unknown[0]!r}; allowed: scale.")
    model = default_client_model(request)
    model.head = ScaledHead(model.head, float(request.options.get("scale", 1.0)))
    return model


def test_a_client_model_registered_by_a_user_is_the_one_a_config_names_with_its_options(tiny_run, monkeypatch):
    from rayfed.actors.client import ClientActor

    tiny_run["model"].update(client="test-scaled-head", client_options={"scale": 0.5})
    actor = ClientActor(load_config(tiny_run).to_dict(), [0, 1])
    shared = actor.start_method(0)
    assert isinstance(actor.model.head, ScaledHead) and shared["head.scale"] == 0.5
    assert any("lora_" in name for name in shared)  # the engine's model.module under it

    def build(**model):
        return actor.method.build_model(actor.backbone, actor.model_config.model_copy(update=model), actor.tasks, 0)

    with pytest.raises(ConfigError, match=r"^model\.client_options has no option 'scales'; allowed: scale\.$"):
        build(client_options={"scales": 2.0})
    with pytest.raises(ConfigError, match=r"^model\.client = 'test-scaled-heads' is not known \(did you mean "
                                          r"'test-scaled-head'\?\); allowed: mome, .*test-scaled-head"):
        build(client="test-scaled-heads")
    with pytest.raises(ConfigError, match=r"^model\.client = 'test-plain' built a Linear, not a rayfed\.TrainableModule"):
        plain = registry.Entry("client_model", "test-plain", lambda request: nn.Linear(2, 2), builtin=False)
        monkeypatch.setitem(registry._ENTRIES["client_model"], "test-plain", plain)
        build(client="test-plain")


class PixelProbe(rayfed.TrainableModule):
    """Lives only in this test module: a user's model that overrides none of the capabilities the engine reads, a
    linear classifier of the pooled raw pixels."""

    def __init__(self, request):
        super().__init__()
        torch.manual_seed(request.seed)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.linear = nn.Linear(request.backbone.num_channels * 4, max(task.num_classes for task in request.tasks))

    def forward(self, batch):
        images = batch["pixel_values"]
        return self.linear(self.pool(images.expand(-1, self.linear.in_features // 4, -1, -1)).flatten(1))


class UnseenPixelProbe(PixelProbe):
    """Lives only in this test module: the probe, declaring that it scores tasks no client holds and tagging its
    classifier with task 0."""

    scores_unseen_tasks = True

    def task_tags(self):
        return {"linear.weight": frozenset({0})}


rayfed.register_client_model("test-pixel-probe")(PixelProbe)
rayfed.register_client_model("test-unseen-pixel-probe")(UnseenPixelProbe)


def _with_a_task_no_client_holds(run: dict):
    """The run's config and federation with base_novel's partition: task 1 (the novel classes) is held by no client."""
    from rayfed.data.clients import build_federation

    run["data"].update(num_clients=2, partition={"name": "base_novel", "options": {"shots": 4}})
    run["federation"]["clients_per_round"] = 2
    config = load_config(run)
    return config, build_federation(config.data, config.seed)


def test_a_users_model_without_overrides_gets_the_engines_defaults(tiny_run):
    """Trained, tagged and scored as a plain model; refused text generation and tasks no client holds."""
    from rayfed.actors.client import ClientActor, run_methods
    from rayfed.tasks.kinds import TextGeneration
    from rayfed.simulation import check_model

    tiny_run["model"].update(client="test-pixel-probe", lora=None)
    actor = ClientActor(load_config(tiny_run).to_dict(), [0, 1])
    shared = actor.start_method(0)
    model = actor.model
    assert not model.generates_text and not model.scores_unseen_tasks and actor.tags == {}
    assert sorted(shared) == ["linear.bias", "linear.weight"]
    assert all(0.0 <= metrics["local_acc"] <= 1.0 for metrics in actor.evaluate(0, {0: shared, 1: shared}).values())
    with pytest.raises(ConfigError, match=r"does not generate text, so it cannot run data\.kind = 'text_generation'"):
        TextGeneration().check_model(model, actor.backbone, "data")
    batch = {"pixel_values": torch.rand(2, 3, 8, 8)}
    generations = torch.tensor([[1, 2]])
    model.generate_text = lambda batch, max_new_tokens: generations[:, :max_new_tokens]  # a user's decoder
    logits, generated = model.logits_and_generations(batch, 1)  # the default: the forward, then the decoder's
    assert torch.equal(logits, model(batch)) and torch.equal(generated, generations[:, :1])

    config, federation = _with_a_task_no_client_holds(tiny_run)
    with pytest.raises(ConfigError, match=r"^methods\[0\] \(fedavg\) scores a task with heads trained on clients' "
                                          r"data and cannot score task\(s\) \[1\] that no client holds"):
        check_model(config, federation, run_methods(config, federation))


def test_a_users_model_overrides_are_what_the_engine_uses(tiny_run):
    from rayfed.actors.client import ClientActor, run_methods
    from rayfed.simulation import check_model

    tiny_run["model"].update(client="test-unseen-pixel-probe", lora=None)
    actor = ClientActor(load_config(tiny_run).to_dict(), [0, 1])
    actor.start_method(0)
    assert actor.tags == {"linear.weight": frozenset({0})}
    config, federation = _with_a_task_no_client_holds(tiny_run)
    check_model(config, federation, run_methods(config, federation))  # it scores the task no client holds


@rayfed.register_method("test-own-model")
class OwnModel(Method):
    """Lives only in this test module: a method that builds the engine's model itself, not through model.client."""

    def build_model(self, backbone, config, tasks, seed):
        from rayfed.models import build_task_model

        return build_task_model(backbone, config, tasks, seed)


def test_a_method_that_builds_its_own_model_is_refused_a_client_model_it_would_ignore(tiny_run):
    from rayfed.actors.client import run_methods
    from rayfed.data.clients import build_federation
    from rayfed.simulation import check_model

    tiny_run["model"].update(client="test-scaled-head", client_options={"scale": 0.5})
    tiny_run["methods"] = ["fedavg", {"name": "test-own-model", "label": "own"}]
    config = load_config(tiny_run)
    federation = build_federation(config.data, config.seed)
    with pytest.raises(ConfigError, match=r"^methods\[1\] \(own\) builds a model of its own and would ignore "
                                          r"model\.client = 'test-scaled-head'; set methods\[1\]\.model\.client: null"):
        check_model(config, federation, run_methods(config, federation))
    tiny_run["methods"][1]["model"] = {"client": None}
    config = load_config(tiny_run)
    check_model(config, federation, run_methods(config, federation))


@rayfed.register_method("test-plain-model")
class PlainModel(Method):
    """Lives only in this test module: a method whose model is a plain torch.nn.Module."""

    def build_model(self, backbone, config, tasks, seed):
        return nn.Linear(2, 2)


def test_a_methods_model_that_is_not_a_trainable_module_is_refused_in_one_sentence_wherever_it_is_built(tiny_run):
    """In the preflight and on an actor (a run that skips the preflight), before anything reads the model."""
    from rayfed.actors.client import ClientActor, run_methods
    from rayfed.data.clients import build_federation
    from rayfed.simulation import check_model

    tiny_run["methods"] = [{"name": "test-plain-model", "label": "plain"}]
    config = load_config(tiny_run)
    refused = (r"^methods\[0\] \(plain\): PlainModel\.build_model built a Linear, not a rayfed\.TrainableModule; "
               r"subclass rayfed\.TrainableModule instead of torch\.nn\.Module \([^.]*\)\.$")
    with pytest.raises(ConfigError, match=refused):
        check_model(config, build_federation(config.data, config.seed), run_methods(config, build_federation(
            config.data, config.seed)))
    with pytest.raises(ConfigError, match=refused):
        ClientActor(config.to_dict(), [0, 1]).start_method(0)


def test_a_task_kind_plug_in_scores_with_its_own_loss_and_metric(tiny_run):
    from rayfed.actors.client import ClientActor
    from rayfed.tasks.kinds import Classification

    class Top2(Classification):
        name = "top2"
        metrics = ("top2",)

        def score(self, model, batch):
            logits = model(batch).float()
            return {"top2": (logits.topk(2).indices == batch["labels"][:, None]).any(1).sum().item()}

        def summarize(self, sums, count):
            return {"top2": sums["top2"] / count}

    tiny_run["data"]["kind"] = Top2
    actor = ClientActor(load_config(tiny_run), [0])
    shared = actor.start_method(0)
    assert set(actor.evaluate(0, {0: shared})[0]) == {"local_top2"}


# The examples: each runs as a user runs it, and gives the same numbers on a Ray actor and in the driver's process ---
SHORT = ["federation.rounds=2", "federation.eval_every=2", "data.num_clients=4", "federation.clients_per_round=2",
         "placement.cpus_per_actor=0.25"]
EXAMPLES = {
    "custom_method.py": SHORT,
    "custom_data.py": [*SHORT, "methods=[fedavg]"],
    "custom_backbone.py": [*SHORT, "methods=[fedavg]"],
    "custom_client_model.py": [*SHORT, "methods=[fedavg]"],
}


def _run_script(script: str, overrides: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python examples/<script> <overrides>`` in folder ``cwd``, in this process (no new interpreter to start): the
    script is ``__main__``, and its folder leads ``sys.path`` and is ``sys.argv[0]``'s, which a Ray started by the
    script passes on to its workers."""
    cwd.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "examples" / script), *overrides])
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    runpy.run_path(str(ROOT / "examples" / script), run_name="__main__")


def _results(cwd: Path) -> dict:
    summaries = sorted(cwd.glob("runs/*/summary.json")) + sorted(cwd.glob("runs/*/tune/runs/*/summary.json"))
    assert summaries
    out = {}
    for path in summaries:
        summary = json.loads(path.read_text())
        key = json.dumps(summary["config"]["methods"], sort_keys=True)
        out[key] = {label: result["clients"] for label, result in summary["methods"].items()}
    return out


def numbers_at_packings(script: str, overrides: list[str], tmp_path: Path, monkeypatch) -> list:
    """The script's numbers in this process with one client per actor, then with four."""
    numbers = []
    for packing in ("1", "4"):
        cwd = tmp_path / packing
        _run_script(script, [*overrides, f"placement.clients_per_actor={packing}"], cwd, monkeypatch)
        numbers.append(_results(cwd))
    return numbers


def _numbers_on_ray_and_in_process(script: str, overrides: list[str], tmp_path: Path, monkeypatch, capsys) -> list:
    """The script's numbers on one Ray actor hosting all 4 clients, then on 2 actors of 2 clients in its process."""
    numbers = []
    for placement in ("clients_per_actor=4", "clients_per_actor=2 placement.executor=local"):
        cwd = tmp_path / placement.split()[-1]
        _run_script(script, [*overrides, *f"placement.{placement}".split()], cwd, monkeypatch)
        assert "local_acc" in capsys.readouterr().out
        numbers.append(_results(cwd))
    return numbers


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_an_example_runs_and_packing_does_not_change_its_numbers(script, tmp_path, monkeypatch, capsys):
    """The script finds the session's Ray running: the plug-ins of its ``__main__`` reach a Ray worker, and neither
    the executor nor the packing changes the numbers."""
    numbers = _numbers_on_ray_and_in_process(script, EXAMPLES[script], tmp_path, monkeypatch, capsys)
    assert numbers[0] == numbers[1]


def test_the_tune_example_runs_and_packing_does_not_change_its_numbers(tmp_path, monkeypatch, capsys):
    """The sweep starts its own Ray, as a user's run does (the session's is paused meanwhile), whose trials import
    the method's module from the script's folder; neither the executor nor the packing changes the numbers."""
    from conftest import ray_paused

    overrides = [*SHORT, "tune.space={methods.0.momentum: {grid: [0.0, 0.9]}}"]
    with ray_paused():
        numbers = _numbers_on_ray_and_in_process("tune_custom_method.py", overrides, tmp_path, monkeypatch, capsys)
    assert numbers[0] == numbers[1]


# More examples of docs/extending.md, run in this process --------------------------------------------------------
def _evals(cwd: Path) -> list[dict]:
    [metrics] = cwd.glob("runs/*/metrics.jsonl")
    return [event for line in metrics.read_text().splitlines() if (event := json.loads(line))["event"] == "eval"]


def test_the_scaffold_example_gives_the_same_numbers_at_any_packing(tmp_path, monkeypatch, capsys):
    """Each client's control variate lives in its client state: one client per actor or all four on one actor, and
    clients train again in round 2 from the c_i they kept. (Ray against in-process for a driver script's method:
    test_an_example_runs_and_packing_does_not_change_its_numbers.)"""
    overrides = [*SHORT, "federation.clients_per_round=3", "methods=[scaffold]", "placement.executor=local"]
    numbers = numbers_at_packings("scaffold.py", overrides, tmp_path, monkeypatch)
    assert numbers[0] == numbers[1]
    assert "scaffold: local_acc" in capsys.readouterr().out


def test_scaffold_corrects_each_step_and_keeps_each_clients_option_ii_control_variate(tiny_run):
    """One plain SGD step from x: y = x - lr (g_i(x) - c_i + c), and option II gives c_i+ = g_i(x), the gradient of
    client i's own batch (from the same step without the correction: (x - y_plain) / lr); the server adds
    sum_i (c_i+ - c_i) / N to c and averages the y_i, the same from each upload and from their pre-sum."""
    from rayfed.actors.client import ClientActor
    from rayfed.method import presum

    example = runpy.run_path(str(ROOT / "examples" / "scaffold.py"))
    lr, control = 0.1, example["CONTROL"]
    tiny_run["train"] = {"local_steps": 1, "batch_size": 8, "lr": lr, "optimizer": "sgd"}
    tiny_run["methods"] = [{"name": example["Scaffold"]}, "fedavg"]
    actor = ClientActor(load_config(tiny_run), [0, 1])
    x = actor.start_method(0)
    scaffold = actor.methods[0]
    generator = torch.Generator().manual_seed(0)

    def noise() -> dict[str, torch.Tensor]:
        return {n: 0.1 * torch.randn(v.shape, generator=generator) for n, v in x.items()}

    c, c_i = noise(), {0: noise(), 1: noise()}
    actor.set_states({cid: {**state, control: c_i[cid]} for cid, state in actor.get_states().items()})
    server = {"global": x, control: c}
    payload = scaffold.payload(server, 0)
    uploads = {u.client_id: u for u in actor.train(0, [0, 1], {0: payload, 1: payload})}
    kept = {cid: state[control] for cid, state in actor.get_states().items()}
    actor.start_method(1)  # FedAvg: the same step (batch, seed) without the correction
    plain = {u.client_id: u.tensors["shared"] for u in actor.train(0, [0, 1], {0: x, 1: x})}
    for cid in (0, 1):
        y = uploads[cid].tensors["shared"]
        for n in x:
            torch.testing.assert_close(y[n], plain[cid][n] - lr * (c[n] - c_i[cid][n]), rtol=0, atol=1e-6)
            torch.testing.assert_close(kept[cid][n], (x[n] - plain[cid][n]) / lr, rtol=0, atol=2e-5)
            torch.testing.assert_close(uploads[cid].tensors[control][n], kept[cid][n] - c_i[cid][n])
    assert not torch.allclose(kept[0]["head.weight"], kept[1]["head.weight"], atol=1e-3)  # each client's own

    each = scaffold.aggregate(server, [uploads[0], uploads[1]])
    summed = scaffold.aggregate(server, [presum([uploads[0], uploads[1]])])
    for slot in ("global", control):
        for n in x:
            assert torch.equal(each[slot][n], summed[slot][n])
    for n in x:
        delta = uploads[0].tensors[control][n] + uploads[1].tensors[control][n]
        torch.testing.assert_close(each[control][n], c[n] + delta / 4)  # N = 4 clients, 2 of them this round
        torch.testing.assert_close(each["global"][n], (uploads[0].tensors["shared"][n] + uploads[1].tensors["shared"][n]) / 2)


def test_scaffold_refuses_local_steps_its_control_variates_do_not_describe(tiny_run):
    from rayfed.actors.client import ClientActor

    example = runpy.run_path(str(ROOT / "examples" / "scaffold.py"))
    tiny_run["methods"] = [{"name": example["Scaffold"]}]  # tiny_run trains with adam
    actor = ClientActor(load_config(tiny_run), [0])
    x = actor.start_method(0)
    payload = actor.method.payload(actor.method.init_server(x), 0)
    with pytest.raises(ConfigError, match=r"train\.optimizer = 'adam' is not allowed with scaffold.*allowed: 'sgd'"):
        actor.train(0, [0], {0: payload})


def test_the_text_backbone_example_learns_its_topics(tmp_path, monkeypatch, capsys):
    """Four topics (chance 1/4): after 4 rounds the tiny BERT's LoRA and head classify well above chance, and the
    test loss is below the initial model's."""
    _run_script("text_backbone.py", [*SHORT, "federation.rounds=4", "federation.eval_every=4", "methods=[fedavg]",
                                     "federation.clients_per_round=4", "train.local_steps=10", "data.partition.name=iid",
                                     "federation.eval_round_zero=true", "placement.executor=local"], tmp_path, monkeypatch)
    first, last = _evals(tmp_path)
    assert (first["round"], last["round"]) == (0, 4)
    assert last["local_loss"] < first["local_loss"]
    assert last["local_acc"] > 0.6
    assert "fedavg: local_acc" in capsys.readouterr().out


def test_the_text_backbone_example_tokenizes_to_its_declared_contract():
    from rayfed.models import build_backbone

    example = runpy.run_path(str(ROOT / "examples" / "text_backbone.py"))
    backbone = build_backbone(load_config(example["CONFIG"]).model, 0)
    assert backbone.modalities == frozenset({"text"}) and backbone.image_size is None
    encoded = backbone.tokenizer(["goal today rain", "zebra"], padding="max_length", truncation=True,
                                 max_length=backbone.max_text_length, return_tensors="pt")
    assert encoded["input_ids"].shape == (2, backbone.max_text_length)
    assert encoded["attention_mask"].sum(1).tolist() == [5, 3]  # [CLS] words [SEP]; an unknown word is [UNK]
    batch = {**encoded, "labels": torch.tensor([0, 1])}  # the batch features see also holds the task's labels
    assert backbone.features(backbone.encoder, batch).shape == (2, backbone.feature_dim)


def test_the_custom_loss_example_trains_with_its_focal_loss(tiny_run):
    """The loss a local update reports (its one step's, at x) is the focal loss of that batch, worked out here."""
    from rayfed.actors.client import ClientActor

    example = runpy.run_path(str(ROOT / "examples" / "custom_loss.py"))
    tiny_run["data"]["kind"] = example["FocalClassification"](gamma=2.0)
    tiny_run["train"] = {"local_steps": 1, "batch_size": 8, "lr": 0.01, "optimizer": "sgd"}
    actor = ClientActor(load_config(tiny_run), [0])
    x = actor.start_method(0)
    [upload] = actor.train(0, [0], {0: x})
    client = actor._context(0, 0)
    client.model.load_trainable(x)
    [(_, batch)] = client.micro_batch(next(client.batch_order(1, "train", None)))
    with torch.no_grad():
        p = client.model(batch).float().softmax(-1)[torch.arange(len(batch["labels"])), batch["labels"]]
    assert upload.train_loss == pytest.approx(float((-(1 - p) ** 2 * p.log()).mean()), rel=1e-5)
    assert upload.train_loss != pytest.approx(float(-p.log().mean()), rel=1e-3)  # not the cross-entropy


def test_the_custom_loss_examples_calibration_error_adds_up_over_test_batches():
    """local_ece from two test batches' sums: |mean confidence - accuracy| per confidence tenth, weighted by its share."""
    example = runpy.run_path(str(ROOT / "examples" / "custom_loss.py"))
    kind = example["FocalClassification"]()
    logits = torch.tensor([[2.0, 0.0], [0.0, 0.1], [3.0, 0.0], [0.0, 4.0], [1.0, 0.9]])
    labels = torch.tensor([0, 0, 1, 1, 0])
    sums: dict[str, float] = {}
    for rows in (slice(0, 2), slice(2, 5)):
        for name, value in kind.score(lambda batch, rows=rows: logits[rows], {"labels": labels[rows]}).items():
            sums[name] = sums.get(name, 0.0) + value
    metrics = kind.summarize(sums, 5)
    confidence, predicted = logits.softmax(-1).max(1)
    correct = (predicted == labels).float()
    bins = (confidence * 10).long()
    expected = sum(abs(confidence[bins == b].sum() - correct[bins == b].sum()) for b in bins.unique()) / 5
    assert metrics["ece"] == pytest.approx(float(expected))
    assert metrics["acc"] == pytest.approx(0.6)


def test_the_custom_loss_example_runs_and_reports_its_metrics(tmp_path, monkeypatch, capsys):
    _run_script("custom_loss.py", [*SHORT, "placement.executor=local"], tmp_path, monkeypatch)
    [last] = _evals(tmp_path)
    assert {"local_acc", "local_focal", "local_ece"} <= set(last) and 0 <= last["local_ece"] <= 1
    assert "local_ece = " in capsys.readouterr().out

# Layering -------------------------------------------------------------------------------------------
def test_the_driver_actor_and_every_method_import_without_the_model_libraries():
    """They are imported when a model is built: a DriverActor that builds none skips ~12 s of imports on 2 cores."""
    heavy = ("transformers", "peft", "datasets", "open_clip")
    probe = ("import sys, rayfed.actors.driver, rayfed.methods, rayfed.simulation, rayfed.tune; "
             f"print([m for m in {heavy!r} if m in sys.modules]); "
             "import rayfed.models; rayfed.models.llama_config('1B'); print('transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == ["[]", "True"], done.stderr[-2000:]


def _modules() -> dict[str, Path]:
    found = {}
    for package, root in PACKAGES.items():
        for file in root.rglob("*.py"):
            if "flower" in file.parts:
                continue
            parts = [p for p in file.relative_to(root).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = file
    return found


def _imports(module: str, file: Path, modules: dict[str, Path], typing: bool = True) -> set[str]:
    """The package's modules ``module`` imports, at any depth of its code; under ``if TYPE_CHECKING`` too unless
    ``typing`` is false."""
    tree = ast.parse(file.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for n in ast.walk(node)}
    targets = set()
    for node in ast.walk(tree):
        if not typing and id(node) in typing_only:
            continue
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
                break
    return targets


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A path of imports from a module back to itself (its first module repeated at the end), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        path.append(module)
        for target in sorted(graph[module]):
            if found := visit(target):
                return found
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        if found := visit(module):
            return found
    return None


def test_the_package_has_no_import_cycle_and_lower_layers_import_no_method_or_actor():
    """Imports under ``if TYPE_CHECKING`` count: a type hint naming a module is a dependency on it."""
    modules = _modules()
    graph = {module: _imports(module, file, modules) for module, file in modules.items()}
    for module, targets in graph.items():
        if _in_layer(module, LOWER_LAYERS):
            assert not {t for t in targets if _in_layer(t, ("rayfed.methods", "rayfed.actors"))}, module
        if not _in_layer(module, ("rayfed.methods", "rayfed.benchmarks")):  # the engine never imports a method
            assert not {t for t in targets if _in_layer(t, ("rayfed.methods",))}, f"{module} imports a method"
    cycle = _cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_the_layering_check_finds_a_cycle(tmp_path):
    """The check above is not vacuous: it reports two modules importing each other (one inside a function), and a
    cycle closed by an import under ``if TYPE_CHECKING``, which the runtime imports alone would not show."""
    files = {"a": "from rayfed.b import x\n", "b": "def f():\n    from rayfed.a import y\n",
             "c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rayfed.d import z\n",
             "d": "import rayfed.c\n", "e": "from rayfed.d import w\n"}
    for name, text in files.items():
        (tmp_path / f"{name}.py").write_text(text)
    modules = {f"rayfed.{name}": tmp_path / f"{name}.py" for name in files}
    graph = {module: _imports(module, file, modules) for module, file in modules.items()}
    assert graph == {"rayfed.a": {"rayfed.b"}, "rayfed.b": {"rayfed.a"}, "rayfed.c": {"rayfed.d"},
                     "rayfed.d": {"rayfed.c"}, "rayfed.e": {"rayfed.d"}}
    assert _cycle(graph) == ["rayfed.a", "rayfed.b", "rayfed.a"]
    typed = {module: graph[module] for module in ("rayfed.c", "rayfed.d", "rayfed.e")}
    assert _cycle(typed) == ["rayfed.c", "rayfed.d", "rayfed.c"]
    runtime = {module: _imports(module, modules[module], modules, typing=False) for module in typed}
    assert runtime["rayfed.c"] == set() and _cycle(runtime) is None


def test_rayfed_exports_what_a_driver_script_needs():
    for name in ("Simulation", "Method", "Backbone", "TaskKind", "SourceRequest", "PartitionRequest", "register_method",
                 "register_source", "register_partitioner", "register_backbone", "register_task_kind",
                 "register_client_model", "ClientModelRequest", "TrainableModule"):
        assert getattr(rayfed, name) is not None
    assert rayfed.register_method is registry.register_method


def test_a_moved_module_fails_at_its_old_path_in_one_sentence_naming_the_new_one():
    """Plug-ins written against the flat engine's paths (``from rayfed.kinds import Classification``) learn where the
    module went, however they import it; the new path imports."""
    for old, new in rayfed.MOVED_MODULES.items():
        assert importlib.import_module(new).__name__ == new
        sentence = rf"^{re.escape(old)} moved to {re.escape(new)}; import it from there\.$"
        with pytest.raises(ImportError, match=sentence):
            importlib.import_module(old)
        package, _, name = old.rpartition(".")
        with pytest.raises(ImportError, match=sentence):
            exec(f"from {package} import {name}", {})
    with pytest.raises(AttributeError, match=r"^rayfed\.kinds moved to rayfed\.tasks\.kinds; "):
        rayfed.kinds  # noqa: B018


def test_every_built_in_method_and_its_hyperparameters_import_from_rayfed_methods():
    """``from rayfed.methods import Ditto, DittoParams``: a built-in method is the first thing one subclasses."""
    import rayfed.methods
    from rayfed.method import NoParams

    built_in = [entry.obj for entry in registry.entries("method") if entry.builtin]
    assert len(built_in) >= 17
    for cls in built_in:
        assert getattr(rayfed.methods, cls.__name__) is cls
        if cls.Params is not NoParams:
            assert getattr(rayfed.methods, cls.Params.__name__) is cls.Params
    assert set(rayfed.methods.__all__) == {name for cls in built_in for name in (cls.__name__, cls.Params.__name__)
                                           if name != NoParams.__name__}


def test_a_trial_whose_plugins_came_registered_does_not_import_their_module_by_name(monkeypatch):
    """A Tune trial gets the driver's plug-ins by value, from a script whose folder its process may not see: the
    config's ``imports:`` entry for that module is then already satisfied; an unknown module still fails."""
    from rayfed.simulation import import_plugin_modules

    shipped = type("Shipped", (ScaledAverage,), {"__module__": "a_driver_script_folder_module"})
    monkeypatch.setitem(registry._ENTRIES["method"], "shipped-average",
                        registry.Entry("method", "shipped-average", shipped, builtin=False))
    config = load_config({"name": "t", "data": {"source": "synthetic"}, "methods": ["shipped-average"],
                          "imports": ["a_driver_script_folder_module"]})
    import_plugin_modules(config)
    unknown = load_config({"name": "t", "data": {"source": "synthetic"}, "methods": ["fedavg"],
                           "imports": ["a_module_nobody_registered"]})
    with pytest.raises(ConfigError, match=r"imports: module 'a_module_nobody_registered' cannot be imported"):
        import_plugin_modules(unknown)
