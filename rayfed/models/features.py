"""How a backbone's encoder is called: features (batch, d) for heads, next-token logits for text tasks."""

from __future__ import annotations

import functools

import torch
from torch import nn

from rayfed.types import Batch


def cls_features(encoder: nn.Module, inputs: Batch) -> torch.Tensor:
    """The first token of the last hidden state (HF ViT)."""
    return encoder(pixel_values=inputs["pixel_values"]).last_hidden_state[:, 0]


def pooler_features(encoder: nn.Module, inputs: Batch) -> torch.Tensor:
    """The pooled output (CLIP's vision tower)."""
    return encoder(pixel_values=inputs["pixel_values"]).pooler_output


def output_features(encoder: nn.Module, inputs: Batch) -> torch.Tensor:
    """The module's output on the images (open_clip's image tower, a user's own encoder)."""
    return encoder(inputs["pixel_values"])


def vilt_features(encoder: nn.Module, inputs: Batch) -> torch.Tensor:
    """ViLT's pooled [CLS] of the image and the text, both required: a task without text reads a lone
    [CLS] [SEP], one without images a mid-gray image."""
    return encoder(**_text_and_image(encoder, inputs)).pooler_output


def flava_features(encoder: nn.Module, inputs: Batch) -> torch.Tensor:
    """FLAVA's [CLS]: of its multimodal encoder for image + text, else of the image or the text encoder."""
    output = encoder(**{k: inputs[k] for k in ("pixel_values", "input_ids", "attention_mask") if k in inputs})
    if output.multimodal_embeddings is not None:
        return output.multimodal_embeddings[:, 0]
    return (output.image_embeddings if output.image_embeddings is not None else output.text_embeddings)[:, 0]


def causal_lm_logits(encoder: nn.Module, inputs: Batch) -> torch.Tensor:
    """Next-token logits (batch, tokens, vocabulary) of a causal LM or LLaVA, from one pass over the whole texts
    (training, a test batch's loss): no KV cache, which HF would otherwise fill (a copy of every layer's keys and
    values) for no later step to read."""
    return encoder(**_lm_inputs(inputs), use_cache=False).logits


def causal_lm_features(encoder: nn.Module, inputs: Batch) -> torch.Tensor:
    """The last hidden state at each sequence's last real token (for a classification head)."""
    hidden = encoder(**_lm_inputs(inputs), output_hidden_states=True, use_cache=False).hidden_states[-1]
    last = inputs["attention_mask"].sum(dim=1) - 1
    return hidden[torch.arange(len(hidden), device=hidden.device), last]


def _lm_inputs(inputs: Batch) -> Batch:
    return {k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values") if k in inputs}


@functools.lru_cache(maxsize=None)
def _empty_text(bos: int, eos: int, device: torch.device) -> torch.Tensor:
    """The token ids of an empty text, made once per device: made in each forward, they were a copy from the host,
    which the host waits for and a captured step (``train.cuda_graphs``) cannot hold."""
    return torch.tensor([[bos, eos]], device=device)


def _text_and_image(encoder: nn.Module, inputs: Batch) -> Batch:
    config = encoder.config
    present = inputs["input_ids"] if "input_ids" in inputs else inputs["pixel_values"]
    size, device = len(present), present.device
    if "input_ids" not in inputs:
        ids = _empty_text(config.bos_token_id or 1, config.eos_token_id or 2, device).expand(size, -1)
        inputs = {**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if "pixel_values" not in inputs:
        inputs = {**inputs, "pixel_values": torch.zeros(size, config.num_channels, config.image_size, config.image_size,
                                                        device=device)}
    return {k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values")}
