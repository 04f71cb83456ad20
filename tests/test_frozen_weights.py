"""A frozen backbone's linear and convolution weights stored in bf16 on a GPU: the same products, restored exactly."""

from __future__ import annotations

import copy

import torch
from torch import nn

from rayfed.models.frozen_weights import FrozenWeights

GPU = torch.device("cuda")


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patches = nn.Conv2d(3, 16, 4, stride=4)
        self.norm = nn.LayerNorm(16)
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)
        self.positions = nn.Embedding(4, 16)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.patches(images).flatten(2).transpose(1, 2) + self.positions.weight
        tokens = self.norm(tokens)
        tokens = tokens + self.attention(tokens, tokens, tokens, need_weights=False)[0]
        return self.head(torch.relu(self.body(tokens))).mean(1)


def _frozen_but_head() -> Tower:
    tower = Tower()
    for name, param in tower.named_parameters():
        param.requires_grad_(name.startswith("head."))
    return tower


def test_only_frozen_linear_and_convolution_tensors_are_stored_in_bf16():
    tower = _frozen_but_head()
    assert FrozenWeights().store_in_bf16(tower, GPU, "bf16") == 4  # patches and body: weight and bias each
    dtypes = {name: param.dtype for name, param in tower.named_parameters()}
    assert {n for n, d in dtypes.items() if d == torch.bfloat16} == {
        "patches.weight", "patches.bias", "body.weight", "body.bias"}
    # trained (the head), looked up (positions), normalised, and attention's own projections keep float32
    assert dtypes["head.weight"] == dtypes["positions.weight"] == dtypes["norm.weight"] == torch.float32
    assert dtypes["attention.out_proj.weight"] == dtypes["attention.in_proj_weight"] == torch.float32


def test_nothing_is_stored_off_a_gpu_or_without_autocast():
    for device, autocast in ((torch.device("cpu"), "bf16"), (GPU, "off")):
        tower = _frozen_but_head()
        assert FrozenWeights().store_in_bf16(tower, device, autocast) == 0
        assert all(p.dtype == torch.float32 for p in tower.parameters())


def test_under_bf16_autocast_the_stored_weights_give_the_same_outputs_bitwise():
    tower, stored = _frozen_but_head(), _frozen_but_head()
    FrozenWeights().store_in_bf16(stored, GPU, "bf16")
    images = torch.randn(2, 3, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(stored(images), tower(images))


def test_restore_puts_back_the_exact_float32_values_for_the_next_method():
    tower = _frozen_but_head()
    before = copy.deepcopy(tower.state_dict())
    frozen = FrozenWeights()
    frozen.store_in_bf16(tower, GPU, "bf16")
    frozen.restore()
    assert all(torch.equal(value, before[name]) and value.dtype == torch.float32
               for name, value in tower.state_dict().items())
    tower.body.weight.requires_grad_(True)  # the next method trains body: only the patches are stored
    assert frozen.store_in_bf16(tower, GPU, "bf16") == 3
    assert tower.body.weight.dtype == torch.float32 and tower.body.bias.dtype == torch.bfloat16
