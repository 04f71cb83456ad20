"""pFedMMA's multi-modal adapter (*pFedMMA: Personalized Federated Fine-Tuning with Multi-Modal Adapter for
Vision-Language Models*, Eq. 2; docs/pfedmma.md#the-method).

For every adapted block j (1-based, ``first_layer``..L) of both CLIP towers::

    u  = LN1_j(z)                                  # the block's own frozen ln_1
    z' = Block_j(z) + GS(alpha * A_j(LN1_j(GS(z, alpha))), 1 / alpha)
    A_j^(o)(u) = W_up^(o) relu(W_shared relu(W_down^(o) u))     o in {image, text}

The down- and up-projections are per tower; ``W_shared`` (r x r) is one module used by both towers
(``tied``), or one per tower when untied (the paper's Table 6 variants). The gradient-scale layer GS is
the identity forward and scales the gradient by its factor backward: adapter weights get 1/alpha times
their true gradient while the gradient flowing into z stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

TOWERS = ("image", "text")


class GradScale(torch.autograd.Function):
    """Identity in the forward pass; multiplies the incoming gradient by ``scale`` in the backward pass."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:  # noqa: D102
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        return grad * ctx.scale, None


def grad_scale(x: torch.Tensor, scale: float) -> torch.Tensor:
    return GradScale.apply(x, scale)


def _linear(fan_in: int, fan_out: int) -> nn.Linear:
    layer = nn.Linear(fan_in, fan_out)
    nn.init.kaiming_normal_(layer.weight, mode="fan_out", nonlinearity="relu")
    nn.init.zeros_(layer.bias)
    return layer


class MultiModalAdapter(nn.Module):
    """All adapter weights of both towers. Parameter names (what methods select by prefix):

    ``{tower}_down.{j}``, ``{tower}_up.{j}`` (local), and ``shared.{j}`` when tied, else ``{tower}_shared.{j}``.
    """

    def __init__(
        self, widths: dict[str, int], rank: int, blocks: Sequence[int], alpha: float,
        *, tied: bool = True, grad_scale: bool = True,
    ):
        super().__init__()
        self.blocks = tuple(blocks)
        self.alpha = alpha
        self.grad_scale = grad_scale
        self.tied = tied
        keys = [str(j) for j in self.blocks]
        # Creation order fixes the initial values for a given seed: down, shared, up per block and tower.
        for tower in TOWERS:
            setattr(self, f"{tower}_down", nn.ModuleDict({k: _linear(widths[tower], rank) for k in keys}))
            if not tied:
                setattr(self, f"{tower}_shared", nn.ModuleDict({k: _linear(rank, rank) for k in keys}))
            setattr(self, f"{tower}_up", nn.ModuleDict({k: _linear(rank, widths[tower]) for k in keys}))
        if tied:
            self.shared = nn.ModuleDict({k: _linear(rank, rank) for k in keys})

    def shared_projection(self, tower: str, block: int) -> nn.Linear:
        modules = self.shared if self.tied else getattr(self, f"{tower}_shared")
        return modules[str(block)]

    def adapt(self, tower: str, block: int, u: torch.Tensor) -> torch.Tensor:
        """``A_j^(o)(u)`` (Eq. 2): down, ReLU, shared r x r, ReLU, up."""
        hidden = torch.relu(getattr(self, f"{tower}_down")[str(block)](u))
        hidden = torch.relu(self.shared_projection(tower, block)(hidden))
        return getattr(self, f"{tower}_up")[str(block)](hidden)

    def branch(self, tower: str, block: int, z: torch.Tensor, ln_1: nn.Module) -> torch.Tensor:
        """The residual ``alpha * A(LN1(z))`` added to the block's output, with GS around it when on."""
        if not self.grad_scale:
            return self.alpha * self.adapt(tower, block, ln_1(z))
        inner = grad_scale(z, self.alpha)
        return grad_scale(self.alpha * self.adapt(tower, block, ln_1(inner)), 1.0 / self.alpha)


def attach(adapter: MultiModalAdapter, tower: str, blocks: Sequence[nn.Module], ln_1_name: str) -> list:
    """Run ``adapter`` in parallel with ``blocks[j - 1]`` for each adapted j; returns the hook handles.

    ``blocks`` are a tower's residual blocks in order and ``ln_1_name`` the attribute holding each block's
    first LayerNorm (open_clip ``ln_1``, HF ``layer_norm1``). A forward hook adds the branch to the block's
    output (a tensor, or the first element of a tuple).
    """
    handles = []
    for j in adapter.blocks:
        block = blocks[j - 1]

        def hook(module, args, kwargs, output, j=j):
            z = args[0] if args else kwargs["hidden_states"]
            residual = adapter.branch(tower, j, z, getattr(module, ln_1_name))
            if isinstance(output, tuple):
                return (output[0] + residual, *output[1:])
            return output + residual

        handles.append(block.register_forward_hook(hook, with_kwargs=True))
    return handles

