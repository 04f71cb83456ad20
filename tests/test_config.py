from __future__ import annotations

import pytest

from rayfed.config import load_config
from rayfed.errors import ConfigError
from rayfed.method import build_method


def _error(raw: dict, overrides: list[str] | None = None) -> str:
    """The one-sentence error of loading the config and building its methods (as a run does, once)."""
    with pytest.raises(ConfigError) as info:
        config = load_config(raw, overrides)
        for index, entry in enumerate(config.methods):
            build_method(entry, index)
    message = str(info.value)
    assert "\n" not in message and message.endswith((".", "?")), message
    return message


def test_overrides_set_nested_fields_and_method_params(tiny_run):
    tiny_run["methods"] = ["fedavg", {"name": "fedprox", "mu": 0.1}]
    config = load_config(tiny_run, ["federation.rounds=7", "data.partition.alpha=0.2", "methods.1.mu=0.5", "seed=9"])
    assert config.federation.rounds == 7
    assert config.data.partition.alpha == 0.2
    assert config.methods[1].params == {"mu": 0.5}
    assert config.seed == 9


def test_override_can_replace_the_method_list(tiny_run):
    config = load_config(tiny_run, ["methods=[local, {name: ditto, lam: 1.0}]"])
    assert [m.label for m in config.methods] == ["local", "ditto"]


def test_unknown_method_lists_the_methods(tiny_run):
    message = _error(tiny_run, ["methods=[fedavgg]"])
    assert "methods[0].name" in message and "'fedavgg'" in message
    assert "did you mean 'fedavg'" in message and "ditto" in message and "local" in message


def test_rounds_must_be_positive(tiny_run):
    message = _error(tiny_run, ["federation.rounds=0"])
    assert message.startswith("federation.rounds = 0 is invalid") and "greater than 0" in message


def test_alpha_must_be_positive(tiny_run):
    message = _error(tiny_run, ["data.partition.alpha=-1"])
    assert "data.partition.alpha = -1" in message and "greater than 0" in message


def test_clients_per_round_cannot_exceed_clients(tiny_run):
    message = _error(tiny_run, ["federation.clients_per_round=5"])
    assert "federation.clients_per_round = 5" in message and "data.num_clients = 4" in message


def test_misspelt_field_gets_a_suggestion(tiny_run):
    message = _error(tiny_run, ["federation.rouns=3"])
    assert "'federation.rouns'" in message and "did you mean 'rounds'" in message


def test_method_hyperparameters_are_validated(tiny_run):
    assert "mu" in _error(tiny_run, ["methods=[{name: fedprox, mu: -0.1}]"])
    message = _error(tiny_run, ["methods=[{name: ditto, lamda: 0.1}]"])
    assert "no hyperparameter 'lamda'" in message and "did you mean 'lam'" in message


def test_labels_must_be_distinct(tiny_run):
    assert "label 'fedavg' is used twice" in _error(tiny_run, ["methods=[fedavg, fedavg]"])


def test_post_train_gets_its_own_label(tiny_run):
    config = load_config(tiny_run, ["methods=[fedavg, {name: fedavg, post_train_steps: 5}]"])
    assert [m.label for m in config.methods] == ["fedavg", "fedavg+post"]


def test_bad_override_syntax(tiny_run):
    assert "key.sub=value" in _error(tiny_run, ["federation.rounds"])


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_quickstart_config_is_valid():
    config = load_config("configs/quickstart.yaml")
    assert config.data.num_clients >= 20 and config.data.partition.name == "dirichlet"
    assert {m.label for m in config.methods} == {"local", "fedavg", "fedavg+post", "ditto"}
    assert config.model.lora is not None


def test_a_method_entry_may_choose_its_own_client_model_and_another_one_starts_without_options(tiny_run):
    from rayfed.config import method_model_config

    tiny_run["model"].update(client="mome", client_options={"text_positions": 8})
    tiny_run["methods"] = [{"name": "fedavg", "model": {"client": "my.models:Tiny"}},
                           {"name": "fedavg", "label": "b", "model": {"client_options": {"layers": 2}}},
                           {"name": "fedavg", "label": "c", "model": {"client": None}}, {"name": "fedavg", "label": "d"}]
    config = load_config(tiny_run)
    models = [method_model_config(config.model, entry, index) for index, entry in enumerate(config.methods)]
    assert [(m.client, m.client_options) for m in models] == [
        ("my.models:Tiny", {}), ("mome", {"layers": 2}), (None, {}), ("mome", {"text_positions": 8})]


def test_client_options_without_a_client_model_are_one_sentence(tiny_run):
    tiny_run["model"]["client_options"] = {"text_positions": 8}
    assert _error(tiny_run, []) == ("model.client_options = {'text_positions': 8} is invalid: it needs model.client, "
                                    "the client model these are options of (the default model's settings are "
                                    "model.module, lora, adapter, vpt, prompt and head).")


def test_the_old_base_novel_section_says_what_to_write_instead(tiny_run):
    tiny_run["data"]["base_novel"] = {"shots": 16}
    assert _error(tiny_run, []) == (
        "data.base_novel is now a partitioner: write data.partition: {name: base_novel, options: {shots, class_seed, "
        "base_excludes_local}} instead (docs/pfedmma.md#data-and-metrics).")


def test_a_data_field_a_plug_in_replaced_is_refused_with_the_plug_ins_sentence(tiny_run, monkeypatch):
    from rayfed import compat

    monkeypatch.setitem(compat._MOVED_FIELDS, "data.old_split", "data.old_split is now a partitioner: write "
                        "data.partition: {name: new_split} instead.")
    tiny_run["data"]["old_split"] = {"k": 1}
    assert _error(tiny_run, []) == "data.old_split is now a partitioner: write data.partition: {name: new_split} instead."
    del tiny_run["data"]["old_split"]
    tiny_run["data"]["other_split"] = 1  # a field no plug-in replaced: the unknown field's own error
    assert "other_split" in _error(tiny_run, []) and "partitioner" not in _error(tiny_run, [])


def test_partition_options_reach_the_partitioner_as_given(tiny_run):
    tiny_run["data"]["partition"] = {"name": "base_novel", "options": {"shots": 4, "class_seed": 7}}
    assert load_config(tiny_run).data.partition.options == {"shots": 4, "class_seed": 7}
