"""Backbones load through the real from_pretrained path; LoRA and head are the only trainables."""

from __future__ import annotations

import pytest
import torch
import transformers

from rayfed.config import LoraConfig, ModelConfig
from rayfed.errors import ConfigError
from rayfed.models import build_backbone, build_client_model, check_image_channels, cls_features, pooler_features

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16, patch_size=8)


def test_hf_vit_loads_from_a_save_pretrained_folder(tmp_path):
    torch.manual_seed(0)
    saved = transformers.ViTModel(transformers.ViTConfig(**TINY), add_pooling_layer=False)
    saved.save_pretrained(tmp_path)
    backbone = build_backbone(ModelConfig(backbone=f"hf:{tmp_path}", lora=None), seed=123)
    loaded = dict(backbone.encoder.named_parameters())
    assert all(torch.equal(loaded[n], p) for n, p in saved.named_parameters())
    assert (backbone.feature_dim, backbone.image_size, backbone.features) == (32, 16, cls_features)


def test_hf_clip_vision_tower_loads_from_a_full_clip_folder(tmp_path):
    config = transformers.CLIPConfig(
        text_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                         vocab_size=100, eos_token_id=2, bos_token_id=1, pad_token_id=0),
        vision_config=TINY, projection_dim=16,
    )
    transformers.CLIPModel(config).save_pretrained(tmp_path)
    backbone = build_backbone(ModelConfig(backbone=f"hf:{tmp_path}"), seed=0)
    assert backbone.features is pooler_features and backbone.feature_dim == 32
    model = build_client_model(backbone, ModelConfig(backbone=f"hf:{tmp_path}"), 5, seed=0)
    assert model(torch.zeros(2, 3, 16, 16)).shape == (2, 5)


def test_missing_hf_backbone_is_one_sentence(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.backbone = 'hf:.*could not be loaded"):
        build_backbone(ModelConfig(backbone=f"hf:{tmp_path / 'absent'}"), seed=0)


def test_unknown_backbone_suggests_a_name():
    with pytest.raises(ConfigError, match="did you mean 'tiny:vit'"):
        build_backbone(ModelConfig(backbone="tiny:vitt"), seed=0)


def test_lora_and_head_are_the_only_trainable_parameters():
    config = ModelConfig(backbone="tiny:vit", lora=LoraConfig(rank=2, targets=("q_proj", "v_proj")))
    model = build_client_model(build_backbone(config, seed=0), config, 10, seed=0)
    trainable = model.trainable_names()
    lora = [n for n in trainable if "lora_" in n]
    # 2 blocks x (q, v) x (A, B), no biases
    assert len(lora) == 2 * 2 * 2
    assert sorted(set(trainable) - set(lora)) == ["head.bias", "head.weight"]
    rank_2 = [p for n, p in model.named_parameters() if "lora_A" in n]
    assert all(p.shape[0] == 2 for p in rank_2)


def test_client_model_initialisation_depends_only_on_the_seed():
    config = ModelConfig()
    backbone = build_backbone(config, seed=0)
    first = build_client_model(backbone, config, 4, seed=7).trainable_params()
    second = build_client_model(backbone, config, 4, seed=7).trainable_params()
    third = build_client_model(backbone, config, 4, seed=8).trainable_params()
    assert all(torch.equal(first[n], second[n]) for n in first)
    assert any(not torch.equal(first[n], third[n]) for n in first)


def test_bad_lora_target_lists_the_linear_layers():
    config = ModelConfig(lora=LoraConfig(targets=("query",)))
    with pytest.raises(ConfigError, match=r"model\.lora\.targets.*q_proj"):
        build_client_model(build_backbone(config, seed=0), config, 4, seed=0)


def test_client_model_resizes_and_replicates_gray_images():
    config = ModelConfig(image_size=16)
    model = build_client_model(build_backbone(config, seed=0), config, 3, seed=0)
    pixels = model.pixels(torch.ones(2, 1, 8, 8))
    assert pixels.shape == (2, 3, 16, 16)
    assert torch.allclose(pixels, torch.ones_like(pixels))
    assert model(torch.rand(2, 1, 8, 8)).shape == (2, 3)


def test_colour_images_on_a_gray_only_mismatch_are_refused():
    backbone = build_backbone(ModelConfig(), seed=0)
    check_image_channels(1, backbone)
    with pytest.raises(ConfigError, match="2-channel images"):
        check_image_channels(2, backbone)


def test_open_clip_image_tower_with_lora_on_its_mlp(tmp_path):
    import open_clip
    import safetensors.torch

    config = ModelConfig(backbone="open_clip:ViT-B-16", lora=LoraConfig(rank=8, targets=("c_fc", "c_proj")))
    backbone = build_backbone(config, seed=0)
    assert (backbone.feature_dim, backbone.image_size) == (512, 224)
    model = build_client_model(backbone, config, 10, seed=0)
    lora = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and "lora_" in n)
    assert lora == 12 * 8 * ((768 + 3072) + (3072 + 768))  # rank 8 on c_fc (768->3072) and c_proj in 12 blocks
    default = build_client_model(backbone, config.model_copy(update={"lora": LoraConfig(rank=8)}), 10, seed=0)
    lora = sum(p.numel() for n, p in default.named_parameters() if p.requires_grad and "lora_" in n)
    assert lora == 12 * 8 * ((768 + 768) + (768 + 3072) + (3072 + 768))  # and on the attention's out_proj

    weights = tmp_path / "clip.safetensors"
    full = open_clip.create_model("ViT-B-16", pretrained=None)
    safetensors.torch.save_file({k: v.contiguous() for k, v in full.state_dict().items()}, weights)
    loaded = build_backbone(config.model_copy(update={"pretrained": str(weights)}), seed=1)
    assert torch.equal(loaded.encoder.conv1.weight, full.visual.conv1.weight)


def test_random_llama_backbones_by_size_and_a_bf16_one_passes_the_drivers_check_on_the_cpu(monkeypatch, tmp_path):
    from rayfed.actors.client import run_methods
    from rayfed.benchmarks.overhead import LLM_CPU_WORKLOAD
    from rayfed.data.clients import build_federation
    from rayfed.simulation import Simulation, check_model

    with pytest.raises(ConfigError, match=r"model\.backbone = 'llama:8B' is not known.*; allowed: llama:1B, llama:3B, "
                                          r"llama:tiny\."):
        build_backbone(ModelConfig(backbone="llama:8B"), seed=0)
    tiny = build_backbone(ModelConfig(backbone="llama:tiny"), seed=0)
    assert tiny.generates_text and tiny.encoder.dtype == torch.float32  # no GPU here: float32
    assert len(tiny.tokenizer) <= tiny.encoder.config.vocab_size
    # The driver of a GPU host builds bf16 weights and runs the method's model on two samples on its CPU.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    sim = Simulation(LLM_CPU_WORKLOAD.config(clients_per_actor=4, gpus_per_actor=0), out_dir=tmp_path / "run")
    federation = build_federation(sim.config.data, sim.config.seed)
    check_model(sim.config, federation, run_methods(sim.config, federation))
