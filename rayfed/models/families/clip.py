"""CLIP as a classifier: cosine similarity of image features to the text features of class prompts.

One interface over open_clip's ``CLIP`` and HF ``CLIPModel`` (:class:`ClipClassifier`): the residual blocks
of both towers (with each block's first LayerNorm, where adapters on a block's input read), image and text
encoders, the token embedding (where CoOp-style learnable context vectors go), and CLIP's own frozen
logit scale. The classifier scores the classes of one *label space* at a time (a run's tasks: e.g. the
base classes for training and local/base evaluation, the novel classes for novel evaluation).

Class text features depend on trainable parts of the text tower: they are re-encoded, with gradients,
at every training step, and in evaluation once per label space after the trainable values are loaded
(the cache is emptied by :meth:`ClipClassifier.load_trainable` and by any training), so no client or
round ever sees another's text features.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Sequence

import torch
from torch import nn

from rayfed.config import ModelConfig
from rayfed.errors import ConfigError, choice_error
from rayfed.lazy import DeferredModule
from rayfed.models.backbone import Backbone, BackboneRequest
from rayfed.models.client import TrainableModule, channel_values
from rayfed.registry import register_backbone
from rayfed.types import Batch
from rayfed.zoo.registry import ZooModel

transformers = DeferredModule("transformers")

PROMPT_TEMPLATE = "a photo of a {}."
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
CLIP_BACKBONES = ("open_clip:<arch> (with model.pretrained)", "hf:<CLIPModel name or folder>",
                  "tiny-pretrained:open_clip", "tiny-pretrained:open_clip-deep", "tiny-pretrained:clip")  # fmt: skip
TINY_CLIP_FAMILIES = ("open_clip", "open_clip-deep", "clip")


@functools.lru_cache(maxsize=2)
def load_clip(backbone: str, pretrained: str | None) -> ZooModel:
    """The full frozen CLIP named by ``model.backbone`` (both towers and the tokenizer), loaded once per process."""
    from rayfed import zoo

    family = backbone.removeprefix("tiny-pretrained:")
    if not (backbone.startswith(("open_clip:", "hf:"))
            or (backbone.startswith("tiny-pretrained:") and family in TINY_CLIP_FAMILIES)):
        raise ConfigError(
            f"model.backbone = {backbone!r} is not a CLIP model, which text-classifying methods need; "
            f"allowed: {', '.join(CLIP_BACKBONES)}."
        )
    try:
        loaded = zoo.load(backbone, pretrained=pretrained)
    except (OSError, RuntimeError) as err:
        raise ConfigError(f"model.backbone = {backbone!r} could not be loaded: {str(err).splitlines()[0]}") from None
    if type(loaded.model).__name__ not in ("CLIP", "CLIPModel"):
        raise ConfigError(
            f"model.backbone = {backbone!r} is a {type(loaded.model).__name__}, not a CLIP model with a text tower; "
            f"allowed: {', '.join(CLIP_BACKBONES)}."
        )
    loaded.model.requires_grad_(False)
    loaded.model.eval()
    return loaded


_CAMEL_CASE_BOUNDARY = re.compile(r"(?<=[a-z])(?=[A-Z])")


def class_name_words(name: str) -> str:
    """A class name as the words of a prompt: underscores as spaces and CamelCase split (``ApplyEyeMakeup`` ->
    ``Apply Eye Makeup``, as CoOp-style code renames UCF101's classes); names already in words stay as they are."""
    return _CAMEL_CASE_BOUNDARY.sub(" ", name.replace("_", " "))


def class_prompt(name: str, template: str = PROMPT_TEMPLATE) -> str:
    """``"a photo of a {name}."`` with the name in words (:func:`class_name_words`)."""
    return template.format(class_name_words(name))


class ClipClassifier(TrainableModule):
    """Frozen CLIP scoring images against class prompts; methods add trainable parts (adapters, context).

    It scores any label space by text, also one no client trains on (a base-to-novel split's novel classes).
    """

    scores_unseen_tasks = True

    def __init__(self, loaded: ZooModel, label_spaces: Sequence[Sequence[str]], template: str = PROMPT_TEMPLATE):
        super().__init__()
        self.clip = copy.deepcopy(loaded.model)
        self.tokenizer = loaded.tokenizer
        self.is_open_clip = not hasattr(self.clip, "vision_model")
        self.label_spaces = [tuple(names) for names in label_spaces]
        self.template = template
        self.task = 0
        self._text_cache: dict[int, torch.Tensor] = {}
        self.logit_scale = float(self.clip.logit_scale.detach().exp())
        self.image_size, self.mean, self.std = _image_preprocessing(loaded)

    # The towers --------------------------------------------------------------------------
    def blocks(self, tower: str) -> tuple[Sequence[nn.Module], str]:
        """A tower's residual blocks in order, and the attribute naming each block's first LayerNorm."""
        if self.is_open_clip:
            transformer = self.clip.visual.transformer if tower == "image" else self.clip.transformer
            return transformer.resblocks, "ln_1"
        encoder = self.clip.vision_model.encoder if tower == "image" else self.clip.text_model.encoder
        return encoder.layers, "layer_norm1"

    def widths(self) -> dict[str, int]:
        if self.is_open_clip:
            return {"image": self.clip.visual.transformer.width, "text": self.clip.transformer.width}
        config = self.clip.config
        return {"image": config.vision_config.hidden_size, "text": config.text_config.hidden_size}

    def token_embedding(self) -> nn.Embedding:
        return self.clip.token_embedding if self.is_open_clip else self.clip.text_model.embeddings.token_embedding

    def context_length(self) -> int:
        if self.is_open_clip:
            return self.clip.context_length
        return self.clip.config.text_config.max_position_embeddings

    # Encoders -----------------------------------------------------------------------------
    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        """Raw [0, 1] images -> CLIP's input size and normalization."""
        if images.shape[1] == 1:
            images = images.expand(-1, 3, -1, -1)
        if images.shape[-2:] != (self.image_size, self.image_size):
            images = nn.functional.interpolate(images, size=(self.image_size, self.image_size), mode="bicubic",
                                               align_corners=False)  # fmt: skip
        mean, std = (channel_values(values, images.device, torch.float32) for values in (self.mean, self.std))
        return (images - mean) / std

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        pixels = self.pixels(images)
        if self.is_open_clip:
            return self.clip.encode_image(pixels)
        return self.clip.get_image_features(pixel_values=pixels).pooler_output

    @torch.compiler.disable  # the tokenizer's Python is nothing to compile (train.compile)
    def tokenize(self, texts: list[str]) -> dict[str, torch.Tensor]:
        if self.is_open_clip:
            return {"text": self.tokenizer(texts)}
        batch = self.tokenizer(texts, padding="max_length", max_length=self.context_length(), truncation=True,
                               return_tensors="pt")  # fmt: skip
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    def encode_text(self, tokens: dict[str, torch.Tensor]) -> torch.Tensor:
        device = self.clip.logit_scale.device
        tokens = {name: value.to(device) for name, value in tokens.items()}
        if self.is_open_clip:
            return self.clip.encode_text(tokens["text"])
        return self.clip.get_text_features(**tokens).pooler_output

    def prompts(self, names: Sequence[str]) -> list[str]:
        return [class_prompt(name, self.template) for name in names]

    @functools.cached_property
    def _tokens(self) -> list[dict[str, torch.Tensor]]:
        # On the model's device: a training step then copies nothing from the host, which a CUDA graph cannot capture.
        device = self.clip.logit_scale.device
        return [{name: value.to(device) for name, value in self.tokenize(self.prompts(names)).items()}
                for names in self.label_spaces]

    # Classification -----------------------------------------------------------------------
    def select_task(self, index: int) -> None:
        """Score the classes of label space ``index`` (a run's task) from now on."""
        if not 0 <= index < len(self.label_spaces):
            raise ValueError(f"task {index} is not one of this model's {len(self.label_spaces)} label spaces")
        self.task = index

    def class_features(self) -> torch.Tensor:
        """Normalized text features of the active label space's prompts (re-encoded when training)."""
        if self.training:
            self._text_cache.clear()
            return nn.functional.normalize(self.encode_text(self._tokens[self.task]).float(), dim=-1)
        if self.task not in self._text_cache:
            with torch.no_grad():
                features = self.encode_text(self._tokens[self.task]).float()
            self._text_cache[self.task] = nn.functional.normalize(features, dim=-1)
        return self._text_cache[self.task]

    def forward(self, batch: Batch | torch.Tensor) -> torch.Tensor:
        images = batch if isinstance(batch, torch.Tensor) else batch["pixel_values"]
        image_features = nn.functional.normalize(self.encode_image(images).float(), dim=-1)
        return self.logit_scale * image_features @ self.class_features().T

    def train(self, mode: bool = True) -> ClipClassifier:
        super().train(mode)
        self.clip.eval()  # frozen: CLIP's own layers stay in inference mode
        self._text_cache.clear()
        return self

    def load_trainable(self, values: dict[str, torch.Tensor]) -> None:
        super().load_trainable(values)
        self._text_cache.clear()


def build_classifier(config: ModelConfig, label_spaces: Sequence[Sequence[str]],
                     template: str = PROMPT_TEMPLATE) -> ClipClassifier:
    """A :class:`ClipClassifier` over a private copy of the config's CLIP; nothing trainable yet."""
    return ClipClassifier(load_clip(config.backbone, config.pretrained), label_spaces, template)


def _image_preprocessing(loaded: ZooModel) -> tuple[int, tuple[float, ...], tuple[float, ...]]:
    """Input size and normalization: open_clip's eval transform, else the HF model's image processor."""
    model = loaded.model
    if hasattr(model, "vision_model"):
        size = model.config.vision_config.image_size
        image_processor = getattr(loaded.processor, "image_processor", loaded.processor)
        if image_processor is None:
            try:
                image_processor = transformers.CLIPImageProcessor.from_pretrained(model.name_or_path)
            except OSError:  # a model folder without a processor: CLIP's own normalization
                image_processor = None
        mean = getattr(image_processor, "image_mean", None) or OPENAI_MEAN
        std = getattr(image_processor, "image_std", None) or OPENAI_STD
        return size, tuple(mean), tuple(std)
    size = model.visual.image_size
    size = size[0] if isinstance(size, tuple | list) else size
    normalize = next((t for t in getattr(loaded.processor, "transforms", []) if type(t).__name__ == "Normalize"), None)
    if normalize is None:
        return size, OPENAI_MEAN, OPENAI_STD
    return size, tuple(normalize.mean), tuple(normalize.std)


def add_learnable_context(model: ClipClassifier, n_ctx: int, std: float) -> None:
    """CoOp's context: ``model.context`` (n_ctx x text width, N(0, std^2)) replaces the word embeddings at
    positions 1..n_ctx of every class prompt (the placeholders of ``model.template``)."""
    longest = max(_prompt_length(model, names) for names in model.label_spaces)
    if longest > model.context_length():
        raise ConfigError(
            f"n_ctx = {n_ctx} context vectors and the longest class prompt need {longest} tokens but "
            f"model.backbone's text encoder holds {model.context_length()}; lower n_ctx."
        )
    model.context = nn.Parameter(torch.randn(n_ctx, model.widths()["text"]) * std)

    def insert_context(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        context = model.context.to(output.dtype).expand(len(output), -1, -1)
        return torch.cat([output[:, :1], context, output[:, 1 + n_ctx:]], dim=1)

    model.token_embedding().register_forward_hook(insert_context)


def _prompt_length(model: ClipClassifier, names: Sequence[str]) -> int:
    """Tokens of the longest prompt, start and end tokens included (untruncated)."""
    if model.is_open_clip:
        return max(len(model.tokenizer.encode(prompt)) + 2 for prompt in model.prompts(names))
    return max(len(model.tokenizer(prompt)["input_ids"]) for prompt in model.prompts(names))


# The open_clip image tower as an engine backbone --------------------------------------------------------
# An open_clip block's query and value sit in torch's MultiheadAttention's fused in_proj, not in linear layers, so
# LoRA's default goes on every linear layer of the blocks: the attention's output and the MLP's two.
OPEN_CLIP_LORA_TARGETS = ("out_proj", "c_fc", "c_proj")


def _image_tower(visual: nn.Module, name: str) -> Backbone:
    image_size = visual.image_size[0] if isinstance(visual.image_size, tuple) else visual.image_size
    return Backbone(visual, visual.output_dim, image_size, 3, name=name, lora_targets=OPEN_CLIP_LORA_TARGETS)


@register_backbone("open_clip:")
def _open_clip_image_tower(request: BackboneRequest) -> Backbone:
    """The image tower of an open_clip model; ``model.pretrained`` is a tag (e.g. openai) or a weights file."""
    import open_clip

    from rayfed.zoo.openclip import pretrained_options

    arch = request.argument or ""
    if arch not in open_clip.list_models():
        raise choice_error("model.backbone", request.name, [f"open_clip:{a}" for a in open_clip.list_models()])
    pretrained = request.config.pretrained
    try:
        visual = open_clip.create_model(arch, pretrained=pretrained, **pretrained_options(arch, pretrained)).visual
    except (RuntimeError, OSError) as err:
        raise ConfigError(
            f"model.pretrained = {pretrained!r} could not be loaded for open_clip:{arch} ({str(err).splitlines()[0]})."
        ) from None
    return _image_tower(visual, request.name)


@register_backbone("tiny-pretrained:open_clip")
def _tiny_open_clip(request: BackboneRequest) -> Backbone:
    """The image tower of the tiny pretrained open_clip CLIP (the CLIP loaded once per process)."""
    return _image_tower(load_clip(request.name, None).model.visual, request.name)


register_backbone("tiny-pretrained:open_clip-deep")(_tiny_open_clip)
