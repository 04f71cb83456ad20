"""LLaVA-1.5: its paper-size configurations (on Llama-3.2 or Qwen2.5), its pretrained loader and its backbone."""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from rayfed.lazy import DeferredModule
from rayfed.models.backbone import IMAGE, TEXT, Backbone
from rayfed.models.families.common import PaperModel, _image_normalization, _paper_size, _text_limit, _with_layers
from rayfed.models.families.llm import LLAMA_SIZES, LLM_LORA_TARGETS, llama_config
from rayfed.models.features import causal_lm_features, causal_lm_logits

transformers = DeferredModule("transformers")


def _paper_llava(language: str, layers: int | None) -> PaperModel:
    """LLaVA-1.5 on a Llama-3.2 (``llama-1B``, ``llama-3B``) or Qwen2.5 (``qwen-0.5B``, ``-1.5B``, ``-3B``) language
    model (small and large clients mixed in one federation); the language model keeps its vocabulary size, LLaVA's
    image token takes a special id it already has (rayfed.zoo.paper)."""
    from rayfed.zoo import paper

    family, _, size = language.partition("-")
    _paper_size("llava", language, [*(f"llama-{s}" for s in LLAMA_SIZES if s != "tiny"),
                                    *(f"qwen-{s}" for s in paper.QWEN_2_5_SIZES)])
    if family == "llama":
        vocab = paper.LLAMA_3
        text_config = llama_config(size, {"bos_token_id": vocab.special["bos_token"][1],
                                          "eos_token_id": vocab.special["eos_token"][1]}, layers)
    else:
        vocab = paper.QWEN_2_5_VOCABULARY
        eos = vocab.special["eos_token"][1]  # Qwen2.5's config.json: bos_token_id = eos_token_id = <|endoftext|>
        text_config = transformers.Qwen2Config(**_with_layers(paper.QWEN_2_5_SIZES[size], layers), **paper.QWEN_2_5,
                                               bos_token_id=eos, eos_token_id=eos)
    vision_config = transformers.CLIPVisionConfig(**_with_layers(paper.CLIP_VIT_L_14_336, layers))
    image_token, image_token_id = vocab.image
    config = transformers.LlavaConfig(
        vision_config=vision_config, text_config=text_config, image_token_id=image_token_id,
        image_seq_length=(vision_config.image_size // vision_config.patch_size) ** 2,
        tie_word_embeddings=text_config.tie_word_embeddings, **paper.LLAVA_1_5,
    )  # fmt: skip
    text = paper.tokenizer(vocab, text_config.max_position_embeddings)
    processor = paper.llava_processor(text, image_token, vision_config.image_size, vision_config.patch_size)
    return PaperModel(config, processor)


def _hf_llava(name_or_path: str, dtype: torch.dtype | str) -> Backbone:
    processor = transformers.AutoProcessor.from_pretrained(name_or_path)
    encoder = transformers.LlavaForConditionalGeneration.from_pretrained(name_or_path, dtype=dtype)
    tokenizer = processor.tokenizer
    if not getattr(tokenizer, "chat_template", None) and getattr(processor, "chat_template", None):
        tokenizer.chat_template = processor.chat_template  # saved with the processor: the prompts' format all the same
    return _llava(encoder, tokenizer, _image_normalization(name_or_path))


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (False without a usable GPU)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _image_token_mask(model: nn.Module, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor,
                      image_features: torch.Tensor) -> torch.Tensor:
    """transformers' ``LlavaModel.get_placeholder_mask`` (where the image features go), whose check that the image
    tokens and features agree in number reads the count back to the host (its message formats it): under a CUDA
    graph's capture (``train.cuda_graphs``), which cannot hold a read, the same mask without the check (the warm-up
    before a capture runs uncaptured, and checks); anywhere else transformers' own."""
    if input_ids is None or not capturing():
        return type(model).get_placeholder_mask(model, input_ids, inputs_embeds=inputs_embeds,
                                                image_features=image_features)
    return (input_ids == model.config.image_token_id).unsqueeze(-1)


def _llava(encoder: nn.Module, tokenizer: Any, normalization: Mapping[str, Any]) -> Backbone:
    """LoRA in the language model only; a text reads its image tokens where it marks them with the image token,
    else before it; its limit is the language model's positions, which hold the image tokens too."""
    encoder.model.get_placeholder_mask = types.MethodType(_image_token_mask, encoder.model)
    config, vision = encoder.config, encoder.config.vision_config
    image_tokens = (vision.image_size // vision.patch_size) ** 2
    image_token = tokenizer.convert_ids_to_tokens(config.image_token_id)
    return Backbone(
        encoder, config.text_config.hidden_size, vision.image_size, vision.num_channels, causal_lm_features,
        frozenset({IMAGE, TEXT}), causal_lm_logits, tokenizer, lora_targets=LLM_LORA_TARGETS,
        lora_scope="model.language_model", image_prompt=image_token * image_tokens, image_placeholder=image_token,
        text_limit=_text_limit(tokenizer, config.text_config.max_position_embeddings), **normalization,
    )  # fmt: skip
