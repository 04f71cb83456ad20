"""TAP's modular multi-modal, multi-task model (seed 000_a0f3b72231afa875.txt, §3, App. A.2 and D.1; spec
``tap.md`` §2), built from a pretrained FLAVA or ViLT.

- **Encoders**, one per modality: a trainable ``input_adaptor`` (images), the frozen pretrained encoder with
  LoRA (FLAVA: its image / text transformer, LoRA on query and value; ViLT: its patch projection with LoRA, or
  its frozen word embeddings), then a trainable ``Linear(hidden, D) -> LayerNorm``. Texts longer than the
  encoder's position table are encoded window by window.
- **Backbone** (MoTE -> MoME, from DisentAFL): a MoTE block per modality and a shared one, made of the
  pretrained layers ``0..L-1``, and a MoME block per task key and a shared one, made of layers ``L..2L-1``.
  A block layer is ``x += MHA(LN1(x))`` (frozen, LoRA on q and v; q and v first pass through a residual
  per-domain expert, "MoDE") then ``x += Expert(LN2(x))`` with the expert chosen by the route. Every expert is
  the layer's frozen pretrained FFN plus LoRA on both linears (``backbone_module: adapter``: no LoRA in the
  backbone, named bottleneck adapters after every expert's FFN instead, FedDAT's in this model, spec §6).
  Routing is by metadata only: for the tokens of each input modality m of a task with key o
  (``image_classification``, ``image_generation``, ``text_classification``, ``text_generation``) four paths
  run::

      SS  shared_proj(x) -> mote[shared] / E^T[shared][shared] -> mome[shared] / E^M[shared][shared]
      ST  shared_proj(x) -> mote[m]      / E^T[shared][o]      -> mome[o]      / E^M[o][shared]
      MT  x              -> mote[m]      / E^T[m][o]           -> mome[o]      / E^M[o][m]
      MS  x              -> mote[m]      / E^T[m][shared]      -> mome[shared] / E^M[shared][m]

  each mean-pooled over its (real) tokens; the features are the mean over paths and modalities.
- **Decoders**: a classification head per classification task (dataset), ONE image-reconstruction head for all
  image-generation tasks, ONE text-generation head for all text-generation tasks (the code's parallel
  decoder: learned position queries attend to the pooled features, a 1-layer GPT-2, a linear map to the
  vocabulary; decoding is the argmax at every position).

Every block a task does not use is tagged with the tasks that do (:func:`rayfed.modules.tag_tasks`), so a
client holds, trains and exchanges exactly the blocks of its modalities, tasks and domains. A "task" here is a
run's task (one dataset); TAP's task o is its key. :meth:`MoMEModel.path_prefixes` names the blocks on a
task's forward path (what TAP's replacement copies).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rayfed.errors import ConfigError, suggest
from rayfed.kinds import IGNORE, causal_from_target_logits, end_of_text_id
from rayfed.lazy import DeferredModule
from rayfed.models import Backbone, ClientModelRequest, TrainableModule
from rayfed.models.client_plugin import OPTIONS_FIELD
from rayfed.modules import AdaptedMLP, adapter_set, select_task, tag_tasks
from rayfed.registry import register_client_model
from rayfed.tasks import Task, task_key as run_task_key
from rayfed.types import Batch

peft = DeferredModule("peft")
transformers = DeferredModule("transformers")

IMAGE, TEXT, SHARED = "image", "text", "shared"
MODALITIES = (IMAGE, TEXT)
TASK_KEYS = ("image_classification", "image_generation", "text_classification", "text_generation")
FAMILIES = ("flava", "vilt")
ADAPTOR_INITS = ("default", "identity", "none")
BACKBONE_MODULES = ("lora", "adapter")
# Per family (spec §5, Table 21 and the code): the LoRA ranks of the encoders, the backbone's attention and the
# experts (alpha = 2 rank everywhere), L, and the bottleneck of FedDAT's expert adapters.
FAMILY_DEFAULTS: dict[str, dict[str, int]] = {
    "flava": {"encoder_rank": 8, "attention_rank": 16, "expert_rank": 4, "layers": 1, "adapter_dim": 32},
    "vilt": {"encoder_rank": 4, "attention_rank": 8, "expert_rank": 8, "layers": 4, "adapter_dim": 16},
}


@dataclass(frozen=True)
class MoMEOptions:
    """The modular model's architecture (spec §2, §5); None takes the backbone family's value."""

    layers: int | None = None  # L: MoTE from pretrained layers 0..L-1, MoME from L..2L-1 (FLAVA 1, ViLT 4)
    encoder_rank: int | None = None  # FLAVA: LoRA on the encoders' query/value (8); ViLT: on the patch projection (4)
    attention_rank: int | None = None  # LoRA on the backbone's query/value (FLAVA 16, ViLT 8)
    expert_rank: int | None = None  # LoRA on both linears of every expert (FLAVA 4, ViLT 8)
    lora_dropout: float = 0.3
    domains: dict[str, str] | None = None  # task name -> domain of its MoDE experts; default: one per task
    text_positions: int = 32  # the text decoder's output positions (the longest target it can produce)
    condition_text_decoder: bool = True  # False: the released code's decoder, which never reads the features
    input_adaptor: str = "default"  # the image adaptor's init: default (the code's), identity; none: resize only
    # lora: LoRA on the backbone's attention and experts (TAP); adapter: none, a bottleneck adapter set after every
    # expert's FFN instead (FedDAT in this model, spec §6 [R]: Linear D -> b, ReLU, Linear b -> D, residual)
    backbone_module: str = "lora"
    adapter_dim: int | None = None  # b of the expert adapters (FLAVA 32, ViLT 16)

    def __post_init__(self) -> None:
        for name in ("layers", "encoder_rank", "attention_rank", "expert_rank", "adapter_dim"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError("lora_dropout must be in [0, 1)")
        if self.text_positions < 1:
            raise ValueError("text_positions must be >= 1")
        if self.input_adaptor not in ADAPTOR_INITS:
            raise ValueError(f"input_adaptor must be one of {', '.join(ADAPTOR_INITS)}")
        if self.backbone_module not in BACKBONE_MODULES:
            raise ValueError(f"backbone_module must be one of {', '.join(BACKBONE_MODULES)}")

    @classmethod
    def parse(cls, values: Mapping[str, Any] | None, where: str = OPTIONS_FIELD) -> MoMEOptions:
        """The options of the mapping at config field ``where``; one sentence naming the key when one is wrong."""
        values = dict(values or {})
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = [key for key in values if key not in allowed]
        if unknown:
            raise ConfigError(f"{where} has no option {unknown[0]!r}{suggest(unknown[0], allowed)}; allowed: "
                              f"{', '.join(allowed)}.")
        try:
            return cls(**values)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{where}.{str(err).rstrip('.')}.") from None


def family_of(backbone: Backbone) -> str:
    """``flava`` or ``vilt``: the backbones the modular model is built from."""
    name = type(backbone.encoder).__name__
    if name == "FlavaModel":
        return "flava"
    if name == "ViltModel":
        return "vilt"
    raise ConfigError(f"{backbone.config_field} = {backbone.name!r} is a {name}; TAP's modular model is built from "
                      "FLAVA or ViLT (tiny-pretrained:flava, tiny-pretrained:vilt, hf:facebook/flava-full, "
                      "hf:dandelin/vilt-b32-mlm).")


def task_modalities(task: Task) -> tuple[str, ...]:
    """The task's input modalities in a fixed order (image first)."""
    if not task.modalities:
        raise ConfigError(f"task {task.name!r} does not record its input modalities (Task.modalities); the modular "
                          "model routes by them.")
    return tuple(m for m in MODALITIES if m in task.modalities)


