"""Causal language models: Llama-3.2-shaped ones, randomly initialised (``llama:<size>``), and pretrained ones."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from rayfed.errors import choice_error
from rayfed.lazy import DeferredModule
from rayfed.models.backbone import TEXT, Backbone, BackboneRequest
from rayfed.models.families.common import _quiet_loading, _text_limit, _with_layers, weights_dtype
from rayfed.models.features import causal_lm_features, causal_lm_logits
from rayfed.registry import register_backbone

transformers = DeferredModule("transformers")

LLM_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Llama-3.2's language models (config.json of meta-llama/Llama-3.2-1B and -3B) and a tiny one for tests: the
# `llama:<size>` backbones, randomly initialised.
LLAMA_SIZES: dict[str, dict[str, Any]] = {
    "1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256),
    "3B": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128, vocab_size=128256),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256),
}
_LLAMA_3_2 = dict(
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                  "original_max_position_embeddings": 8192},
)


def llama_config(size: str, token_ids: Mapping[str, int] | None = None, layers: int | None = None,
                 ) -> transformers.LlamaConfig:
    """The ``LlamaConfig`` of ``llama:<size>`` (one of :data:`LLAMA_SIZES`): its token ids ``token_ids``
    (``bos_token_id``, ...; default: the word tokenizer's), ``layers`` blocks if given."""
    from rayfed.zoo.tokenizers import word_tokenizer

    if size not in LLAMA_SIZES:
        raise choice_error("model.backbone", f"llama:{size}", [f"llama:{s}" for s in LLAMA_SIZES])
    if token_ids is None:
        tokenizer = word_tokenizer(append_eos=False)
        token_ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return transformers.LlamaConfig(**_with_layers(LLAMA_SIZES[size], layers), **_LLAMA_3_2, **token_ids)


@register_backbone("llama:")
def _random_llama(request: BackboneRequest) -> Backbone:
    """A randomly initialised Llama-3.2-shaped causal LM (``llama:1B``, ``llama:3B``; ``llama:tiny`` for tests)
    over the offline word tokenizer; bfloat16 weights where this process sees a GPU, else float32."""
    from rayfed.zoo.tokenizers import word_tokenizer

    config = llama_config(request.argument or "")
    with _quiet_loading():
        encoder = transformers.AutoModelForCausalLM.from_config(config, dtype=weights_dtype(torch.bfloat16))
    return _causal_lm(encoder, word_tokenizer(append_eos=False, model_max_length=config.max_position_embeddings))


def _hf_causal_lm(name_or_path: str, dtype: torch.dtype | str) -> Backbone:
    from rayfed.zoo.tokenizers import load_tokenizer

    encoder = transformers.AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
    return _causal_lm(encoder, load_tokenizer(name_or_path))


def _causal_lm(encoder: nn.Module, tokenizer: Any) -> Backbone:
    """A text-only causal LM's backbone: LoRA on every linear layer, texts up to its positions."""
    config = encoder.config
    return Backbone(
        encoder, config.hidden_size, None, 3, causal_lm_features, frozenset({TEXT}), causal_lm_logits, tokenizer,
        lora_targets=LLM_LORA_TARGETS, text_limit=_text_limit(tokenizer, config.max_position_embeddings),
    )  # fmt: skip
