"""train.compile's regional compilation (rayfed/training/compiled_forward.py): which blocks compile, that blocks of
one class compile once, that only training forwards run compiled, and the fallback to eager."""

import functools

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from rayfed.training.compiled_forward import CompiledForward, repeated_blocks


class Block(nn.Module):
    def __init__(self, width: int, experts: int = 2):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))  # inside a block: not a block
        self.dropout = nn.Dropout(0.1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.norm(hidden)
        return hidden + self.dropout(sum(torch.relu(expert(normed)) for expert in self.experts))


class Stack(nn.Module):
    def __init__(self, width: int = 8, depth: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.heads = nn.ModuleList(nn.Linear(width, 3) for _ in range(2))  # leaves: not blocks
        self.mixed = nn.ModuleList([Block(width), nn.Sequential(nn.Linear(width, width))])  # two classes

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden)
        return self.heads[0](hidden)


@pytest.fixture
def aot_eager(monkeypatch):
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    counters.clear()


def test_the_blocks_are_the_outermost_lists_of_one_class_of_composite_modules():
    model = Stack()
    assert [id(block) for block in repeated_blocks(model)] == [id(layer) for layer in model.layers]
    assert repeated_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []


def test_blocks_of_one_class_compile_once_and_train_like_the_eager_model(aot_eager):
    torch.manual_seed(0)
    model = Stack()
    inputs = torch.randn(5, 8, requires_grad=True)  # every layer's input needs a gradient, as the first one's does
    torch.manual_seed(1)  # the same dropout draws in both
    eager_loss = model(inputs).square().mean()
    eager_grads = torch.autograd.grad(eager_loss, list(model.layers.parameters()))

    compiled = CompiledForward(model)
    torch.manual_seed(1)
    loss = compiled(inputs).square().mean()
    grads = torch.autograd.grad(loss, list(model.layers.parameters()))
    assert counters["stats"]["unique_graphs"] == 1  # four layers, one compilation
    assert torch.allclose(loss, eager_loss, rtol=1e-6, atol=1e-7)
    for grad, eager_grad in zip(grads, eager_grads):
        assert torch.allclose(grad, eager_grad, rtol=1e-5, atol=1e-7)
    compiled((inputs + 1).detach().requires_grad_())  # the same shape, other values: no new compilation
    assert counters["stats"]["unique_graphs"] == 1


def test_a_forward_outside_the_training_step_runs_the_blocks_eagerly(aot_eager):
    model = Stack().eval()
    compiled = CompiledForward(model)
    inputs = torch.randn(3, 8, requires_grad=True)
    with torch.no_grad():
        expected = model(inputs)
    assert counters["stats"]["unique_graphs"] == 0  # evaluation compiles nothing
    with torch.no_grad():
        assert torch.equal(compiled.model(inputs), expected)
    compiled(inputs)
    assert counters["stats"]["unique_graphs"] == 1


def test_a_block_that_fails_to_compile_gives_the_model_its_own_forwards_back(monkeypatch, caplog):
    def failing_compile(function, **options):
        def compiled(*args, **kwargs):
            raise torch._dynamo.exc.TorchDynamoException("cannot trace this")
        return compiled

    monkeypatch.setattr(torch, "compile", failing_compile)
    model = Stack().eval()  # no dropout: the eager outputs are the same each call
    compiled = CompiledForward(model)
    inputs = torch.randn(2, 8)
    with caplog.at_level("WARNING", logger="rayfed.training.compiled_forward"):
        outputs = compiled(inputs)
    assert "could not be compiled (TorchDynamoException: cannot trace this)" in caplog.text
    assert all("forward" not in vars(layer) for layer in model.layers)  # the class's forward again
    assert torch.equal(outputs, model(inputs))
    assert torch.equal(compiled(inputs), outputs)  # and it stays eager