def task_key(task: Task) -> str:
    """TAP's task o of a run task (spec §2): ``image_classification`` (any classification with an image),
    ``text_classification``, ``image_generation`` (reconstruction), ``text_generation``."""
    kind = task.kind.name
    if kind == "reconstruction":
        return "image_generation"
    if kind == "text_generation":
        return "text_generation"
    if kind == "classification":
        return "image_classification" if IMAGE in task_modalities(task) else "text_classification"
    raise ConfigError(f"task {task.name!r} is of kind {kind!r}; TAP's modular model runs classification, "
                      "reconstruction and text_generation tasks.")


def head_key(task: Task) -> str:
    """The decoder a task uses: its own classifier, or the one head of its generation kind."""
    key = task_key(task)
    return key if key.endswith("generation") else run_task_key(task.index)


# Building blocks --------------------------------------------------------------------------------------
def _lora(module: nn.Module, targets: list[str], rank: int, dropout: float) -> nn.Module:
    """``module`` with peft LoRA (alpha = 2 rank) on the submodules named ``targets``; only LoRA trains."""
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout, target_modules=targets)
    module = peft.inject_adapter_in_model(config, module)
    for name, param in module.named_parameters():
        param.requires_grad_("lora_" in name)
    return module


def _frozen(module: nn.Module) -> nn.Module:
    return copy.deepcopy(module).requires_grad_(False)


