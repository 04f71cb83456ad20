"""What docs/extending.md tells a method author, checked against the engine: partial-parameter training, the default
model's parameter names and head, the default hooks' state layout, labels; and what `rayfed run` says on Ctrl-C."""

from __future__ import annotations

import ast
import importlib
import re
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import rayfed
from rayfed.cli import main
from rayfed.config import load_config
from rayfed.method import LocalResult
from rayfed.param_names import components
from rayfed.results.checkpoint import latest_round
from rayfed.training import Phase

ROOT = Path(__file__).resolve().parents[1]
EXTENDING = (ROOT / "docs" / "extending.md").read_text()


def _section(title: str) -> str:
    """The text of docs/extending.md's section ``### <title>``, up to the next heading."""
    match = re.search(rf"^### {re.escape(title)}\n(.*?)(?=^#)", EXTENDING, re.S | re.M)
    assert match, f"docs/extending.md has no section '### {title}'"
    return match.group(1)


# Labels -----------------------------------------------------------------------------------------------------------
def test_a_method_is_labelled_alike_by_its_name_its_import_path_its_class_and_a_built_one(tmp_path, monkeypatch):
    (tmp_path / "labelled_methods.py").write_text(
        "import rayfed\n\n\n@rayfed.register_method('scaled-label')\nclass Scaled(rayfed.Method):\n    pass\n\n\n"
        "class Unregistered(rayfed.Method):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("labelled_methods")

    def label(name) -> str:
        return load_config({"methods": [name]}).methods[0].label

    spellings = ("scaled-label", "labelled_methods:Scaled", module.Scaled, module.Scaled())
    assert [label(name) for name in spellings] == ["scaled-label"] * 4
    unregistered = ("labelled_methods:Unregistered", module.Unregistered, module.Unregistered())
    assert [label(name) for name in unregistered] == ["Unregistered"] * 3
    assert label({"name": "labelled_methods:Scaled", "label": "mine"}) == "mine"
    assert label({"name": "labelled_methods:Scaled", "post_train_steps": 2}) == "scaled-label+post"
    assert label("rayfed.methods:Ditto") == "ditto"  # a built-in's class by its import path
    with pytest.raises(ValueError, match="the label 'scaled-label' is used twice"):
        load_config({"methods": ["scaled-label", "labelled_methods:Scaled"]})


# Ctrl-C -----------------------------------------------------------------------------------------------------------
def test_ctrl_c_says_what_the_run_kept_and_the_command_that_resumes_it(tiny_run, tmp_path, monkeypatch, capsys):
    """Stopped in round 1 of the second method (just after its checkpoint): exit status 130, no traceback, one
    sentence naming the first method's results, the second's checkpoint round and the third's restart; the printed
    command then finishes the run."""
    import yaml

    from rayfed.simulation.method_run import MethodRun

    tiny_run["federation"].update(rounds=2, eval_every=2, checkpoint_every=1)
    tiny_run["methods"] = ["local", "fedavg", "fedprox"]
    tiny_run["placement"]["executor"] = "local"
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_run))
    checkpoint = MethodRun.checkpoint

    def stopped_at_fedavg_round_1(method_run, label, rounds_done, counters):
        checkpoint(method_run, label, rounds_done, counters)
        if (label, rounds_done) == ("fedavg", 1):
            raise KeyboardInterrupt

    monkeypatch.setattr(MethodRun, "checkpoint", stopped_at_fedavg_round_1)
    run_dir = tmp_path / "run"
    assert main(["run", str(config), "--out", str(run_dir), "--quiet"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err
    sentence, command = err.strip().split("\n")[-2:]
    assert sentence == (f"rayfed: interrupted; {run_dir} keeps local's results, fedavg's checkpoint of round 1 of 2; "
                        "fedprox restarts at round 1. Resume it with:")
    assert command.strip() == f"rayfed run --resume {run_dir} --quiet"
    monkeypatch.setattr(MethodRun, "checkpoint", checkpoint)
    assert main(command.split()[1:]) == 0
    assert latest_round(run_dir / "checkpoints", "fedprox") == 2 and (run_dir / "summary.json").is_file()


def test_ctrl_c_before_the_run_wrote_anything_says_to_run_the_command_again(tmp_path, monkeypatch, capsys):
    from rayfed.simulation.run import Simulation

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Simulation, "__init__", interrupted)
    assert main(["run", "configs/quickstart.yaml", "--out", str(tmp_path / "run")]) == 130
    assert capsys.readouterr().err == ("rayfed: interrupted before the run wrote anything to resume from; run the same "
                                       "command again.\n")


# Training part of the parameters ----------------------------------------------------------------------------------
FEDREP = ROOT / "examples" / "fedrep.py"


def _code_blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, re.S)


