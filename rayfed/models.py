"""Backbones and client models.

A *backbone* is a frozen pretrained model built once per ClientActor: an image encoder (ViT, CLIP's
vision tower, open_clip's image tower), an image-text encoder (ViLT, FLAVA), a causal language model
(Llama, Qwen2) or a multi-modal LLM (LLaVA). Backbones are plug-ins (:mod:`rayfed.registry`): a builder
``(request: BackboneRequest) -> Backbone``; the built-ins below register themselves the same way.

A *client model* is the backbone plus what a method trains: LoRA (through peft), adapters or prompts, and
one head per task, built by the task's kind (a linear classifier, a choice scorer, an image decoder; a
causal LM generates text with its own LM head). Every parameter of a client model is either trainable
(its value lives in client or server state and is swapped in per client) or frozen (shared by every
client the actor hosts). A client model takes a batch of named columns (``pixel_values``, ``input_ids``,
...) and returns what its active task's kind scores.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rayfed import pqlora
from rayfed.config import LoraConfig, ModelConfig
from rayfed.errors import ConfigError, choice_error
from rayfed.lazy import DeferredModule
from rayfed.modules import (
    TASK_SELECTED_MODULES, MlpHead, TaskHeads, add_adapter_set, add_adapters, add_bias_tuning, add_modality_prompts, add_output_adapters,
    add_prompts, tag_tasks, task_heads,
)
from rayfed.registry import register_backbone, resolve
from rayfed.seeding import SERVER, torch_seed
from rayfed.tasks import Task, task_key
from rayfed.types import Batch, TensorDict

peft = DeferredModule("peft")
transformers = DeferredModule("transformers")

IMAGE, TEXT = "image", "text"

_TINY_SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)

# The study's ViT sizes (spec fedyolo.md §1): hidden size, blocks, heads, MLP width.
VIT_SIZES = {
    "T": dict(hidden_size=192, num_hidden_layers=12, num_attention_heads=3, intermediate_size=768),
    "S": dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536),
    "B": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "L": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}
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


# How a backbone's encoder is called: features (batch, d) for heads, next-token logits for text tasks ----
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
    """Next-token logits (batch, tokens, vocabulary) of a causal LM or LLaVA."""
    return encoder(**_lm_inputs(inputs)).logits


def causal_lm_features(encoder: nn.Module, inputs: Batch) -> torch.Tensor:
    """The last hidden state at each sequence's last real token (for a classification head)."""
    hidden = encoder(**_lm_inputs(inputs), output_hidden_states=True).hidden_states[-1]
    last = inputs["attention_mask"].sum(dim=1) - 1
    return hidden[torch.arange(len(hidden), device=hidden.device), last]