class Expert(nn.Module):
    """A layer's pretrained FFN ``Linear -> GELU -> Linear`` (frozen, the same tensors in every expert of the
    layer) with LoRA on both linears, or with ``adapters`` after it instead: ``h + A(h)`` on the FFN's output h
    with the ``shared`` adapter, or a mixture of the named ones (:func:`rayfed.modules.set_adapter_mix`)."""

    def __init__(self, first: nn.Linear, second: nn.Linear, rank: int | None, dropout: float,
                 adapters: nn.ModuleDict | None = None):
        super().__init__()
        ffn = nn.Sequential(first, nn.GELU(), second)
        self.ffn = _lora(ffn, ["0", "2"], rank, dropout) if adapters is None else AdaptedMLP(ffn, adapters)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn(x)


class Attention(nn.Module):
    """A pretrained BERT-style self-attention (frozen copies of query, key, value and output) with LoRA on query
    and value (none with ``rank`` None); a key-padding mask keeps padded tokens out."""

    def __init__(self, layer: nn.Module, heads: int, rank: int | None, dropout: float):
        super().__init__()
        attention = layer.attention
        self.heads = heads
        self.query, self.key, self.value = (_frozen(getattr(attention.attention, n)) for n in ("query", "key", "value"))
        self.output = _frozen(attention.output.dense)
        if rank is not None:
            _lora(self, ["query", "value"], rank, dropout)

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
        self.attention_norm = _frozen(layer.layernorm_before)
        self.attention = Attention(layer, heads, attention_rank, dropout)
        self.expert_norm = _frozen(layer.layernorm_after)
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


class InputAdaptor(nn.Sequential):
    """The code's trainable image adaptor: Upsample x2 -> Conv3x3 (no bias) -> GELU -> Upsample to the
    encoder's size -> Conv1x1. ``init = default``: PyTorch's (the code's); ``identity``: both convolutions start
    as the identity (Dirac kernels, zero bias), so the pretrained encoder first sees GELU(image)."""

    def __init__(self, size: int, init: str = "default"):
        super().__init__(
            nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True), nn.Conv2d(3, 3, 3, padding=1, bias=False),
            nn.GELU(), nn.Upsample(size=(size, size), mode="bilinear", align_corners=True), nn.Conv2d(3, 3, 1),
        )  # fmt: skip
        if init == "identity":
            nn.init.dirac_(self[1].weight)
            nn.init.dirac_(self[4].weight)
            nn.init.zeros_(self[4].bias)