def _stripped_lines(text: str) -> str:
    return "\n".join(line.strip() for line in text.splitlines() if line.strip())


def test_the_partial_training_excerpt_is_the_fedrep_examples_code():
    [excerpt] = _code_blocks(_section("Training part of the parameters"), "python")
    assert _stripped_lines(excerpt) in _stripped_lines(FEDREP.read_text())


SEEN: dict[int, list[torch.Tensor]] = {}


@dataclass(frozen=True)
class TwoCallsParams:
    purposes: tuple[str, ...] = ("head", "body")


class TwoHeadCalls(rayfed.Method):
    """Two train calls of the head alone, each call's batches recorded (in this process: ClientActor in process)."""

    Params = TwoCallsParams

    def local_update(self, client, state, payload):
        start = {**state["personal"], **payload}
        for call, purpose in enumerate(self.params.purposes):
            def recording(step, call=call):
                SEEN.setdefault(call, []).append(step.batch["pixel_values"].clone())
                return step.task_loss()

            result = client.train(start, steps=2, purpose=purpose, phases=[Phase(trains=_is_head, loss=recording)])
        return LocalResult(state, {"shared": result.params}, result.loss)


def _is_head(name: str) -> bool:
    return components(name)[0] == "head"


@pytest.mark.parametrize("purposes", [("head", "body"), ("head", "head")])
def test_two_train_calls_draw_the_same_batches_exactly_when_their_purposes_are_the_same(tiny_run, purposes):
    """And a Phase(trains=...) updates only what it selects: the body comes back as it was given."""
    from rayfed.actors.client import ClientActor

    SEEN.clear()
    tiny_run["methods"] = [{"name": TwoHeadCalls, "purposes": list(purposes)}]
    actor = ClientActor(load_config(tiny_run), [0])
    initial = actor.start_method(0)
    [upload] = actor.train(0, [0], {0: initial})
    same = all(torch.equal(first, second) for first, second in zip(SEEN[0], SEEN[1]))
    assert len(SEEN[0]) == len(SEEN[1]) == 2 and same == (purposes[0] == purposes[1])
    trained = upload.tensors["shared"]
    assert set(trained) == set(initial)
    for name, value in trained.items():
        assert torch.equal(value, initial[name]) != _is_head(name), name


def test_fedrep_uploads_the_body_alone_and_keeps_its_trained_head(tiny_run):
    from rayfed.actors.client import ClientActor

    example = runpy.run_path(str(FEDREP))
    tiny_run["methods"] = [{"name": example["FedRep"], "head_steps": 2, "body_steps": 2}]
    actor = ClientActor(load_config(tiny_run), [0, 1])
    shared = actor.start_method(0)  # the server's initial tensors: the body alone
    fedrep = actor.methods[0]
    payload = fedrep.payload(fedrep.init_server(shared), 0)
    initial_heads = {cid: state["personal"] for cid, state in actor.get_states().items()}
    uploads = actor.train(0, [0, 1], {0: payload, 1: payload})
    heads = {"head.weight", "head.bias"}
    assert not heads & set(shared)
    for upload in uploads:
        assert set(upload.tensors) == {"shared"} and set(upload.tensors["shared"]) == set(shared)
        assert not any(torch.equal(value, payload[n]) for n, value in upload.tensors["shared"].items() if "lora_B" in n)
    for cid, state in actor.get_states().items():
        assert set(state) == {"personal"} and set(state["personal"]) == heads
        assert not torch.equal(state["personal"]["head.weight"], initial_heads[cid]["head.weight"])


# The default model's parameter names -----------------------------------------------------------------------------
def _expanded(pattern: str, layers: int = 2, tasks: int = 2) -> list[str]:
    names = [pattern.replace("<i>", str(i)) for i in range(layers)] if "<i>" in pattern else [pattern]
    return [n.replace("<t>", str(t)) for n in names for t in range(tasks)] if "<t>" in pattern else names


