"""Fused attention for the BERT-style self-attention blocks that transformers runs only eagerly (ViLT, FLAVA).

transformers gives these two families no SDPA path: each block multiplies queries by keys, adds the mask, runs a
softmax and multiplies by the values, four kernels and a (batch, heads, tokens, tokens) tensor in memory for every
layer, forward and backward. On a GPU, :func:`fuse_self_attention` has each block call
``torch.nn.functional.scaled_dot_product_attention`` instead (one fused kernel: memory-efficient or flash), over the
block's own ``query``/``key``/``value`` modules, so adapters and LoRA wrapped around them still apply. A CPU keeps
transformers' own forward, so CPU runs stay bitwise what they were; a call asking for the attention probabilities
does too, as the fused kernel never forms them.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_BLOCK_ATTRIBUTES = ("query", "key", "value", "dropout", "attention_head_size", "all_head_size")


def fuse_self_attention(encoder: nn.Module) -> int:
    """Route every BERT-style self-attention block of ``encoder`` (a module named ``*SelfAttention`` with ``query``,
    ``key``, ``value`` and ``dropout``) through :func:`fused_block_forward` on a GPU; returns how many it routed."""
    routed = 0
    for module in encoder.modules():
        if type(module).__name__.endswith("SelfAttention") and all(hasattr(module, a) for a in _BLOCK_ATTRIBUTES):
            module.eager_forward = module.forward
            module.forward = types.MethodType(_forward, module)
            routed += 1
    return routed


def _forward(block: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
             output_attentions: bool = False, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
    if output_attentions or args or kwargs or not hidden_states.is_cuda:
        return block.eager_forward(hidden_states, attention_mask, output_attentions, *args, **kwargs)
    return (fused_block_forward(block, hidden_states, attention_mask),)


def fused_block_forward(block: nn.Module, hidden_states: torch.Tensor,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The block's attention output, (batch, tokens, all_head_size), computed by SDPA: the same products as the eager
    forward (scale 1/sqrt(head size), the additive mask, dropout while training) in one kernel."""
    heads_shape = (*hidden_states.shape[:-1], -1, block.attention_head_size)
    query, key, value = (projection(hidden_states).view(heads_shape).transpose(1, 2)
                         for projection in (block.query, block.key, block.value))
    mask = None if attention_mask is None else attention_mask.to(query.dtype)
    context = F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                             dropout_p=block.dropout.p if block.training else 0.0)
    return context.transpose(1, 2).reshape(*hidden_states.shape[:-1], block.all_head_size)
