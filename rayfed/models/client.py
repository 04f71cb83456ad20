"""A client model: the backbone, what a method trains, and one head per task."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch import nn

from rayfed.tasks import kinds
from rayfed.models.backbone import Backbone
from rayfed.models.module_walks import mode_switch, modules_of_type, named_parameter_table
from rayfed.models.peft.modules import TASK_SELECTED_MODULES, TaskHeads
from rayfed.param_names import task_key
from rayfed.tasks import Task
from rayfed.types import Batch, TensorDict

if TYPE_CHECKING:
    from typing_extensions import Self  # typing's from Python 3.11


T = TypeVar("T")


class Attachments:
    """What a method or the engine keeps with a model without making it part of the model (no submodule, no
    parameter, not moved by ``.to``): at most one value per type, so each owner keeps its own class of value."""

    def __init__(self) -> None:
        self._values: dict[type, Any] = {}

    def get(self, kind: type[T]) -> T | None:
        """The value of type ``kind``, or None."""
        return cast("T | None", self._values.get(kind))

    def __getitem__(self, kind: type[T]) -> T:
        """The value of type ``kind``; a KeyError naming the type if there is none."""
        if kind not in self._values:
            raise KeyError(f"the model holds no {kind.__name__}")
        return cast("T", self._values[kind])

    def put(self, value: T) -> T:
        """Keep ``value`` (in place of an earlier one of its type); returns it."""
        self._values[type(value)] = value
        return value


class TrainableModule(nn.Module):
    """A model whose trainable parameters (``requires_grad``) are what a method's client state holds.

    It declares every capability the engine uses of a client model, with the default a plain model has; a model
    overrides those it has. ``attachments`` holds what a method or the engine keeps with the model.
    """

    generates_text: bool = False
    """Whether the model produces text-generation tasks' outputs (:meth:`generate_text`); a model that does not is
    refused such tasks before a run starts."""

    chat_template: bool = False
    """Whether the model's prompts are wrapped in its tokenizer's chat template (``model.chat_template``), so that a
    generated text ends where the template closes the assistant's turn."""

    scores_unseen_tasks: bool = False
    """Whether the model scores a task that no client holds (it classifies by the label names, as a CLIP text
    classifier does); a model whose heads are trained on clients' data does not, and such a run is refused."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.attachments = Attachments()

    def select_task(self, index: int) -> None:
        """Make the model's own per-task parts serve task ``index``; :func:`rayfed.models.peft.modules.select_task`
        calls it before switching the model's per-task modules and heads. Default: nothing of its own."""

    def trainable_names(self) -> list[str]:
        return [name for name, param in self.named_parameters() if param.requires_grad]

    def trainable_params(self) -> TensorDict:
        return {name: param.detach().clone() for name, param in self.named_parameters() if param.requires_grad}

    def train(self, mode: bool = True) -> Self:
        """``nn.Module.train(mode)`` (``eval()`` too) without its recursion through every module: the flags of a kept
        list of them are set, and the submodules with a ``train`` of their own get their call (:func:`mode_switch`).
        Trainers and teachers switch a model of thousands of modules several times a client."""
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        flags, own = mode_switch(self)
        object.__setattr__(self, "training", mode)
        for module in flags:
            object.__setattr__(module, "training", mode)  # nn.Module.__setattr__'s own end for a plain attribute
        for module in own:
            module.train(mode)
        return self

    @torch.no_grad()
    def load_trainable(self, values: TensorDict) -> None:
        params = named_parameter_table(self)
        for name, value in values.items():
            params[name].copy_(value)

    def shares_forward(self, task_indices: Sequence[int]) -> bool:
        """Whether these tasks' batches run through one and the same forward, so that they may be stacked into
        one batch (training a step's tasks together, scoring their test sets together)."""
        return False

    def host_choices(self, task_index: int, batch: Batch) -> Hashable:
        """What the forward of task ``task_index`` on ``batch`` decides from the batch's values read back to the host
        (e.g. how many windows of a long text to encode), which a CUDA graph cannot hold: a captured part of a step
        is kept per choice and captured under :meth:`making_choices` (``train.cuda_graphs``). Default: None, no
        such decision."""
        return None

    @contextlib.contextmanager
    def making_choices(self, choices: Hashable) -> Iterator[None]:
        """Forwards within take ``choices`` (of :meth:`host_choices`) as made, reading nothing back to decide them.
        Default: nothing to take."""
        yield

    def raw_and_scored(self, batch: Batch, forward: Callable[..., torch.Tensor] | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The active task's outputs as distillation compares them (a decoder's own) and as its kind scores them,
        from ``forward`` (the model, or a compiled version of it); here both are the forward's outputs."""
        outputs = (forward or self)(batch)
        return outputs, outputs

    def task_tags(self) -> dict[str, frozenset[int]]:
        """The tasks each parameter belongs to (:func:`rayfed.models.peft.modules.tag_tasks`); untagged ones are
        shared."""
        tags: dict[str, frozenset[int]] = {}
        for prefix, module in self.named_modules():
            tasks = getattr(module, "rayfed_tasks", None)
            if tasks is not None:
                for name, _ in module.named_parameters():
                    tags[f"{prefix}.{name}" if prefix else name] = tasks
        return tags

    def generate_text(self, batch: Batch, max_new_tokens: int) -> torch.Tensor:
        """Greedy continuations (batch, new tokens) of the batch's left-padded ``prompt_ids``. Default: the
        engine's greedy decoding with the model's ``encoder.generate`` (:func:`rayfed.tasks.kinds.generate`, which reads
        ``tokenizer``, ``encoder`` and ``pixels`` as :class:`ClientModel` has them); a model that decodes otherwise
        (a parallel decoder) overrides it."""
        return kinds.generate(self, batch, max_new_tokens)

    @torch.no_grad()
    def logits_and_generations(self, batch: Batch, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The outputs on the test ``batch`` that the text-generation kind's loss reads, and
        :meth:`generate_text`'s generations. Default: the forward, then :meth:`generate_text`; a model that gets
        both from one forward overrides it."""
        return self(batch), self.generate_text(batch, max_new_tokens)


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
        self.chat_template = backbone.chat_template
        self.task_kinds = {task.index: task.kind for task in tasks}
        self.active_task = tasks[0].index

    def select_task(self, index: int) -> None:
        self.active_task = index

    def shares_forward(self, task_indices: Sequence[int]) -> bool:
        """Tasks of one kind share the forward when no part of the model is chosen by task: their heads have no
        parameters (a causal LM's own head) and no module is kept per task."""
        if len({type(self.task_kinds[index]) for index in task_indices}) > 1:
            return False
        for module in modules_of_type(self, (TaskHeads, *TASK_SELECTED_MODULES)):
            if not isinstance(module, TaskHeads):
                return False
            if any(type(module[task_key(index)]) is not nn.Identity for index in task_indices):
                return False
        return True

    @property
    def generates_text(self) -> bool:
        """Whether the backbone is a causal LM, whose LM head produces text-generation tasks' outputs."""
        return self.backbone_lm_logits is not None

    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        """Raw [0, 1] images (N, C, H, W) -> the backbone's size and channels, normalized ((x - mean) / std); several
        a sample (N, K, C, H, W) -> (N, K, C', H', W'), each image as one alone."""
        if images.ndim == 5:
            return self.pixels(images.flatten(0, 1)).unflatten(0, images.shape[:2])
        if images.shape[1] != self.num_channels:
            images = images.expand(-1, self.num_channels, -1, -1)
        if self.image_size and images.shape[-2:] != (self.image_size, self.image_size):
            images = nn.functional.interpolate(
                images, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False
            )
        return (images - _per_channel(self.image_mean, images)) / _per_channel(self.image_std, images)

    def inputs(self, batch: Batch) -> Batch:
        """The batch with its images resized and normalized for the backbone; samples of several images
        (``image_counts``) give their valid images only, sample by sample, as a LLaVA reads them after its prompts'
        image tokens."""
        if "pixel_values" not in batch:
            return batch
        pixels = batch["pixel_values"]
        if pixels.ndim == 5:
            pixels = kinds.valid_images(pixels, batch["image_counts"])
        return {**batch, "pixel_values": self.pixels(pixels)}

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
    return channel_values(value, images.device, images.dtype)


def channel_values(values: float | Sequence[float], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Per-channel ``values`` (an image mean or std) as a (1, C, 1, 1) tensor on ``device``, made once per device and
    dtype: made in each forward, it was a copy to the GPU that the host waited for."""
    return _channel_values(tuple(values) if isinstance(values, Sequence) else values, device, dtype)


@functools.lru_cache(maxsize=None)
def _channel_values(values: float | tuple[float, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.as_tensor(values, device=device, dtype=dtype).view(1, -1, 1, 1)
