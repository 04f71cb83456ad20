"""ViLT's and FLAVA's self-attention blocks routed through SDPA on a GPU: the fused products equal the eager ones."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from rayfed.models.fused_attention import fuse_self_attention, fused_block_forward

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def _tiny_vilt() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.ViltModel(transformers.ViltConfig(**TINY, image_size=32, patch_size=16)).eval()


def _tiny_flava() -> torch.nn.Module:
    torch.manual_seed(0)
    part = dict(TINY, num_hidden_layers=1)
    config = transformers.FlavaConfig(image_config=dict(part, image_size=32, patch_size=16), text_config=part,
                                      multimodal_config=part, hidden_size=32, projection_dim=32)
    return transformers.FlavaModel(config).eval()


def test_every_self_attention_block_of_vilt_and_flava_is_routed():
    assert fuse_self_attention(_tiny_vilt()) == 2
    assert fuse_self_attention(_tiny_flava()) == 3  # the image, text and multimodal encoders' one layer each


@pytest.mark.parametrize("training", [False, True])
def test_the_fused_block_equals_the_eager_block_with_a_padding_mask(training):
    block = _tiny_vilt().encoder.layer[0].attention.attention.train(training)
    hidden = torch.randn(3, 7, 32)
    keep = torch.ones(3, 7)
    keep[1, 4:] = 0
    keep[2, 2:] = 0
    additive = (1.0 - keep[:, None, None, :]) * torch.finfo(torch.float32).min
    eager = block(hidden, additive)[0]
    fused = fused_block_forward(block, hidden, additive)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-6)
    assert not torch.equal(fused[2], fused_block_forward(block, hidden)[2])  # the mask is applied


def test_a_cpu_forward_keeps_the_eager_products_bitwise_and_probabilities_stay_available():
    model = _tiny_vilt()
    routed = copy.deepcopy(model)
    fuse_self_attention(routed)
    inputs = dict(input_ids=torch.tensor([[101, 7, 9, 102]]), pixel_values=torch.randn(1, 3, 32, 32),
                  pixel_mask=torch.ones(1, 32, 32, dtype=torch.long))
    assert torch.equal(routed(**inputs).last_hidden_state, model(**inputs).last_hidden_state)
    block = routed.encoder.layer[0].attention.attention
    hidden = torch.randn(2, 5, 32)
    assert len(block(hidden, None, True)) == 2  # (context, probabilities): the eager forward answers


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused path runs on a GPU only")
def test_on_a_gpu_the_routed_model_matches_the_eager_one_within_bf16_round_off():
    model = _tiny_vilt().cuda()
    routed = copy.deepcopy(model)
    assert fuse_self_attention(routed) == 2
    inputs = dict(input_ids=torch.tensor([[101, 7, 9, 102, 0]], device="cuda"),
                  attention_mask=torch.tensor([[1, 1, 1, 1, 0]], device="cuda"),
                  pixel_values=torch.randn(1, 3, 32, 32, device="cuda"),
                  pixel_mask=torch.ones(1, 32, 32, dtype=torch.long, device="cuda"))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        torch.manual_seed(1)
        eager = model(**inputs).last_hidden_state.float()
        torch.manual_seed(1)
        fused = routed(**inputs).last_hidden_state.float()
    torch.testing.assert_close(fused, eager, rtol=2e-2, atol=2e-2)