def test_the_default_models_names_in_the_docs_are_the_models(monkeypatch, capsys):
    from rayfed.models import build_backbone, build_client_model, build_task_model
    from rayfed.tasks import Task

    section = _section("The default model's parameter names, and its head")
    [listed] = _code_blocks(section, "text")
    [listing] = _code_blocks(section, "python")
    monkeypatch.chdir(ROOT)
    exec(listing, {})  # the doc's own snippet, which prints the names
    names = ast.literal_eval(capsys.readouterr().out.strip())
    encoder = [line for line in listed.split() if not line.startswith("head.")]
    expected = [name for i in range(2) for pattern in encoder for name in [pattern.replace("<i>", str(i))]]
    assert names == expected + [line for line in listed.split() if line.startswith("head.")]
    assert [n for n in names if _is_head(n)] == ["head.weight", "head.bias"]

    config = load_config(ROOT / "configs" / "quickstart.yaml").model
    backbone = build_backbone(config, 0)
    two_tasks = build_task_model(backbone, config, [Task(0, "a", ("x", "y")), Task(1, "b", ("x", "y", "z"))], 0)
    several = re.findall(r"`(head\.task_<t>\.\w+)`", section)
    assert {n for n in two_tasks.trainable_names() if _is_head(n)} == {n for p in several for n in _expanded(p)}

    rows = dict(re.findall(r"^\| `(\w+)` \| (.*) \|$", section, re.M))
    assert set(rows) == {"lora", "adapter", "vpt", "bias", "full", "head"}
    for module, cell in rows.items():
        model_config = config.model_copy(update={"module": module})
        model = build_client_model(build_backbone(model_config, 0), model_config, 10, 0)
        body = [n for n in model.trainable_names() if not _is_head(n)]
        first = [name for name in re.findall(r"`([\w.<>]+)`", cell) if name.startswith("encoder.")]
        if first:
            assert set(_expanded(first[0])) <= set(body), module
        everything = [n for n, _ in model.encoder.named_parameters()]
        expected_body = {"bias": [n for n in everything if n.endswith("bias")], "full": everything, "head": []}
        if module in expected_body:
            assert body == [f"encoder.{n}" for n in expected_body[module]], module


# The default hooks' state ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["fedavg", "fedrep"])
def test_the_default_hooks_keep_the_slots_the_docs_name(tiny_run, method):
    from rayfed.actors.client import ClientActor
    from rayfed.method import presum

    runpy.run_path(str(FEDREP))  # registers fedrep
    table = _section("The default hooks' state")
    slots = dict(re.findall(r"^\| (client state|upload|server) `(\w+)` \|", table, re.M))
    tiny_run["methods"] = [method]
    actor = ClientActor(load_config(tiny_run), [0, 1])
    shared = actor.start_method(0)
    chosen = actor.methods[0]
    server = chosen.init_server(shared)
    assert set(server) == {slots["server"]}
    payload = chosen.payload(server, 0)
    assert payload is server["global"]  # the payload: the server's slot itself, no slots of its own
    uploads = actor.train(0, [0, 1], {0: payload, 1: payload})
    assert all(set(upload.tensors) == {slots["upload"]} for upload in uploads)
    assert set(chosen.aggregate(server, [presum(uploads)])) == {slots["server"]}
    personal = set() if method == "fedavg" else {"head.weight", "head.bias"}  # what is_shared calls personal
    assert not personal & set(shared)
    for state in actor.get_states().values():
        assert set(state) == {slots["client state"]} and set(state[slots["client state"]]) == personal


def test_the_fedrep_example_runs_as_a_script(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(FEDREP), "federation.rounds=2", "federation.eval_every=2",
                                      "data.num_clients=4", "federation.clients_per_round=2", "placement.executor=local"])
    runpy.run_path(str(FEDREP), run_name="__main__")
    printed = capsys.readouterr().out
    assert re.search(r"^fedavg: local_acc = 0\.\d{4}$", printed, re.M)
    assert re.search(r"^fedrep: local_acc = 0\.\d{4}$", printed, re.M)
