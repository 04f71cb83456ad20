"""RELA's pieces for FedMosaic (:mod:`rayfed.methods.fedmosaic.method`, docs/fedmosaic.md#rela): the gradient of one
frozen linear layer that each client takes on its batches and decays over the rounds, and the relevance weights the
server turns those gradients into."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from rayfed.data.batches import num_rows
from rayfed.errors import ConfigError
from rayfed.methods.fedmosaic import pqlora
from rayfed.models import ClientModel
from rayfed.models.peft.named_adapters import AdaptedLinear, adapters_off, decoder_layers
from rayfed.param_names import layer_of
from rayfed.training import Step, stacked_forward_batch


def linear_weight_gradient(run: Callable[[], torch.Tensor], layer: nn.Linear) -> torch.Tensor:
    """The gradient of ``run()`` (a loss) with respect to ``layer``'s weight, with every parameter frozen: the
    layer's output is made the one leaf that needs a gradient, and ``dL/dW = sum_tokens dL/dy x^T``."""
    captured: dict[str, torch.Tensor] = {}

    def hook(module, args, output):
        captured["x"] = args[0].detach()
        captured["y"] = output.detach().requires_grad_(True)
        return captured["y"].view_as(output)  # not the leaf itself: FLOP counting hooks every module's output

    handle = layer.register_forward_hook(hook)
    try:
        with torch.enable_grad():
            loss = run()
            (grad_y,) = torch.autograd.grad(loss, captured["y"])
    finally:
        handle.remove()
    return grad_y.flatten(0, -2).float().T @ captured["x"].flatten(0, -2).float()


@dataclass(frozen=True)
class RelevanceSource:
    """W_s as the client model keeps it (in its attachments): the linear layer whose weight gradient is the
    relevance feature, and W_s's own model, or None when W_s is the client model with its adapters off."""

    layer: nn.Linear
    model: ClientModel | None = None


def last_linear(encoder: nn.Module, scope: str | None, which: str) -> nn.Linear:
    """The frozen linear layer RELA differentiates: the last decoder layer's ``down_proj`` or the LM head."""
    if which == "lm_head":
        head = encoder.get_output_embeddings()
        if not isinstance(head, nn.Linear):
            raise ConfigError("methods (fedmosaic).last_layer = 'lm_head' needs a model with a linear LM head.")
        return head
    _, layers = decoder_layers(encoder, scope)
    for name, module in layers[-1].named_modules():
        if name.endswith("down_proj"):
            return module.base if isinstance(module, AdaptedLinear) else module
    raise ConfigError("methods (fedmosaic).last_layer = 'down_proj': the last decoder layer has no down_proj; "
                      "use lm_head.")


def relevance_weights(gradients: torch.Tensor, present: torch.Tensor, tau: float,
                      self_weight: str = "include") -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 4: ``S_ij = cos(g_i, g_j)`` and ``w_ij = exp(S_ij / tau) / sum_n exp(S_in / tau)`` over the clients that
    have sent a gradient (``present``), n = i included; ``exclude``: over n != i, so ``w_ii = 0``, except for a
    client that is the only one with a gradient, which keeps its own adapter (``w_ii = 1``). A client that has not
    sent a gradient weighs those that have equally (itself not among them). A zero gradient has cosine 0 with
    every gradient, itself included."""
    clients = len(gradients)
    cosine = torch.zeros(clients, clients)
    weights = torch.zeros(clients, clients)
    sent = gradients[present].double()
    unit = sent / sent.norm(dim=1, keepdim=True).clamp_min(1e-30)
    similarity = unit @ unit.T
    rows = torch.nonzero(present).flatten()
    cosine[rows.unsqueeze(1), rows] = similarity.float()
    logits = similarity / tau
    if self_weight == "exclude" and len(rows) > 1:
        logits.fill_diagonal_(-math.inf)
    weights[rows.unsqueeze(1), rows] = torch.softmax(logits, dim=1).float()
    weights[~present] = 0.0
    weights[~present.unsqueeze(1).expand(-1, clients) & present.unsqueeze(0)] = 1.0 / max(int(present.sum()), 1)
    return cosine, weights


def equal_weights(clients: int, self_weight: str) -> torch.Tensor:
    """Each of ``clients`` clients' equal weights over them all, or (``exclude``) over the others; one client alone
    keeps its own adapter."""
    if self_weight == "include" or clients == 1:
        return torch.full((clients, clients), 1.0 / clients)
    return torch.full((clients, clients), 1.0 / (clients - 1)).fill_diagonal_(0.0)


def decayed_gradient(previous: torch.Tensor | None, gradients: list[torch.Tensor], alpha: float, current: bool,
                     granularity: str) -> torch.Tensor | None:
    """Eq. 2 once per round on the round's mean (Alg. 1, ``granularity: round``), per gradient (``step``), or, with
    ``current``, the latest gradient alone."""
    if not gradients:
        return previous
    if current:
        return gradients[-1]
    decayed = torch.zeros_like(gradients[0]) if previous is None else previous.to(gradients[0].device)
    if granularity == "round":
        return (1 - alpha) * decayed + alpha * torch.stack(gradients).mean(0)
    for gradient in gradients:
        decayed = (1 - alpha) * decayed + alpha * gradient
    return decayed


def relevance_gradient(step: Step, variant: str) -> torch.Tensor:
    """The gradient on this step's batch: of W_s's last linear layer (frozen, no adapters), or, for the ``variant``
    ``training_current``, of the trained model's last PQ layer (its P and Q)."""
    model = step.model
    if variant == "training_current":
        last = max(model.attachments[pqlora.PQPlacement].pq_layers) - 1
        names = sorted(n for n in step.params if pqlora.is_local(n) and pqlora.is_pq(n) and layer_of(n) == last)
        grads = torch.autograd.grad(step.task_loss(), [step.params[n] for n in names], allow_unused=True)
        return torch.cat([(g if g is not None else torch.zeros_like(step.params[n])).flatten().float()
                          for g, n in zip(grads, names)]).detach().cpu()
    source = model.attachments[RelevanceSource]
    relevance_model = source.model
    total = sum(next(iter(batch.values())).shape[0] for _, batch in step.parts)

    def run() -> torch.Tensor:
        target = relevance_model if relevance_model is not None else model
        stacked = stacked_forward_batch(target, step.parts)  # the tasks in one forward, where W_s allows
        if stacked is None:
            outputs = [task.kind.forward(target, batch) for task, batch in step.parts]
        else:
            outputs = step.parts[0][0].kind.forward(target, stacked).split([num_rows(b) for _, b in step.parts])
        losses = []
        for (task, batch), output in zip(step.parts, outputs):
            share = next(iter(batch.values())).shape[0] / total
            losses.append(share * task.kind.loss(output, batch))
        return sum(losses)

    if relevance_model is None:
        with adapters_off(model):
            gradient = linear_weight_gradient(run, source.layer)
    else:
        relevance_model.to(step.client.device)
        gradient = linear_weight_gradient(run, source.layer)
    return gradient.detach().cpu()
