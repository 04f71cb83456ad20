"""Structured parameter names (rayfed.param_names): the decoder layer and a named adapter's tensor."""

from rayfed.param_names import AdapterTensor, adapter_tensor, layer_of


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
