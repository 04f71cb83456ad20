"""The layers of TAP's modular model made from a pretrained transformer's (frozen, with LoRA): an expert over a
layer's FFN, the attention, and the MoTE / MoME blocks whose layers route each path to its expert
(docs/tap.md#the-model)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

from rayfed.lazy import DeferredModule
from rayfed.models.peft.modules import AdaptedMLP

peft = DeferredModule("peft")


def with_lora(module: nn.Module, targets: list[str], rank: int, dropout: float) -> nn.Module:
    """``module`` with peft LoRA (alpha = 2 rank) on the submodules named ``targets``; only LoRA trains."""
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout, target_modules=targets)
    module = peft.inject_adapter_in_model(config, module)
    for name, param in module.named_parameters():
        param.requires_grad_("lora_" in name)
    return module


def frozen_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` that does not train."""
    return copy.deepcopy(module).requires_grad_(False)


class Expert(nn.Module):
    """A layer's pretrained FFN ``Linear -> GELU -> Linear`` (frozen, the same tensors in every expert of the
    layer) with LoRA on both linears, or with ``adapters`` after it instead: ``h + A(h)`` on the FFN's output h
    with the ``shared`` adapter, or a mixture of the named ones (:func:`rayfed.models.peft.modules.set_adapter_mix`)."""

    def __init__(self, first: nn.Linear, second: nn.Linear, rank: int | None, dropout: float,
                 adapters: nn.ModuleDict | None = None):
        super().__init__()
        ffn = nn.Sequential(first, nn.GELU(), second)
        self.ffn = with_lora(ffn, ["0", "2"], rank, dropout) if adapters is None else AdaptedMLP(ffn, adapters)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn(x)


class Attention(nn.Module):
    """A pretrained BERT-style self-attention (frozen copies of query, key, value and output) with LoRA on query
    and value (none with ``rank`` None); a key-padding mask keeps padded tokens out."""

    def __init__(self, layer: nn.Module, heads: int, rank: int | None, dropout: float):
        super().__init__()
        attention = layer.attention
        self.heads = heads
        self.query, self.key, self.value = (frozen_copy(getattr(attention.attention, n))
                                            for n in ("query", "key", "value"))
        self.output = frozen_copy(attention.output.dense)
        if rank is not None:
            with_lora(self, ["query", "value"], rank, dropout)

    def forward(self, q_in: torch.Tensor, k_in: torch.Tensor, v_in: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        size, length, width = k_in.shape

        def split(x: torch.Tensor) -> torch.Tensor:
            return x.view(size, length, self.heads, width // self.heads).transpose(1, 2)

        keep = mask.bool()[:, None, None, :]
        attended = nn.functional.scaled_dot_product_attention(split(self.query(q_in)), split(self.key(k_in)),
                                                              split(self.value(v_in)), attn_mask=keep)
        return self.output(attended.transpose(1, 2).reshape(size, length, width))


# Builds an expert over a layer's (frozen) FFN linears.
ExpertFactory = Callable[[nn.Linear, nn.Linear], Expert]


class MoEBlockLayer(nn.Module):
    """One layer of a MoTE / MoME block: ``x += MHA(LN1(x))`` with per-domain residual experts on q and v
    ("MoDE"), then ``x += expert(LN2(x))`` with the expert the route chooses."""

    def __init__(self, layer: nn.Module, ffn: tuple[nn.Linear, nn.Linear], heads: int, attention_rank: int | None,
                 dropout: float, domains: Sequence[str], expert: ExpertFactory):
        super().__init__()
        self.attention_norm = frozen_copy(layer.layernorm_before)
        self.attention = Attention(layer, heads, attention_rank, dropout)
        self.expert_norm = frozen_copy(layer.layernorm_after)
        self.mode_q = nn.ModuleDict({d: expert(*ffn) for d in domains})
        self.mode_v = nn.ModuleDict({d: expert(*ffn) for d in domains})

    def forward(self, x: torch.Tensor, mask: torch.Tensor, experts: Sequence[nn.Module], domain: str) -> torch.Tensor:
        """``x``: the inputs of ``len(experts)`` routes through this block, stacked along the batch; route i's
        rows go through ``experts[i]`` (the attention treats every row alone, so stacking changes nothing)."""
        normed = self.attention_norm(x)
        q_in, v_in = normed, normed
        if domain in self.mode_q:
            q_in = normed + self.mode_q[domain](normed)
            v_in = normed + self.mode_v[domain](normed)
        x = x + self.attention(q_in, normed, v_in, mask)
        chunks = x.chunk(len(experts)) if len(experts) > 1 else (x,)
        return torch.cat([chunk + expert(self.expert_norm(chunk)) for chunk, expert in zip(chunks, experts)])


class MoEBlock(nn.Module):
    """A MoTE or MoME block: L layers, each fed the experts of that layer of the routes it runs."""

    def __init__(self, layers: Sequence[nn.Module], ffns: Sequence[tuple[nn.Linear, nn.Linear]], heads: int,
                 attention_rank: int | None, dropout: float, domains: Sequence[str], expert: ExpertFactory):
        super().__init__()
        self.layers = nn.ModuleList([MoEBlockLayer(layer, ffn, heads, attention_rank, dropout, domains, expert)
                                     for layer, ffn in zip(layers, ffns)])

    def forward(self, x: torch.Tensor, mask: torch.Tensor, experts: Sequence[Sequence[nn.Module]], domain: str,
                ) -> torch.Tensor:
        """``experts[l]``: layer l's expert of each route stacked in ``x``."""
        for layer, layer_experts in zip(self.layers, experts):
            x = layer(x, mask, layer_experts, domain)
        return x