class ImageEncoder(nn.Module):
    """Raw [0, 1] images -> tokens (B, 1 + patches, D): normalize, adapt, the frozen pretrained encoder with LoRA
    (FLAVA's image transformer; ViLT's patch projection, [CLS] and position embeddings), Linear + LayerNorm."""

    def __init__(self, backbone: Backbone, family: str, width: int, rank: int, dropout: float, adaptor: str):
        super().__init__()
        encoder, self.family = backbone.encoder, family
        self.size = backbone.image_size
        self.mean, self.std = backbone.image_mean, backbone.image_std
        self.input_adaptor = None if adaptor == "none" else InputAdaptor(self.size, adaptor)
        if family == "flava":
            self.backbone = _lora(_frozen(encoder.image_model), ["query", "value"], rank, dropout)
            hidden = encoder.config.image_config.hidden_size
        else:
            embeddings = encoder.embeddings
            self.backbone = _lora(_frozen(embeddings.patch_embeddings), ["projection"], rank, dropout)
            self.cls_token = nn.Parameter(embeddings.cls_token.detach().clone(), requires_grad=False)
            positions = embeddings.position_embeddings.detach().clone()
            self.position_embeddings = nn.Parameter(positions, requires_grad=False)
            hidden = encoder.config.hidden_size
        self.proj = nn.Linear(hidden, width)
        self.layer_norm = nn.LayerNorm(width)

    def _normalized(self, images: torch.Tensor) -> torch.Tensor:
        if images.shape[1] == 1:
            images = images.expand(-1, 3, -1, -1)
        mean = torch.as_tensor(self.mean, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
        std = torch.as_tensor(self.std, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
        return (images - mean) / std

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self._normalized(images)
        if self.input_adaptor is not None:
            x = self.input_adaptor(x)
        elif x.shape[-2:] != (self.size, self.size):
            x = nn.functional.interpolate(x, size=(self.size, self.size), mode="bilinear", align_corners=False)
        if self.family == "flava":
            tokens = self.backbone(pixel_values=x).last_hidden_state
        else:
            patches = self.backbone(x).flatten(2).transpose(1, 2)
            tokens = torch.cat([self.cls_token.expand(len(x), -1, -1), patches], dim=1)
            tokens = tokens + self.position_embeddings[:, : tokens.shape[1]]
        tokens = self.layer_norm(self.proj(tokens))
        return tokens, torch.ones(tokens.shape[:2], dtype=torch.long, device=tokens.device)


def _packed(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The real tokens of each row moved to its start (a left-padded prompt becomes right-padded)."""
    order = torch.argsort((mask == 0).to(torch.int8), dim=1, stable=True)
    return ids.gather(1, order), mask.gather(1, order)


class TextEncoder(nn.Module):
    """Token ids -> tokens (B, S, D): FLAVA's frozen text transformer with LoRA on query/value, or ViLT's frozen
    word + position + type embeddings; then Linear + LayerNorm. A text longer than the encoder's position table
    is cut into windows of that length, each encoded on its own."""

    def __init__(self, backbone: Backbone, family: str, width: int, rank: int, dropout: float):
        super().__init__()
        encoder, self.family = backbone.encoder, family
        if family == "flava":
            self.backbone = _lora(_frozen(encoder.text_model), ["query", "value"], rank, dropout)
            config = encoder.config.text_config
        else:
            self.backbone = _frozen(encoder.embeddings.text_embeddings)
            config = encoder.config
        self.window = config.max_position_embeddings
        self.proj = nn.Linear(config.hidden_size, width)
        self.layer_norm = nn.LayerNorm(width)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = _packed(ids, mask)
        longest = max(int(mask.sum(dim=1).max()), 1)
        windows = math.ceil(longest / self.window)
        length = windows * self.window
        if ids.shape[1] < length:
            pad = length - ids.shape[1]
            ids, mask = nn.functional.pad(ids, (0, pad)), nn.functional.pad(mask, (0, pad))
        ids, mask = ids[:, :length], mask[:, :length]
        size = len(ids)
        flat_ids, flat_mask = ids.reshape(size * windows, self.window), mask.reshape(size * windows, self.window)
        if self.family == "flava":
            tokens = self.backbone(input_ids=flat_ids, attention_mask=flat_mask).last_hidden_state
        else:
            tokens = self.backbone(input_ids=flat_ids, token_type_ids=torch.zeros_like(flat_ids))
        tokens = tokens.reshape(size, length, -1)
        return self.layer_norm(self.proj(tokens)), mask


class ClassificationHead(nn.Sequential):
    """FLAVA: ``Linear(D, D/2) -> ReLU -> Dropout(0.3) -> Linear``; ViLT: ``Linear(D, 4D) -> LN -> GELU ->
    Dropout(0.1) -> Linear(4D, D) -> GELU -> Linear`` (App. D.1); the last layer Xavier-uniform, zero bias."""

    def __init__(self, family: str, width: int, classes: int):
        if family == "flava":
            layers = [nn.Linear(width, width // 2), nn.ReLU(), nn.Dropout(0.3), nn.Linear(width // 2, classes)]
        else:
            layers = [nn.Linear(width, 4 * width), nn.LayerNorm(4 * width), nn.GELU(), nn.Dropout(0.1),
                      nn.Linear(4 * width, width), nn.GELU(), nn.Linear(width, classes)]
        super().__init__(*layers)
        nn.init.xavier_uniform_(self[-1].weight)
        nn.init.zeros_(self[-1].bias)


class ImageGenerationHead(nn.Module):
    """Features -> an image: ``Linear(D, 64 s s)``, three ``ConvTranspose(k4, s2, p1)`` with ReLU between (no
    output activation) -> (3, 8s, 8s); one head for every image-generation task, its output resized to each
    task's image shape (and averaged over colours for a one-channel task)."""

    def __init__(self, width: int, size: int):
        super().__init__()
        self.start = max(math.ceil(size / 8), 1)
        self.proj = nn.Linear(width, 64 * self.start * self.start)
        self.decoder = nn.Sequential(
            nn.ConvTranspose2d(64, 32, 4, stride=2, padding=1), nn.ReLU(),
            nn.ConvTranspose2d(32, 16, 4, stride=2, padding=1), nn.ReLU(),
            nn.ConvTranspose2d(16, 3, 4, stride=2, padding=1),
        )  # fmt: skip

    def forward(self, features: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
        images = self.decoder(self.proj(features).view(len(features), 64, self.start, self.start))
        channels, height, width = shape
        if images.shape[-2:] != (height, width):
            images = nn.functional.interpolate(images, size=(height, width), mode="bilinear", align_corners=False)
        return images.mean(dim=1, keepdim=True) if channels == 1 else images


class TextGenerationHead(nn.Module):
    """The code's "conditional GPT-2" text decoder, parallel: ``positions`` learned position queries attend
    (8 heads) to the pooled features, pass through a 1-layer GPT-2 (4 heads, inner 2D) as input embeddings, and
    a bias-free linear layer maps them to the vocabulary: logits (B, positions, V) in one pass."""

    def __init__(self, width: int, vocabulary: int, positions: int, conditioned: bool):
        super().__init__()
        self.positions, self.conditioned = positions, conditioned
        config = transformers.GPT2Config(vocab_size=vocabulary, n_embd=width, n_layer=1, n_head=4,
                                         n_positions=positions, n_inner=2 * width)
        self.gpt2 = transformers.GPT2Model(config)
        self.gpt2.wte.requires_grad_(False)  # token embeddings: unused (the decoder reads input embeddings)
        self.lm_head = nn.Linear(width, vocabulary, bias=False)
        self.position_embeddings = nn.Embedding(positions, width)
        self.cond_attention = nn.MultiheadAttention(width, num_heads=8, batch_first=True)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        queries = self.position_embeddings.weight.unsqueeze(0).expand(len(features), -1, -1)
        if self.conditioned:
            context = features.unsqueeze(1)
            queries = queries + self.cond_attention(queries, context, context, need_weights=False)[0]
        hidden = self.gpt2(inputs_embeds=queries).last_hidden_state
        return self.lm_head(hidden)


# The model ----------------------------------------------------------------------------------------------
def _masked_mean(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weights = mask.to(tokens.dtype).unsqueeze(-1)
    return (tokens * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)


def _key(name: str) -> str:
    """A domain name usable as a module key."""
    return name.replace(".", "_")


class MoMEModel(TrainableModule):
    """The client (and server) model of TAP and its baselines; ``forward(batch)`` gives what the active task's
    kind scores (text generation: logits aligned as a causal LM's, see
    :func:`rayfed.kinds.causal_from_target_logits`), ``forward(batch, raw=True)`` the decoder's own output.
    With ``backbone_module: adapter`` every expert holds the named ``adapters`` (``frozen_adapters`` of them not
    trainable)."""

    generates_text = True  # text-generation tasks decode with the parallel text head (generate_text)

    def __init__(self, backbone: Backbone, tasks: Sequence[Task], options: MoMEOptions, seed: int,
                 adapters: Sequence[str] = ("shared",), frozen_adapters: Collection[str] = ()):
        super().__init__()
        family = family_of(backbone)
        defaults = FAMILY_DEFAULTS[family]
        option = {name: getattr(options, name) or defaults[name] for name in defaults}
        encoder = backbone.encoder
        layers = list(encoder.multimodal_model.encoder.layer if family == "flava" else encoder.encoder.layer)
        heads = (encoder.config.multimodal_config if family == "flava" else encoder.config).num_attention_heads
        self.num_layers = min(option["layers"], len(layers) // 2)
        if self.num_layers < 1:
            raise ConfigError(f"{backbone.config_field} = {backbone.name!r} has {len(layers)} layer(s); the MoTE and "
                              "MoME blocks need at least two.")
        width = backbone.feature_dim
        self.family, self.tokenizer, self.options = family, backbone.tokenizer, options
        self.tasks = {task.index: task for task in tasks}
        self.keys = {task.index: task_key(task) for task in tasks}
        self.task_modalities = {task.index: task_modalities(task) for task in tasks}
        domains = dict(options.domains or {})
        unknown = [name for name in domains if name not in {t.name for t in tasks}]
        if unknown:
            raise ConfigError(f"{OPTIONS_FIELD}.domains names task {unknown[0]!r}, which the run does not have.")
        self.domain = {task.index: _key(domains.get(task.name, task.name)) for task in tasks}
        self.active_task = tasks[0].index
        self.collected_latents: list[tuple[tuple[str, str], torch.Tensor]] | None = None  # DisentAFL's, when a list

        every = frozenset(self.tasks)
        modalities = [m for m in MODALITIES if any(m in self.task_modalities[t] for t in every)]
        keys = [k for k in TASK_KEYS if k in self.keys.values()]

        def users(modality: str | None = None, key: str | None = None, domain: str | None = None) -> frozenset[int]:
            return frozenset(t for t in every if (modality is None or modality in self.task_modalities[t])
                             and (key is None or self.keys[t] == key) and (domain is None or self.domain[t] == domain))

        def tagged(module: nn.Module, tasks_using: frozenset[int]) -> nn.Module:
            return module if tasks_using == every else tag_tasks(module, tasks_using)

        torch.manual_seed(seed)
        dropout = options.lora_dropout
        lora = options.backbone_module == "lora"

        def make_expert(first: nn.Linear, second: nn.Linear) -> Expert:
            if lora:
                return Expert(first, second, option["expert_rank"], dropout)
            return Expert(first, second, None, dropout, adapter_set(adapters, second.out_features,
                                                                    option["adapter_dim"], "relu", "normal",
                                                                    frozen_adapters))
        built = {}
        if IMAGE in modalities:
            built[IMAGE] = tagged(ImageEncoder(backbone, family, width, option["encoder_rank"], dropout,
                                               options.input_adaptor), users(IMAGE))
        if TEXT in modalities:
            built[TEXT] = tagged(TextEncoder(backbone, family, width, option["encoder_rank"], dropout), users(TEXT))
        self.encoders = nn.ModuleDict(built)
        self.shared_proj = nn.Linear(width, width)

        # One frozen copy of each pretrained layer's FFN, under every expert made from it (only LoRA differs).
        ffns = [(_frozen(layer.intermediate.dense), _frozen(layer.output.dense))
                for layer in layers[:2 * self.num_layers]]

        def block(first_layer: int, tasks_using: frozenset[int]) -> nn.Module:
            used = sorted({self.domain[t] for t in tasks_using})
            chosen = range(first_layer, first_layer + self.num_layers)
            made = MoEBlock([layers[i] for i in chosen], [ffns[i] for i in chosen], heads,
                            option["attention_rank"] if lora else None, dropout, used, make_expert)
            for name in used:
                for layer in made.layers:
                    tagged(layer.mode_q[name], tasks_using & users(domain=name))
                    tagged(layer.mode_v[name], tasks_using & users(domain=name))
            return tagged(made, tasks_using)

        self.mote = nn.ModuleDict({m: block(0, users(m)) for m in modalities} | {SHARED: block(0, every)})
        self.mome = nn.ModuleDict({k: block(self.num_layers, users(key=k)) for k in keys}
                                  | {SHARED: block(self.num_layers, every)})

        def expert(layer: int, tasks_using: frozenset[int]) -> nn.Module:
            return tagged(make_expert(*ffns[layer]), tasks_using)

        # E^T[l][mod | shared][key | shared] and E^M[l][key | shared][mod | shared], only the cells a task uses.
        mote_experts, mome_experts = {}, {}
        for index in range(self.num_layers):
            cells = {}
            for m in [*modalities, SHARED]:
                row = {}
                for k in [*keys, SHARED]:
                    tasks_using = users(None if m == SHARED else m, None if k == SHARED else k)
                    if tasks_using:
                        row[k] = expert(index, tasks_using)
                cells[m] = nn.ModuleDict(row)
            mote_experts[str(index)] = nn.ModuleDict(cells)
            cells = {}
            for k in [*keys, SHARED]:
                row = {}
                for m in [*modalities, SHARED]:
                    tasks_using = users(None if m == SHARED else m, None if k == SHARED else k)
                    if tasks_using:
                        row[m] = expert(self.num_layers + index, tasks_using)
                cells[k] = nn.ModuleDict(row)
            mome_experts[str(index)] = nn.ModuleDict(cells)
        self.mote_experts = nn.ModuleDict(mote_experts)
        self.mome_experts = nn.ModuleDict(mome_experts)

        heads_built: dict[str, nn.Module] = {}
        for task in tasks:
            key = head_key(task)
            if key in heads_built:
                continue
            if key == "image_generation":
                size = max(max(t.image_shape[1:]) for t in tasks if head_key(t) == key)
                heads_built[key] = tagged(ImageGenerationHead(width, size), users(key=key))
            elif key == "text_generation":
                if self.tokenizer is None:
                    raise ConfigError(f"{backbone.config_field} = {backbone.name!r} has no tokenizer for text "
                                      "generation.")
                heads_built[key] = tagged(TextGenerationHead(width, len(self.tokenizer), options.text_positions,
                                                             options.condition_text_decoder), users(key=key))
            else:
                heads_built[key] = tag_tasks(ClassificationHead(family, width, task.num_classes), [task.index])
        self.heads = nn.ModuleDict(heads_built)

    # Routing -------------------------------------------------------------------------------------------
    def select_task(self, index: int) -> None:
        self.active_task = index

    def _experts(self, table: nn.ModuleDict, cells: Sequence[tuple[str, str]]) -> list[list[nn.Module]]:
        """Per layer, the expert of each (row, column) cell."""
        return [[table[str(layer)][row][column] for row, column in cells] for layer in range(self.num_layers)]

    def encode(self, batch: Batch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The tokens and mask of each input modality of the active task."""
        task = self.active_task
        encoded = {}
        if IMAGE in self.task_modalities[task]:
            encoded[IMAGE] = self.encoders[IMAGE](batch["pixel_values"])
        if TEXT in self.task_modalities[task]:
            if self.keys[task] == "text_generation":  # the prompt only: input_ids holds prompt + target
                encoded[TEXT] = self.encoders[TEXT](batch["prompt_ids"], batch["prompt_mask"])
            else:
                encoded[TEXT] = self.encoders[TEXT](batch["input_ids"], batch["attention_mask"])
        return encoded

    def features(self, batch: Batch | torch.Tensor) -> torch.Tensor:
        """The pooled features (B, D): the mean of the four paths of every input modality."""
        batch = {"pixel_values": batch} if isinstance(batch, torch.Tensor) else batch
        task = self.active_task
        key, domain = self.keys[task], self.domain[task]
        pooled = []
        for modality, (tokens, mask) in self.encode(batch).items():
            projected = self.shared_proj(tokens)
            size = len(tokens)
            # MoTE: SS through mote[shared]; ST, MT and MS through mote[m], stacked along the batch.
            ss = self.mote[SHARED](projected, mask, self._experts(self.mote_experts, [(SHARED, SHARED)]), domain)
            st, mt, ms = self.mote[modality](
                torch.cat([projected, tokens, tokens]), mask.repeat(3, 1),
                self._experts(self.mote_experts, [(SHARED, key), (modality, key), (modality, SHARED)]), domain,
            ).split(size)
            if self.collected_latents is not None:
                self.collected_latents.append(((modality, key), _masked_mean(mt, mask)))
            # MoME: SS and MS through mome[shared], ST and MT through mome[o].
            ss, ms = self.mome[SHARED](torch.cat([ss, ms]), mask.repeat(2, 1),
                                       self._experts(self.mome_experts, [(SHARED, SHARED), (SHARED, modality)]),
                                       domain).split(size)
            st, mt = self.mome[key](torch.cat([st, mt]), mask.repeat(2, 1),
                                    self._experts(self.mome_experts, [(key, SHARED), (key, modality)]),
                                    domain).split(size)
            pooled += [_masked_mean(path, mask) for path in (ss, st, mt, ms)]
        return torch.stack(pooled).mean(dim=0)

    def forward(self, batch: Batch | torch.Tensor, raw: bool = False) -> torch.Tensor:
        batch = {"pixel_values": batch} if isinstance(batch, torch.Tensor) else batch
        task = self.tasks[self.active_task]
        key = head_key(task)
        features = self.features(batch)
        if key == "image_generation":
            return self.heads[key](features, task.image_shape)
        outputs = self.heads[key](features)
        if key != "text_generation" or raw:
            return outputs
        return self.aligned(outputs, batch)

    def aligned(self, raw: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The text decoder's logits placed where the text-generation kind reads a causal LM's."""
        longest = int((batch["labels"] != IGNORE).sum(dim=1).max())
        if longest > raw.shape[1]:
            raise ConfigError(f"a target of {longest} tokens is longer than the text decoder's "
                              f"{OPTIONS_FIELD}.text_positions = {raw.shape[1]}; raise it.")
        return causal_from_target_logits(raw, batch)

    def raw_and_scored(self, batch: Batch, forward: Callable[..., torch.Tensor] | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder's own outputs (what distillation compares; text generation: the logits of every output
        position) and what the active task's kind scores, from one forward."""
        raw = (forward or self)(batch, raw=True)
        return raw, self.aligned(raw, batch) if self.keys[self.active_task] == "text_generation" else raw

    @torch.no_grad()
    def generate_text(self, batch: Batch, max_new_tokens: int) -> torch.Tensor:
        """The argmax token at every position, cut after the first end-of-text (pad after it)."""
        return self._decoded(self(batch, raw=True), max_new_tokens)

    @torch.no_grad()
    def logits_and_generations(self, batch: Batch, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``self(batch)`` and ``generate_text(batch, max_new_tokens)`` from one forward."""
        raw = self(batch, raw=True)
        return self.aligned(raw, batch), self._decoded(raw, max_new_tokens)

    def _decoded(self, raw: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        tokens = raw.argmax(dim=-1)
        pad, eos = self.tokenizer.pad_token_id, end_of_text_id(self.tokenizer)
        ended = (tokens == eos).long().cumsum(dim=1) - (tokens == eos).long() > 0
        tokens = tokens.masked_fill(ended, pad)
        if tokens.shape[1] < max_new_tokens:
            tokens = nn.functional.pad(tokens, (0, max_new_tokens - tokens.shape[1]), value=pad)
        return tokens[:, :max_new_tokens]

    # Blocks ---------------------------------------------------------------------------------------------
    def path_prefixes(self, task_index: int) -> tuple[str, ...]:
        """The name prefixes of every block on the task's forward path (spec §4 "task-o path"): the encoders of
        its modalities, shared_proj, mote[m] and mote[shared], mome[o] and mome[shared] (whole blocks, their
        domain experts included), the eight expert cells of each modality in every layer, and its head."""
        key = self.keys[task_index]
        prefixes = ["shared_proj.", f"mote.{SHARED}.", f"mome.{SHARED}.", f"mome.{key}.",
                    f"heads.{head_key(self.tasks[task_index])}."]
        for modality in self.task_modalities[task_index]:
            prefixes += [f"encoders.{modality}.", f"mote.{modality}."]
            for layer in range(self.num_layers):
                prefixes += [f"mote_experts.{layer}.{row}.{column}." for row, column in
                             ((SHARED, SHARED), (SHARED, key), (modality, key), (modality, SHARED))]
                prefixes += [f"mome_experts.{layer}.{row}.{column}." for row, column in
                             ((SHARED, SHARED), (key, SHARED), (key, modality), (SHARED, modality))]
        return tuple(dict.fromkeys(prefixes))

    def on_path(self, name: str, task_indices: Sequence[int]) -> bool:
        """Whether parameter ``name`` is on the forward path of any of ``task_indices``."""
        return any(name.startswith(self.path_prefixes(t)) for t in task_indices)


def build_mome_model(backbone: Backbone, tasks: Sequence[Task], options: MoMEOptions | Mapping[str, Any] | None,
                     seed: int, adapters: Sequence[str] = ("shared",), frozen_adapters: Collection[str] = (),
                     ) -> MoMEModel:
    """TAP's modular model over ``backbone`` for ``tasks``; its initial values depend on ``seed`` only. With
    ``backbone_module: adapter``, each expert's adapter set is ``adapters`` (``shared`` among them: the one its
    forward uses unless a mixture is set), ``frozen_adapters`` not trainable."""
    if not isinstance(options, MoMEOptions):
        options = MoMEOptions.parse(options)
    if options.backbone_module == "adapter" and "shared" not in adapters:
        raise ConfigError(f"the expert adapters {list(adapters)} lack 'shared', the one an expert's forward uses.")
    return MoMEModel(backbone, tasks, options, seed, adapters, frozen_adapters)


@register_client_model("mome")
def mome_client_model(request: ClientModelRequest) -> MoMEModel:
    """TAP's modular multi-modal, multi-task model over a FLAVA or ViLT backbone (options: :class:`MoMEOptions`);
    a method's adapter sets go after every expert's FFN (``backbone_module: adapter``, the default then)."""
    sets = request.adapter_sets
    if sets is None:
        return build_mome_model(request.backbone, request.tasks, request.options, request.seed)
    options = MoMEOptions.parse({"backbone_module": "adapter", **request.options})
    if options.backbone_module != "adapter":
        raise ConfigError(f"{OPTIONS_FIELD}.backbone_module must be adapter for methods ({sets.method}), which trains "
                          "adapter sets after the experts.")
    return build_mome_model(request.backbone, request.tasks, options, request.seed, sets.names, sets.frozen)


# What a method's Params says of its former ``mome`` hyperparameter (its ``removed_hyperparameters``).
MOVED_TO_CLIENT_MODEL = {"mome": "set model.client: mome and move these options to model.client_options (a method "
                                 "entry's own model: mapping sets both for that method alone)"}

__all__ = ["FAMILIES", "MODALITIES", "MOVED_TO_CLIENT_MODEL", "TASK_KEYS", "MoMEModel", "MoMEOptions",
           "build_mome_model", "family_of", "head_key", "mome_client_model", "task_key", "task_modalities"]


def task_outputs(model: nn.Module, task: Task, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The modular model's outputs on ``task``'s ``batch``: the decoder's own (what distillation compares; text
    generation: the logits of every output position) and what the task's kind scores."""
    select_task(model, task.index)
    return model.raw_and_scored(batch)