def _lm_inputs(inputs: Batch) -> Batch:
    return {k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values") if k in inputs}


def _text_and_image(encoder: nn.Module, inputs: Batch) -> Batch:
    config = encoder.config
    present = inputs["input_ids"] if "input_ids" in inputs else inputs["pixel_values"]
    size, device = len(present), present.device
    if "input_ids" not in inputs:
        ids = torch.tensor([[config.bos_token_id or 1, config.eos_token_id or 2]], device=device).expand(size, -1)
        inputs = {**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if "pixel_values" not in inputs:
        inputs = {**inputs, "pixel_values": torch.zeros(size, config.num_channels, config.image_size, config.image_size,
                                                        device=device)}
    return {k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values")}


@dataclass
class Backbone:
    """A frozen pretrained model and what the engine needs to use it.

    ``features(encoder, inputs)`` gives (batch, ``feature_dim``) features of a batch whose ``pixel_values``
    are already resized and normalized; ``lm_logits`` (causal LMs only) next-token logits. Images arrive as
    raw [0, 1] pixels and are resized to ``image_size`` and normalized with ``image_mean``/``image_std`` by
    the client model; texts are tokenized by ``tokenizer`` to at most ``max_text_length`` tokens, after
    ``image_prompt`` (LLaVA's image tokens) where there is an image.
    """

    encoder: nn.Module
    feature_dim: int
    image_size: int | None = None
    num_channels: int = 3
    features: Callable[[nn.Module, Batch], torch.Tensor] = output_features
    modalities: frozenset[str] = frozenset({IMAGE})
    lm_logits: Callable[[nn.Module, Batch], torch.Tensor] | None = None
    tokenizer: Any = None
    max_text_length: int = 32
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    lora_scope: str | None = None  # the submodule LoRA goes in (LLaVA: its language model), None: anywhere
    image_mean: float | tuple[float, ...] = 0.5
    image_std: float | tuple[float, ...] = 0.5
    image_prompt: str = ""
    name: str = field(default="", compare=False)
    config_field: str = field(default="model.backbone", compare=False)  # the config field naming it, for errors

    @property
    def generates_text(self) -> bool:
        return self.lm_logits is not None


@dataclass(frozen=True)
class BackboneRequest:
    """What a backbone builder is asked for: the model config, the seed of random weights, and a prefix
    builder's argument (``B`` for ``vit:B``)."""

    config: ModelConfig
    seed: int
    argument: str | None = None
    name: str = ""


def build_backbone(config: ModelConfig, seed: int) -> Backbone:
    """Build (or load) the backbone ``model.backbone`` names; random parts seeded by ``seed``; frozen."""
    resolved = resolve("backbone", config.backbone)
    torch.manual_seed(seed)
    built = resolved.obj(BackboneRequest(config, seed, resolved.argument, resolved.name))
    if isinstance(built, nn.Module):
        raise ConfigError(
            f"model.backbone = {resolved.name!r} returned a bare {type(built).__name__}; a backbone builder returns "
            "rayfed.models.Backbone(encoder=..., feature_dim=..., image_size=...)."
        )
    if not isinstance(built, Backbone):
        raise ConfigError(f"model.backbone = {resolved.name!r} returned a {type(built).__name__}, not a Backbone.")
    built.name = built.name or resolved.name
    built.encoder.requires_grad_(False)
    built.encoder.eval()
    return built


def _vit(hf_config: transformers.ViTConfig) -> Backbone:
    encoder = transformers.ViTModel(hf_config, add_pooling_layer=False)
    return Backbone(encoder, hf_config.hidden_size, hf_config.image_size, hf_config.num_channels, cls_features)


@register_backbone("tiny:vit")
def _tiny_vit(request: BackboneRequest) -> Backbone:
    """A tiny random ViT (d 64, 2 blocks, patch 4) at ``model.image_size`` (default 16)."""
    return _vit(transformers.ViTConfig(
        **_TINY_SIZES, image_size=request.config.image_size or 16, patch_size=4, num_channels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    ))  # fmt: skip


@register_backbone("vit:")
def _sized_vit(request: BackboneRequest) -> Backbone:
    """Randomly initialised ViT-T/S/B/L, patch 16, 224 px (``vit:B``)."""
    if request.argument not in VIT_SIZES:
        raise choice_error("model.backbone", request.name, [f"vit:{s}" for s in VIT_SIZES])
    return _vit(transformers.ViTConfig(**VIT_SIZES[request.argument], image_size=request.config.image_size or 224,
                                       patch_size=16))


@register_backbone("tiny:clip-vision")
def _tiny_clip_vision(request: BackboneRequest) -> Backbone:
    """A tiny random CLIP vision tower (d 64, 2 blocks, patch 4)."""
    clip_config = transformers.CLIPVisionConfig(
        **_TINY_SIZES, image_size=request.config.image_size or 16, patch_size=4, num_channels=3
    )
    encoder = transformers.CLIPVisionModel(clip_config)
    return Backbone(encoder, clip_config.hidden_size, clip_config.image_size, 3, pooler_features)


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


def _with_layers(sizes: Mapping[str, Any], layers: int | None) -> dict[str, Any]:
    return {**sizes, **({} if layers is None else {"num_hidden_layers": layers})}


def _llm_dtype() -> torch.dtype:
    """As the checkpoints ship: bfloat16 where this process sees a GPU (whose steps compute in bf16 under autocast
    anyway), else float32 (a CPU runs no autocast here, and a float32 LoRA over bf16 weights would need it)."""
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


@register_backbone("llama:")
def _random_llama(request: BackboneRequest) -> Backbone:
    """A randomly initialised Llama-3.2-shaped causal LM (``llama:1B``, ``llama:3B``; ``llama:tiny`` for tests)
    over the offline word tokenizer; bfloat16 weights where this process sees a GPU, else float32."""
    from rayfed.zoo.tokenizers import word_tokenizer

    config = llama_config(request.argument or "")
    with _quiet_loading():
        encoder = transformers.AutoModelForCausalLM.from_config(config, dtype=_llm_dtype())
    return _causal_lm(encoder, word_tokenizer(append_eos=False, model_max_length=config.max_position_embeddings))


# Paper-size backbones: the published configurations of rayfed.zoo.paper, randomly initialised ----------------
@dataclass(frozen=True)
class PaperModel:
    """A paper-size backbone's HF configuration and its offline processor (tokenizer and image processor)."""

    config: Any
    processor: Any


def paper_model(name: str, layers: int | None = None) -> PaperModel:
    """The configuration and processor of the paper-size backbone ``name`` (``flava:full``, ``vilt:B32``,
    ``llava:llama-1B``, ...; docs/offline_models.md); ``layers``: each transformer stack of it cut to that many
    blocks (the paper's widths at a CPU's depth, for tests)."""
    family, _, size = name.partition(":")
    if family not in _PAPER_FAMILIES:
        raise choice_error("model.backbone", name, [f"{f}:<size>" for f in _PAPER_FAMILIES])
    return _PAPER_FAMILIES[family](size, layers)


def _paper_size(family: str, size: str, sizes: Collection[str]) -> None:
    if size not in sizes:
        raise choice_error("model.backbone", f"{family}:{size}", [f"{family}:{s}" for s in sizes])


def _paper_flava(size: str, layers: int | None) -> PaperModel:
    from rayfed.zoo import paper

    _paper_size("flava", size, paper.FLAVA_SIZES)
    facts = paper.FLAVA_SIZES[size]
    config = transformers.FlavaConfig(**{
        key: _with_layers(value, layers) if key.endswith("_config") else value for key, value in facts.items()
    })
    text = paper.tokenizer(paper.BERT_UNCASED, config.text_config.max_position_embeddings)
    return PaperModel(config, paper.flava_processor(text, config.image_config.image_size))


def _paper_vilt(size: str, layers: int | None) -> PaperModel:
    from rayfed.zoo import paper

    _paper_size("vilt", size, paper.VILT_SIZES)
    special = paper.BERT_UNCASED.special
    # [CLS] and [SEP]: what a text-less batch reads (vilt_features)
    config = transformers.ViltConfig(**_with_layers(paper.VILT_SIZES[size], layers),
                                     bos_token_id=special["cls_token"][1], eos_token_id=special["sep_token"][1])
    text = paper.tokenizer(paper.BERT_UNCASED, config.max_position_embeddings)
    return PaperModel(config, paper.vilt_processor(text, config.image_size))


def _paper_llava(language: str, layers: int | None) -> PaperModel:
    """LLaVA-1.5 on a Llama-3.2 (``llama-1B``, ``llama-3B``) or Qwen2.5 (``qwen-0.5B``, ``-1.5B``, ``-3B``) language
    model, the mixes of FedMosaic's Tab. 8 and 14; the language model keeps its vocabulary size, LLaVA's image token
    takes a special id it already has (rayfed.zoo.paper)."""
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


_PAPER_FAMILIES: dict[str, Callable[[str, int | None], PaperModel]] = {
    "flava": _paper_flava, "vilt": _paper_vilt, "llava": _paper_llava,
}


def paper_backbone(name: str, layers: int | None = None) -> Backbone:
    """The paper-size backbone ``name``, randomly initialised (see :func:`paper_model`; it also builds on the
    meta device). FLAVA and ViLT in float32, LLaVA as ``llama:`` backbones (bfloat16 where a GPU is seen)."""
    model = paper_model(name, layers)
    config, tokenizer, images = model.config, model.processor.tokenizer, model.processor.image_processor
    normalization = {"image_mean": tuple(images.image_mean), "image_std": tuple(images.image_std)}
    with _quiet_loading():
        if isinstance(config, transformers.FlavaConfig):
            return _flava(transformers.FlavaModel(config), tokenizer, normalization)
        if isinstance(config, transformers.ViltConfig):
            return _vilt(transformers.ViltModel(config), tokenizer, normalization)
        encoder = transformers.AutoModelForImageTextToText.from_config(config, dtype=_llm_dtype())
    # room for the image's tokens before a text as long as other backbones' (576 at 336 px, patch 14)
    text_length = config.image_seq_length + _text_limit(tokenizer, config.text_config.max_position_embeddings)
    return _llava(encoder, tokenizer, normalization, text_length)


@register_backbone("flava:")
def _random_flava(request: BackboneRequest) -> Backbone:
    """FLAVA at facebook/flava-full's size (``flava:full``), randomly initialised, offline tokenizer."""
    return paper_backbone(request.name)


@register_backbone("vilt:")
def _random_vilt(request: BackboneRequest) -> Backbone:
    """ViLT at dandelin/vilt-b32-mlm's size (``vilt:B32``), randomly initialised, offline tokenizer."""
    return paper_backbone(request.name)


@register_backbone("llava:")
def _random_llava(request: BackboneRequest) -> Backbone:
    """LLaVA-1.5 (CLIP ViT-L/14-336) on Llama-3.2 or Qwen2.5 (``llava:llama-1B``, ``llava:qwen-0.5B``, ...),
    randomly initialised, offline tokenizer; bfloat16 weights where a GPU is seen."""
    return paper_backbone(request.name)


@register_backbone("tiny-pretrained:")
def _tiny_pretrained(request: BackboneRequest) -> Backbone:
    """A tiny model of a zoo family pretrained on synthetic data (docs/offline_models.md), built on first use."""
    from rayfed.zoo import FAMILIES, pretrained

    family = request.argument
    if family not in FAMILIES:
        raise choice_error("model.backbone", request.name, [f"tiny-pretrained:{f}" for f in FAMILIES])
    return load_hf_backbone(str(pretrained(family)), request.config, shown_as=request.name)


@register_backbone("hf:")
def _hf(request: BackboneRequest) -> Backbone:
    """A transformers model by hub name or save_pretrained folder: ViT, CLIP (vision tower), ViLT, FLAVA,
    LLaVA or any causal LM (Llama, Qwen2, ...)."""
    return load_hf_backbone(request.argument or "", request.config)


@contextlib.contextmanager
def _quiet_loading():
    """No per-weight progress bar or unused-key table from transformers while a backbone loads (every actor
    loads one, and a task model's unused pretraining heads are expected)."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.utils.logging.enable_progress_bar()


def load_hf_backbone(name_or_path: str, config: ModelConfig, shown_as: str | None = None) -> Backbone:
    """The backbone in a hub name or folder, by its config's ``model_type``; errors name it as ``shown_as``."""
    with _quiet_loading():
        return _load_hf_backbone(name_or_path, config, shown_as)


def _load_hf_backbone(name_or_path: str, config: ModelConfig, shown_as: str | None) -> Backbone:
    shown_as = shown_as or f"hf:{name_or_path}"
    try:
        hf_config = transformers.AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"model.backbone = {shown_as!r} could not be loaded (not a local model folder, "
            f"and the hub is unreachable or has no such model): {str(err).splitlines()[0]}"
        ) from None
    model_type = hf_config.model_type
    if model_type in ("vit", "clip", "clip_vision_model"):
        backbone = _hf_image_encoder(name_or_path, hf_config)
    elif model_type == "vilt":
        backbone = _hf_vilt(name_or_path)
    elif model_type == "flava":
        backbone = _hf_flava(name_or_path)
    elif model_type == "llava":
        backbone = _hf_llava(name_or_path)
    elif model_type in transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        backbone = _hf_causal_lm(name_or_path)
    else:
        raise ConfigError(
            f"model.backbone = {shown_as!r} is a {model_type!r} model; allowed are ViT, CLIP (vision tower), "
            "ViLT, FLAVA, LLaVA and causal language models."
        )
    if config.image_size and backbone.image_size and config.image_size != backbone.image_size:
        raise ConfigError(
            f"model.image_size = {config.image_size} does not match the pretrained backbone's "
            f"{backbone.image_size}; leave model.image_size unset for pretrained backbones."
        )
    backbone.name = shown_as
    return backbone


def _hf_image_encoder(name_or_path: str, hf_config: Any) -> Backbone:
    if hf_config.model_type == "vit":
        encoder = transformers.ViTModel.from_pretrained(name_or_path, add_pooling_layer=False, dtype=torch.float32)
        return Backbone(encoder, hf_config.hidden_size, hf_config.image_size, hf_config.num_channels, cls_features)
    vision = hf_config.vision_config if hf_config.model_type == "clip" else hf_config
    encoder = transformers.CLIPVisionModel.from_pretrained(name_or_path, dtype=torch.float32)
    return Backbone(encoder, vision.hidden_size, vision.image_size, vision.num_channels, pooler_features)


def _image_normalization(name_or_path: str) -> dict[str, Any]:
    """The saved image processor's mean and std (0.5, 0.5 when there is none; a hub name: its processor's)."""
    for file, section in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        path = Path(name_or_path) / file
        if path.is_file():
            saved = json.loads(path.read_text())
            saved = saved.get(section, {}) if section else saved
            if "image_mean" in saved:
                return {"image_mean": tuple(saved["image_mean"]), "image_std": tuple(saved["image_std"])}
    if not Path(name_or_path).is_dir():
        try:
            processor = transformers.AutoImageProcessor.from_pretrained(name_or_path)
            return {"image_mean": tuple(processor.image_mean), "image_std": tuple(processor.image_std)}
        except (OSError, ValueError, AttributeError):
            pass
    return {}


def _text_limit(tokenizer: Any, positions: int) -> int:
    return min(int(getattr(tokenizer, "model_max_length", positions) or positions), positions, 512)


def _hf_vilt(name_or_path: str) -> Backbone:
    from rayfed.zoo.tokenizers import load_tokenizer

    encoder = transformers.ViltModel.from_pretrained(name_or_path, dtype=torch.float32)
    return _vilt(encoder, load_tokenizer(name_or_path), _image_normalization(name_or_path))


def _vilt(encoder: nn.Module, tokenizer: Any, normalization: Mapping[str, Any]) -> Backbone:
    config = encoder.config
    return Backbone(
        encoder, config.hidden_size, config.image_size, config.num_channels, vilt_features,
        frozenset({IMAGE, TEXT}), tokenizer=tokenizer, max_text_length=_text_limit(tokenizer, config.max_position_embeddings),
        lora_targets=("query", "value"), **normalization,
    )  # fmt: skip


def _hf_flava(name_or_path: str) -> Backbone:
    from rayfed.zoo.tokenizers import load_tokenizer

    encoder = transformers.FlavaModel.from_pretrained(name_or_path, dtype=torch.float32)
    return _flava(encoder, load_tokenizer(name_or_path), _image_normalization(name_or_path))


def _flava(encoder: nn.Module, tokenizer: Any, normalization: Mapping[str, Any]) -> Backbone:
    config = encoder.config
    return Backbone(
        encoder, config.hidden_size, config.image_config.image_size, config.image_config.num_channels, flava_features,
        frozenset({IMAGE, TEXT}), tokenizer=tokenizer,
        max_text_length=_text_limit(tokenizer, config.text_config.max_position_embeddings),
        lora_targets=("query", "value"), **normalization,
    )  # fmt: skip


def _hf_causal_lm(name_or_path: str) -> Backbone:
    from rayfed.zoo.tokenizers import load_tokenizer

    encoder = transformers.AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch.float32)
    return _causal_lm(encoder, load_tokenizer(name_or_path))


def _causal_lm(encoder: nn.Module, tokenizer: Any) -> Backbone:
    """A text-only causal LM's backbone: LoRA on every linear layer, texts up to its positions (at most 512)."""
    config = encoder.config
    return Backbone(
        encoder, config.hidden_size, None, 3, causal_lm_features, frozenset({TEXT}), causal_lm_logits, tokenizer,
        _text_limit(tokenizer, config.max_position_embeddings), LLM_LORA_TARGETS,
    )  # fmt: skip


def _hf_llava(name_or_path: str) -> Backbone:
    processor = transformers.AutoProcessor.from_pretrained(name_or_path)
    encoder = transformers.LlavaForConditionalGeneration.from_pretrained(name_or_path, dtype=torch.float32)
    text_config = encoder.config.text_config
    return _llava(encoder, processor.tokenizer, _image_normalization(name_or_path),
                  _text_limit(processor.tokenizer, text_config.max_position_embeddings))


def _llava(encoder: nn.Module, tokenizer: Any, normalization: Mapping[str, Any], max_text_length: int) -> Backbone:
    """LoRA in the language model only; a text after an image reads its image tokens first."""
    config, vision = encoder.config, encoder.config.vision_config
    image_tokens = (vision.image_size // vision.patch_size) ** 2
    image_token = tokenizer.convert_ids_to_tokens(config.image_token_id)
    return Backbone(
        encoder, config.text_config.hidden_size, vision.image_size, vision.num_channels, causal_lm_features,
        frozenset({IMAGE, TEXT}), causal_lm_logits, tokenizer, max_text_length, LLM_LORA_TARGETS,
        lora_scope="model.language_model", image_prompt=image_token * image_tokens, **normalization,
    )  # fmt: skip


class TrainableModule(nn.Module):
    """A model whose trainable parameters (``requires_grad``) are what a method's client state holds."""

    def trainable_names(self) -> list[str]:
        return [name for name, param in self.named_parameters() if param.requires_grad]

    def trainable_params(self) -> TensorDict:
        return {name: param.detach().clone() for name, param in self.named_parameters() if param.requires_grad}

    @torch.no_grad()
    def load_trainable(self, values: TensorDict) -> None:
        params = dict(self.named_parameters())
        for name, value in values.items():
            params[name].copy_(value)

    def shares_forward(self, task_indices: Sequence[int]) -> bool:
        """Whether these tasks' batches run through one and the same forward, so that they may be stacked into
        one batch (training a step's tasks together, scoring their test sets together)."""
        return False

    def task_tags(self) -> dict[str, frozenset[int]]:
        """The tasks each parameter belongs to (:func:`rayfed.modules.tag_tasks`); untagged ones are shared."""
        tags: dict[str, frozenset[int]] = {}
        for prefix, module in self.named_modules():
            tasks = getattr(module, "rayfed_tasks", None)
            if tasks is not None:
                for name, _ in module.named_parameters():
                    tags[f"{prefix}.{name}" if prefix else name] = tasks
        return tags


class ClientModel(TrainableModule):
    """Backbone (+ LoRA, adapters or prompts) and one head per task; ``forward(batch)`` is the active task's
    kind's forward (a bare tensor is read as ``pixel_values``).

    Images are raw (N, C, H, W) floats in [0, 1] at any size: the model resizes and normalizes them on its
    own device, so clients keep only their small raw images in memory.
    """

    def __init__(self, backbone: Backbone, head: nn.Module, tasks: Sequence[Task]):
        super().__init__()
        self.encoder = backbone.encoder
        self.head = head
        self.backbone_features = backbone.features
        self.backbone_lm_logits = backbone.lm_logits
        self.image_size = backbone.image_size
        self.num_channels = backbone.num_channels
        self.image_mean, self.image_std = backbone.image_mean, backbone.image_std
        self.tokenizer = backbone.tokenizer
        self.task_kinds = {task.index: task.kind for task in tasks}
        self.active_task = tasks[0].index

    def select_task(self, index: int) -> None:
        self.active_task = index

    def shares_forward(self, task_indices: Sequence[int]) -> bool:
        """Tasks of one kind share the forward when no part of the model is chosen by task: their heads have no
        parameters (a causal LM's own head) and no module is kept per task."""
        if len({type(self.task_kinds[index]) for index in task_indices}) > 1:
            return False
        for module in self.modules():
            if isinstance(module, TaskHeads):
                heads = [module[task_key(index)] for index in task_indices]
                if any(type(head) is not nn.Identity for head in heads):
                    return False
            elif isinstance(module, TASK_SELECTED_MODULES):
                return False
        return True

    @property
    def generates_text(self) -> bool:
        """Whether the backbone is a causal LM, whose LM head produces text-generation tasks' outputs."""
        return self.backbone_lm_logits is not None

    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        """Raw [0, 1] images -> the backbone's size and channels, normalized ((x - mean) / std)."""
        if images.shape[1] != self.num_channels:
            images = images.expand(-1, self.num_channels, -1, -1)
        if self.image_size and images.shape[-2:] != (self.image_size, self.image_size):
            images = nn.functional.interpolate(
                images, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False
            )
        return (images - _per_channel(self.image_mean, images)) / _per_channel(self.image_std, images)

    def inputs(self, batch: Batch) -> Batch:
        """The batch with its images resized and normalized for the backbone."""
        if "pixel_values" not in batch:
            return batch
        return {**batch, "pixel_values": self.pixels(batch["pixel_values"])}

    def features(self, batch: Batch | torch.Tensor) -> torch.Tensor:
        return self.backbone_features(self.encoder, self.inputs(_as_batch(batch)))

    def lm_logits(self, batch: Batch) -> torch.Tensor:
        return self.backbone_lm_logits(self.encoder, self.inputs(batch))

    def forward(self, batch: Batch | torch.Tensor) -> torch.Tensor:
        return self.task_kinds[self.active_task].forward(self, _as_batch(batch))


def _as_batch(batch: Batch | torch.Tensor) -> Batch:
    return {"pixel_values": batch} if isinstance(batch, torch.Tensor) else batch


def _per_channel(value: float | tuple[float, ...], images: torch.Tensor) -> float | torch.Tensor:
    if isinstance(value, (int, float)) or len(set(value)) == 1:
        return value if isinstance(value, (int, float)) else value[0]  # a scalar: the same numbers as before
    return torch.as_tensor(value, device=images.device, dtype=images.dtype).view(1, -1, 1, 1)


def classification_task(num_classes: int) -> Task:
    """The run's one task of the default image -> label path, with ``num_classes`` classes."""
    return Task(0, "task", ("",) * num_classes)


def build_client_model(
    backbone: Backbone, config: ModelConfig, task: Task | int, seed: int, private_copy: bool = True,
) -> ClientModel:
    """A fresh client model for one task over a private copy of ``backbone`` (``private_copy=False``: over
    ``backbone`` itself, which it changes); initial values depend on ``seed`` only. An int ``task`` is an
    image classification task with that many classes."""
    task = classification_task(task) if isinstance(task, int) else task
    torch.manual_seed(seed)
    head = task.kind.build_head(backbone, task) or nn.Identity()
    model = ClientModel(_private_copy(backbone) if private_copy else backbone, head, [task])
    _attach_module(model, backbone, config, [task], lambda block: False, seed)
    model.head.requires_grad_(True)
    return model


def build_task_model(
    backbone: Backbone, config: ModelConfig, tasks: Sequence[Task], seed: int,
    dedicated: Callable[[int], bool] | None = None,
) -> ClientModel:
    """A client model over every task: one head per task (``head.task_<i>``) and ``config.module``, on
    each block shared by all tasks or, where ``dedicated(block)``, one copy per task. With one task and
    no dedicated blocks: :func:`build_client_model` (one ``head``)."""
    if len(tasks) == 1 and dedicated is None:
        return build_client_model(backbone, config, tasks[0], seed)
    dedicated = dedicated or (lambda block: False)
    if config.module in ("lora", "full", "bias", "prompt") and any(dedicated(block) for block in range(num_blocks(backbone))):
        raise ConfigError(
            f"model.module = {config.module!r} cannot have a copy per task; per-task modules are adapter, vpt or head."
        )
    torch.manual_seed(seed)
    model = ClientModel(_private_copy(backbone), nn.Identity(), tasks)
    model.head = task_heads(backbone, tasks, _seeds(seed))
    _attach_module(model, backbone, config, tasks, dedicated, seed)
    model.head.requires_grad_(True)
    return model


def build_lora_set(method: str, backbone: Backbone, config: ModelConfig, tasks: Sequence[Task], seed: int,
                   adapters: Sequence[str], frozen: Sequence[str] = (), gate: bool = False) -> nn.Module:
    """The task model with named conventional-LoRA ``adapters`` on the backbone's ``model.lora.targets`` (default:
    the family's), rank and scale from ``model.lora``; the same initial values on every actor."""
    lora = config.lora
    if lora is None:
        raise ConfigError(f"methods ({method}) trains LoRA adapters: set model.lora (rank, alpha, targets).")
    model = build_task_model(backbone, config.model_copy(update={"module": "head", "lora": None}), tasks, seed)
    try:
        model.adapter_placement = pqlora.attach(
            model.encoder, rank=lora.rank, adapters=adapters, scale=lora.alpha / lora.rank, frozen=frozen, gate=gate,
            scope=backbone.lora_scope, targets=lora.targets or backbone.lora_targets,
            seed_of=lambda purpose: torch_seed(seed, 0, SERVER, f"{method}:{purpose}"))
    except ValueError as err:
        raise ConfigError(f"methods ({method}) on model.backbone = {backbone.name!r}: {err}.") from None
    return model


def _private_copy(backbone: Backbone) -> Backbone:
    return dataclasses.replace(backbone, encoder=copy.deepcopy(backbone.encoder))


def _seeds(seed: int) -> Callable[[str], int]:
    return lambda purpose: torch_seed(seed, 0, SERVER, purpose)


def num_blocks(backbone: Backbone) -> int:
    """The number of transformer blocks of an HF backbone (0 if it has no HF config)."""
    return getattr(getattr(backbone.encoder, "config", None), "num_hidden_layers", 0)


def _attach_module(
    model: ClientModel, backbone: Backbone, config: ModelConfig, tasks: Sequence[Task],
    dedicated: Callable[[int], bool], seed: int,
) -> None:
    """Add ``config.module`` to the model's encoder and mark what it trains (the heads are trained always)."""
    encoder_config = getattr(model.encoder, "config", None)
    if config.module in ("adapter", "vpt") and encoder_config is None:
        raise ConfigError(
            f"model.module = {config.module!r} needs an HF transformer backbone; "
            f"model.backbone = {backbone.name!r} is not one (use lora, head or full)."
        )
    adapter = config.adapter
    if config.module == "lora":
        _inject_lora(model, config.lora, backbone)
    elif config.module == "full":
        model.encoder.requires_grad_(True)
    elif config.module == "adapter" and adapter.site == "output":
        add_output_adapters(model.encoder, adapter.dim, tasks, dedicated, _seeds(seed), adapter.activation, adapter.init)
    elif config.module == "adapter":
        add_adapters(model.encoder, encoder_config.hidden_size, adapter.dim, tasks, dedicated, _seeds(seed),
                     adapter.activation, adapter.init)
    elif config.module == "vpt":
        add_prompts(
            model.encoder, encoder_config.hidden_size, config.vpt.prompts, encoder_config.patch_size,
            encoder_config.num_channels, tasks, dedicated, _seeds(seed),
        )
    elif config.module == "bias":
        add_bias_tuning(model.encoder)
    elif config.module == "prompt":
        add_modality_prompts(model.encoder, config.prompt.tokens, config.prompt.hidden, _seeds(seed))
    if config.head == "mlp":
        _mlp_heads(model, _seeds(seed))


def _mlp_heads(model: ClientModel, seed_of: Callable[[str], int]) -> None:
    """Replace every linear head (``model.head``, or each task's) by an :class:`MlpHead` of the same shape, each
    under a seed of its own and with its task tags."""
    def replaced(head: nn.Module, key: str) -> nn.Module:
        if not isinstance(head, nn.Linear):
            raise ConfigError(f"model.head = 'mlp' replaces a linear classifier head, but this task's head is a "
                              f"{type(head).__name__}; use model.head = 'linear'.")
        torch.manual_seed(seed_of(f"{key}:mlp_head"))
        mlp = MlpHead(head.in_features, head.out_features).to(head.weight.device)
        tasks = getattr(head, "rayfed_tasks", None)
        return mlp if tasks is None else tag_tasks(mlp, tasks)

    if isinstance(model.head, TaskHeads):
        for key in list(model.head):
            model.head[key] = replaced(model.head[key], key)
    else:
        model.head = replaced(model.head, "head")


def attach_adapter_set(
    model: ClientModel, config: ModelConfig, names: Sequence[str], seed: int, frozen: Collection[str] = (),
) -> None:
    """Add ``names`` adapters of ``model.adapter``'s form at every site of ``model.adapter.site`` (see
    :func:`rayfed.modules.add_adapter_set`), seeded from the model's ``seed`` as ``build_task_model`` seeds its
    adapters; ``frozen`` ones are not trainable."""
    encoder_config = getattr(model.encoder, "config", None)
    if encoder_config is None:
        raise ConfigError("model.module = 'adapter' needs an HF transformer backbone; this one is not (use lora, "
                          "head or full).")
    adapter = config.adapter
    add_adapter_set(model.encoder, names, encoder_config.hidden_size, adapter.dim, adapter.site, _seeds(seed),
                    adapter.activation, adapter.init, frozen)


def _inject_lora(model: ClientModel, lora: LoraConfig, backbone: Backbone) -> None:
    targets = lora.targets or backbone.lora_targets
    scope = backbone.lora_scope
    module_names = {name.rsplit(".", 1)[-1] for name, _ in model.encoder.named_modules()
                    if scope is None or name.startswith(scope + ".")}
    missing = [t for t in targets if t not in module_names]
    if missing:
        linear_names = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.encoder.named_modules() if isinstance(m, nn.Linear)}
        )
        raise ConfigError(
            f"model.lora.targets = {list(targets)!r} names modules the backbone lacks ({', '.join(missing)}); "
            f"its linear layers are: {', '.join(linear_names)}."
        )
    # Within a scope: a regex peft matches against whole module names (only the LLM of a LLaVA, not its vision tower).
    target_modules = list(targets) if scope is None else rf"{re.escape(scope)}\..*\.(?:{'|'.join(map(re.escape, targets))})"
    peft_config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=target_modules)
    model.encoder = peft.inject_adapter_in_model(peft_config, model.encoder)
    for name, param in model.encoder.named_parameters():
        param.requires_grad_("lora_" in name)
        if "lora_" in name and param.dtype != torch.float32:
            # peft makes LoRA weights in a bf16 base's dtype; trained (Adam) and exchanged in fp32, as PeftModel does
            param.data = param.data.float()
    for module in model.encoder.modules():
        # peft casts bf16 activations to the fp32 LoRA weights' dtype, and autocast casts them straight back:
        # the same numbers for two copies of every activation (10% of a ViT-B/16 step on an H200).
        if hasattr(module, "cast_input_dtype_enabled"):
            module.cast_input_dtype_enabled = False


def check_image_channels(num_channels: int, backbone: Backbone) -> None:
    if num_channels not in (1, backbone.num_channels):
        raise ConfigError(
            f"data has {num_channels}-channel images but model.backbone expects {backbone.num_channels}; "
            "only 1-channel images are converted automatically."
        )


__all__ = [
    "Backbone", "BackboneRequest", "ClientModel", "PaperModel", "TrainableModule", "attach_adapter_set", "build_backbone",
    "build_client_model", "build_task_model", "check_image_channels", "load_hf_backbone", "num_blocks", "paper_backbone",
    "paper_model", "tag_tasks",
]
