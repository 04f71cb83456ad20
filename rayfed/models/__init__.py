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

One job a module: ``backbone`` (:class:`Backbone`, :func:`build_backbone`), ``features`` (how an encoder is called),
``families/`` (one module per model family: image encoders (ViT, CLIP's vision tower), causal LMs, ViLT, FLAVA,
LLaVA, CLIP as a classifier (``clip``, imported by the registry, not here), and what they share), ``paper``
(paper-size backbones, randomly initialised), ``hub`` (pretrained weights by hub name or folder), ``client``
(:class:`ClientModel`), ``peft/`` (what a method trains over the encoder, parameter-efficiently, and how it is
attached), ``build`` (client and task models) and ``client_plugin`` (the client model a config chooses,
``model.client``).
"""

from __future__ import annotations

# The families first, in this order: the order rayfed.registry lists the built-in backbones in.
from rayfed.models.families.image_encoders import VIT_SIZES  # noqa: I001
from rayfed.models.families.llm import LLAMA_SIZES, LLM_LORA_TARGETS, llama_config
from rayfed.models.paper import paper_backbone, paper_model
from rayfed.models.hub import load_hf_backbone
from rayfed.models.peft.attach import attach_adapter_set
from rayfed.models.backbone import IMAGE, TEXT, Backbone, BackboneRequest, build_backbone
from rayfed.models.build import (
    build_client_model, build_lora_set, build_task_model, check_image_channels, classification_task, num_blocks,
)
from rayfed.models.client import ClientModel, TrainableModule
from rayfed.models.client_plugin import AdapterSets, ClientModelRequest, client_model, default_client_model
from rayfed.models.families.common import PaperModel
from rayfed.models.features import (
    causal_lm_features, causal_lm_logits, cls_features, flava_features, output_features, pooler_features, vilt_features,
)
from rayfed.models.peft.modules import tag_tasks

__all__ = [
    "IMAGE", "LLAMA_SIZES", "LLM_LORA_TARGETS", "TEXT", "VIT_SIZES", "AdapterSets", "Backbone", "BackboneRequest",
    "ClientModel", "ClientModelRequest", "PaperModel", "TrainableModule", "attach_adapter_set", "build_backbone",
    "build_client_model", "build_lora_set", "build_task_model", "causal_lm_features", "causal_lm_logits",
    "check_image_channels", "classification_task", "client_model", "cls_features", "default_client_model",
    "flava_features", "llama_config", "load_hf_backbone", "num_blocks", "output_features", "paper_backbone",
    "paper_model", "pooler_features", "tag_tasks", "vilt_features",
]
