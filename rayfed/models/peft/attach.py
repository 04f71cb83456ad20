"""What a method trains, added to a client model's encoder: LoRA (peft), adapters, prompts, bias tuning, MLP heads."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence

import torch
from torch import nn

from rayfed.config import LoraConfig, ModelConfig
from rayfed.errors import ConfigError
from rayfed.lazy import DeferredModule
from rayfed.models.backbone import Backbone
from rayfed.models.client import ClientModel
from rayfed.models.peft.modules import (
    MlpHead, TaskHeads, add_adapter_set, add_adapters, add_bias_tuning, add_modality_prompts, add_output_adapters,
    add_prompts, tag_tasks,
)
from rayfed.param_names import leaf
from rayfed.seeding import SERVER, torch_seed
from rayfed.tasks import Task

peft = DeferredModule("peft")


def _seeds(seed: int) -> Callable[[str], int]:
    return lambda purpose: torch_seed(seed, 0, SERVER, purpose)


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
        add_output_adapters(model.encoder, adapter.dim, tasks, dedicated, _seeds(seed), adapter.activation,
                            adapter.init)
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
    :func:`rayfed.models.peft.modules.add_adapter_set`), seeded from the model's ``seed`` as ``build_task_model``
    seeds its adapters; ``frozen`` ones are not trainable."""
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
    module_names = {leaf(name) for name, _ in model.encoder.named_modules()
                    if scope is None or name.startswith(scope + ".")}
    missing = [t for t in targets if t not in module_names]
    if missing:
        linear_names = sorted(
            {leaf(n) for n, m in model.encoder.named_modules() if isinstance(m, nn.Linear)}
        )
        raise ConfigError(
            f"model.lora.targets = {list(targets)!r} names modules the backbone lacks ({', '.join(missing)}); "
            f"its linear layers are: {', '.join(linear_names)}."
        )
    # Within a scope: a regex peft matches against whole module names (only the LLM of a LLaVA, not its vision tower).
    target_modules = (list(targets) if scope is None
                      else rf"{re.escape(scope)}\..*\.(?:{'|'.join(map(re.escape, targets))})")
    peft_config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                  target_modules=target_modules)
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
