"""Structured parameter names (rayfed.param_names): parsed and formatted, and names that do not parse."""

import pytest

from rayfed.architectures import prefixed, unprefixed
from rayfed.param_names import (AdapterTensor, adapter_of, adapter_param, adapter_part, adapter_set_of, adapter_tensor,
                                behind, components, layer_of, leaf, parent, prefix_of, prefixed_name, split_prefix,
                                task_key, task_of_name, with_adapter, with_adapter_set)


def test_a_named_adapters_tensor_is_parsed_into_layer_module_adapter_and_part():
    name = "encoder.model.language_model.layers.7.mlp.down_proj.local_P"
    assert layer_of(name) == 7
    assert adapter_tensor(name) == AdapterTensor(7, "mlp.down_proj", "local", "P")
    assert adapter_tensor("encoder.layers.0.self_attn.q_proj.frozen_global_A") == AdapterTensor(
        0, "self_attn.q_proj", "frozen_global", "A")


def test_names_outside_a_decoder_layer_or_an_adapter_are_not_parsed():
    assert layer_of("head.task_0.weight") is None and layer_of("encoder.sublayers.3.weight") is None
    assert adapter_tensor("encoder.layers.3.self_attn.q_proj.A") is None  # the PQ basis, no adapter
    assert adapter_tensor("encoder.layers.3.adapter_gate.beta") is None
    assert adapter_tensor("head.local_A") is None


def test_task_components_round_trip_and_other_digits_are_not_tasks():
    for index in (0, 7, 12):
        assert task_of_name(f"heads.{task_key(index)}.weight") == index
        assert task_of_name(f"blocks.3.adapters.{task_key(index)}") == index
    assert task_of_name("heads.task_1x.weight") is None and task_of_name("heads.subtask_1.weight") is None
    assert task_of_name("encoder.layers.1.weight") is None


def test_prefixed_names_round_trip_and_an_unprefixed_name_is_named_in_the_error():
    name = prefixed_name("small", "encoder.layers.0.q_proj.local_A")
    assert split_prefix(name) == ("small", "encoder.layers.0.q_proj.local_A")
    assert prefix_of(name) == "small" and behind(name, "small") == "encoder.layers.0.q_proj.local_A"
    assert split_prefix(prefixed_name("3", prefixed_name("shared", "w"))) == ("3", "shared/w")
    assert prefix_of("encoder.weight") is None and behind(name, "smal") is None and behind(name, "large") is None
    with pytest.raises(ValueError, match=r"'encoder\.weight' has no '<prefix>/'"):
        split_prefix("encoder.weight")


def test_architecture_prefixes_go_through_the_same_names():
    tensors = {"a.weight": 1, "b.local_A": 2}
    server = prefixed(tensors, "small")
    assert list(server) == [prefixed_name("small", name) for name in tensors]
    assert unprefixed({**server, **prefixed({"c": 3}, "large")}, "small") == tensors


def test_a_named_adapters_tensor_is_renamed_to_another_adapter_and_back():
    name = "encoder.layers.2.mlp.down_proj.local_P"
    assert adapter_part(name) == ("local", "P") and adapter_of(name) == "local"
    assert with_adapter(name, "global") == "encoder.layers.2.mlp.down_proj.global_P"
    assert with_adapter(with_adapter(name, "global"), "local") == name
    assert adapter_param("frozen_global", "A") == "frozen_global_A" and adapter_of("q.frozen_global_A") == "frozen_global"
    assert adapter_part("encoder.layers.2.q_proj.A") is None and adapter_of("head.bias") is None
    with pytest.raises(ValueError, match=r"'head\.bias' does not end with '<adapter>_<part>'"):
        with_adapter("head.bias", "global")


def test_an_adapter_sets_tensor_is_renamed_to_another_set():
    name = "encoder.layer.1.output.adapters.shared.down.weight"
    assert adapter_set_of(name) == "shared"
    assert with_adapter_set(name, "frozen") == "encoder.layer.1.output.adapters.frozen.down.weight"
    assert adapter_set_of("encoder.adapters") is None and adapter_set_of("head.task_0.weight") is None
    with pytest.raises(ValueError, match=r"'head\.weight' has no 'adapters\.<set>'"):
        with_adapter_set("head.weight", "frozen")


def test_dotted_paths_split_into_parent_and_leaf():
    assert (parent("a.b.c"), leaf("a.b.c"), components("a.b.c")) == ("a.b", "c", ["a", "b", "c"])
    assert (parent("c"), leaf("c")) == ("", "c")
