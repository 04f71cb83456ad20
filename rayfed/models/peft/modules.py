"""Trainable modules over a frozen transformer backbone, and per-task module sets.

Parameter-efficient modules, each on every transformer block:

- ``adapter``: one bottleneck ``d -> dim -> d`` (both linears with bias: ``2 * dim * d + dim + d``
  parameters per block) after the block's MLP, inside its residual:
  ``h = x + A(MLP(LN2(x)))`` with ``A(z) = z + W_up GELU(W_down z)``; ``W_up``, ``b_up`` start at
  zero, so the model at step 0 is the pretrained one;
- ``vpt``: VPT-deep, ``prompts`` learnable tokens inserted after the CLS token at the input of
  every block (the previous block's prompt outputs are replaced), ``prompts * d`` per block,
  initialised uniform(-v, v) with v = sqrt(6 / (3 * 16 * 16 + d)) as in the VPT paper;
- ``lora`` (peft, :mod:`rayfed.models`), ``head`` (the linear head alone) and ``full``.

Adapters go after a block's MLP (ViT, CLIP: ``site = mlp``) or after a BERT-style layer's output
sublayer (ViLT, FLAVA: ``site = output``); ``activation: relu`` and ``init: normal`` (weights N(0, 0.02),
biases 0, nothing zeroed) give a ReLU adapter initialised as the transformer's own layers. A site may hold
several named adapters (:func:`add_adapter_set`), its forward a weighted mixture of them (:func:`set_adapter_mix`).

Further modules: ``bias`` (BitFit: every parameter named ``*bias*``), ``prompt`` (prompt tokens per modality at
ViLT's embedding level, reparameterised through a small MLP) and the ``mlp`` head (:class:`MlpHead`).

Multi-task models: a module of a block is either *shared* by every task or *dedicated*: one copy per task, stored
under a ``task_<index>`` key and tagged with its task (:func:`tag_tasks`). Heads are always per task. A client holds,
trains and exchanges only the shared parameters and its own tasks' (see :func:`rayfed.tasks.task_view`);
:func:`select_task` switches which copies the forward pass uses. Every task's copies are initialised from a seed of
their own, so a task's initial values do not depend on which other tasks exist.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

from rayfed.errors import ConfigError
from rayfed.models.module_walks import modules_of_type
from rayfed.param_names import task_key
from rayfed.tasks import Task

if TYPE_CHECKING:
    from rayfed.models.backbone import Backbone

M = TypeVar("M", bound=nn.Module)

SHARED = "shared"


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": nn.functional.gelu, "relu": nn.functional.relu
}


class Bottleneck(nn.Module):
    """``z + W_up act(W_down z)``; ``init = zero``: a zero up-projection (the identity at step 0), ``normal``:
    every weight N(0, 0.02) and every bias 0."""

    def __init__(self, width: int, dim: int, activation: str = "gelu", init: str = "zero"):
        super().__init__()
        self.down = nn.Linear(width, dim)
        self.up = nn.Linear(dim, width)
        self.activation = activation
        if init == "zero":
            nn.init.zeros_(self.up.weight)
            nn.init.zeros_(self.up.bias)
        elif init == "normal":
            for linear in (self.down, self.up):
                nn.init.normal_(linear.weight, std=0.02)
                nn.init.zeros_(linear.bias)
        else:
            raise ConfigError(f"model.adapter.init = {init!r} is not known; allowed: zero, normal.")

    def delta(self, z: torch.Tensor) -> torch.Tensor:
        """What the adapter adds to ``z``."""
        return self.up(ACTIVATIONS[self.activation](self.down(z)))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z + self.delta(z)


def _adapted(adapters: nn.ModuleDict, key: str, mix: dict[str, float] | None, hidden: torch.Tensor) -> torch.Tensor:
    """``adapters[key](hidden)``, or with a ``mix``: ``hidden + sum_k w_k A_k(hidden)`` over its named adapters.

    The weighted terms are summed before they are added to ``hidden``, so equal adapters under weights summing
    to 1 in powers of two (1/2 + 1/2) give bitwise the single adapter's output."""
    if mix is None:
        return adapters[key](hidden)
    total = None
    for name, weight in mix.items():
        term = adapters[name].delta(hidden)
        term = term if weight == 1 else term * weight
        total = term if total is None else total + term
    return hidden if total is None else hidden + total


def tag_tasks(module: M, tasks: Iterable[int]) -> M:
    """Mark every parameter of ``module`` as belonging to ``tasks`` only (a client of other tasks neither
    holds nor receives them); returns ``module``."""
    module.rayfed_tasks = frozenset(tasks)
    return module


class AdaptedOutput(nn.Module):
    """A BERT-style layer's output sublayer (``dense(x) + residual``) followed by a bottleneck adapter."""

    def __init__(self, output: nn.Module, adapters: nn.ModuleDict):
        super().__init__()
        self.output = output
        self.adapters = adapters
        self.active_task = 0
        self.mix: dict[str, float] | None = None  # see set_adapter_mix

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        key = SHARED if SHARED in self.adapters else task_key(self.active_task)
        return _adapted(self.adapters, key, self.mix, self.output(hidden, residual))


class _TaskSelected(nn.Module):
    """A module whose ``copies`` are keyed ``shared`` or ``task_<index>``; forward uses the active task's."""

    active_task: int = 0

    def _key(self, copies: nn.ModuleDict | nn.ParameterDict) -> str:
        return SHARED if SHARED in copies else task_key(self.active_task)


class AdaptedMLP(_TaskSelected):
    """A transformer block's MLP followed by a bottleneck adapter."""

    def __init__(self, mlp: nn.Module, adapters: nn.ModuleDict):
        super().__init__()
        self.mlp = mlp
        self.adapters = adapters
        self.mix: dict[str, float] | None = None  # see set_adapter_mix

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return _adapted(self.adapters, self._key(self.adapters), self.mix, self.mlp(hidden))


class PromptedBlock(_TaskSelected):
    """A transformer block whose input carries the block's own prompt tokens right after the CLS token."""

    def __init__(self, block: nn.Module, prompts: nn.ParameterDict, replaces_prompts: bool):
        super().__init__()
        self.block = block
        self.prompts = prompts
        self.replaces_prompts = replaces_prompts  # False for the first block: it inserts them

    def forward(self, hidden: torch.Tensor, *args, **kwargs):
        prompt = self.prompts[self._key(self.prompts)]
        rest = hidden[:, 1 + len(prompt):] if self.replaces_prompts else hidden[:, 1:]
        prompt = prompt.to(hidden.dtype).unsqueeze(0).expand(hidden.shape[0], -1, -1)
        return self.block(torch.cat([hidden[:, :1], prompt, rest], dim=1), *args, **kwargs)


class TaskHeads(nn.ModuleDict):
    """One linear head per task (``task_<index>``); forward uses the active task's."""

    active_task: int = 0

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self[task_key(self.active_task)](features)


TASK_SELECTED_MODULES = (_TaskSelected, AdaptedOutput)  # modules that may keep a copy per task, besides TaskHeads


def select_task(model: nn.Module, task_index: int) -> None:
    """Make every per-task part of ``model`` (a :class:`rayfed.TrainableModule`) use task ``task_index``'s copies:
    the model's own (its ``select_task``: a text classifier's label space), then its per-task modules and heads."""
    model.select_task(task_index)
    for module in modules_of_type(model, (*TASK_SELECTED_MODULES, TaskHeads)):
        module.active_task = task_index


def transformer_blocks(encoder: nn.Module) -> nn.ModuleList:
    """The encoder's list of transformer blocks (HF ViT ``layers``, CLIP vision ``encoder.layers``)."""
    for name, module in encoder.named_modules():
        if name.endswith("layers") and isinstance(module, nn.ModuleList) and len(module) and hasattr(module[0], "mlp"):
            return module
    raise ConfigError(
        "model.module = 'adapter' / 'vpt' needs a transformer backbone with blocks (HF ViT or CLIP vision); "
        "this backbone has none."
    )


def bert_layers(encoder: nn.Module) -> list[nn.Module]:
    """Every BERT-style layer of the encoder (ViLT, FLAVA's three encoders): those with an ``intermediate``
    and an ``output`` sublayer, in module order."""
    layers = [m for m in encoder.modules() if hasattr(m, "intermediate") and hasattr(m, "output")]
    if not layers:
        raise ConfigError(
            "model.adapter.site = 'output' needs a BERT-style backbone (layers with intermediate and output "
            "sublayers: ViLT, FLAVA); use model.adapter.site = 'mlp' for ViT and CLIP."
        )
    return layers


def copies_for_block(
    block_index: int, dedicated: Callable[[int], bool], tasks: Sequence[Task], seed_of: Callable[[str], int],
    make: Callable[[], nn.Module | nn.Parameter],
) -> list[tuple[str, nn.Module | nn.Parameter]]:
    """(key, module) pairs of one block: one shared copy, or one per task, each built under its own seed and
    tagged with its task."""
    keys = [(task_key(t.index), t.index) for t in tasks] if dedicated(block_index) else [(SHARED, None)]
    built = []
    for key, task in keys:
        torch.manual_seed(seed_of(f"{key}:block{block_index}"))
        made = make()
        if task is not None and isinstance(made, nn.Module):
            tag_tasks(made, [task])
        built.append((key, made))
    return built


def add_adapters(
    encoder: nn.Module, width: int, dim: int, tasks: Sequence[Task], dedicated: Callable[[int], bool],
    seed_of: Callable[[str], int], activation: str = "gelu", init: str = "zero",
) -> None:
    for index, block in enumerate(transformer_blocks(encoder)):
        copies = copies_for_block(index, dedicated, tasks, seed_of, lambda: Bottleneck(width, dim, activation, init))
        block.mlp = AdaptedMLP(block.mlp, nn.ModuleDict(dict(copies)))


def add_output_adapters(
    encoder: nn.Module, dim: int, tasks: Sequence[Task], dedicated: Callable[[int], bool],
    seed_of: Callable[[str], int], activation: str = "gelu", init: str = "zero",
) -> None:
    """A bottleneck adapter after the output sublayer of every BERT-style layer (``model.adapter.site = output``)."""
    for index, layer in enumerate(bert_layers(encoder)):
        width = layer.output.dense.out_features
        copies = copies_for_block(index, dedicated, tasks, seed_of, lambda: Bottleneck(width, dim, activation, init))
        layer.output = AdaptedOutput(layer.output, nn.ModuleDict(dict(copies)))


def adapter_set(
    names: Sequence[str], width: int, dim: int, activation: str = "gelu", init: str = "zero",
    frozen: Collection[str] = (), seed_of: Callable[[str], int] | None = None,
) -> nn.ModuleDict:
    """One site's named bottleneck adapters (:class:`AdaptedMLP` / :class:`AdaptedOutput` read them), ``frozen``
    ones not trainable; adapter ``name`` is built under seed ``seed_of(name)`` (None: the global generator as it
    stands)."""
    built = {}
    for name in names:
        if seed_of is not None:
            torch.manual_seed(seed_of(name))
        built[name] = Bottleneck(width, dim, activation, init).requires_grad_(name not in frozen)
    return nn.ModuleDict(built)


def add_adapter_set(
    encoder: nn.Module, names: Sequence[str], width: int, dim: int, site: str, seed_of: Callable[[str], int],
    activation: str = "gelu", init: str = "zero", frozen: Collection[str] = (),
) -> None:
    """Several named adapters at every adapter site (one per block), e.g. shared, frozen and local
    adapters; ``frozen`` ones are not trainable. Forward uses ``shared`` (or the active task's copy) unless
    :func:`set_adapter_mix` sets a mixture. Adapter ``name`` of block ``i`` is built under seed
    ``seed_of(f"{name}:block{i}")``, so ``shared`` starts where :func:`add_adapters` /
    :func:`add_output_adapters` start their shared copy."""

    def adapters(index: int, width: int) -> nn.ModuleDict:
        return adapter_set(names, width, dim, activation, init, frozen, lambda name: seed_of(f"{name}:block{index}"))

    if site == "output":
        for index, layer in enumerate(bert_layers(encoder)):
            layer.output = AdaptedOutput(layer.output, adapters(index, layer.output.dense.out_features))
    else:
        for index, block in enumerate(transformer_blocks(encoder)):
            block.mlp = AdaptedMLP(block.mlp, adapters(index, width))


def set_adapter_mix(model: nn.Module, mix: Mapping[str, float] | None) -> None:
    """Make every adapter site of ``model`` output ``h + sum_k mix[k] * A_k(h)`` over its named adapters
    (:func:`add_adapter_set`); None: the single default adapter, ``h + A(h)``."""
    for module in modules_of_type(model, (AdaptedOutput, AdaptedMLP)):
        module.mix = None if mix is None else dict(mix)


def add_bias_tuning(encoder: nn.Module) -> int:
    """BitFit: make every parameter whose name contains ``bias`` trainable (and only those); returns how many."""
    trained = 0
    for name, param in encoder.named_parameters():
        param.requires_grad_("bias" in name)
        trained += "bias" in name
    if not trained:
        raise ConfigError("model.module = 'bias' trains the backbone's bias parameters, but this backbone has none "
                          "(e.g. Llama); use lora, adapter or full.")
    return trained


class PromptGenerator(nn.Module):
    """``tokens`` prompt vectors reparameterised as ``Linear(Tanh(Linear(Embedding(tokens, d))))``
    (d -> hidden -> d)."""

    def __init__(self, tokens: int, width: int, hidden: int):
        super().__init__()
        self.embedding = nn.Embedding(tokens, width)
        self.down = nn.Linear(width, hidden)
        self.up = nn.Linear(hidden, width)

    def forward(self) -> torch.Tensor:
        return self.up(torch.tanh(self.down(self.embedding.weight)))


class PromptedViltEmbeddings(nn.Module):
    """ViLT's embeddings with each modality's prompt tokens inserted right after that modality's first token
    ([CLS] of the text, the image's [CLS]), so the pooler still reads the text [CLS]; the attention mask
    covers the prompts."""

    def __init__(self, embeddings: nn.Module, prompts: nn.ModuleDict):
        super().__init__()
        self.embeddings = embeddings
        self.prompts = prompts

    def forward(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor, *args,
                **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """ViLT's ``(embeddings, attention mask)`` of the text then the image, with the prompts inserted."""
        embedded, mask = self.embeddings(input_ids, attention_mask, *args, **kwargs)
        text_length = attention_mask.shape[1]
        size = embedded.shape[0]
        text, image = (self.prompts[m]().to(embedded.dtype).unsqueeze(0).expand(size, -1, -1)
                       for m in ("text", "image"))
        ones = mask.new_ones(size, text.shape[1])
        image_cls = text_length + 1
        embedded = torch.cat([embedded[:, :1], text, embedded[:, 1:image_cls], image, embedded[:, image_cls:]], dim=1)
        mask = torch.cat([mask[:, :1], ones, mask[:, 1:image_cls], ones, mask[:, image_cls:]], dim=1)
        return embedded, mask


def add_modality_prompts(encoder: nn.Module, tokens: int, hidden: int, seed_of: Callable[[str], int]) -> None:
    """``tokens`` learnable prompt tokens per modality at ViLT's embedding level."""
    embeddings = getattr(encoder, "embeddings", None)
    if type(embeddings).__name__ != "ViltEmbeddings":
        raise ConfigError(f"model.module = 'prompt' prepends prompt tokens per modality at ViLT's embedding level; "
                          f"this backbone ({type(encoder).__name__}) is not a ViLT (use vpt for ViT / CLIP).")
    width = encoder.config.hidden_size
    prompts = {}
    for modality in ("text", "image"):
        torch.manual_seed(seed_of(f"prompt:{modality}"))
        prompts[modality] = PromptGenerator(tokens, width, hidden)
    encoder.embeddings = PromptedViltEmbeddings(embeddings, nn.ModuleDict(prompts))


class MlpHead(nn.Sequential):
    """``Linear(d, 2d) -> LayerNorm(2d) -> GELU -> Linear(2d, C)`` (ViLT's VQA classifier), initialised as ViLT
    initialises its heads: weights N(0, 0.02), biases 0."""

    def __init__(self, width: int, outputs: int):
        super().__init__(nn.Linear(width, 2 * width), nn.LayerNorm(2 * width), nn.GELU(), nn.Linear(2 * width, outputs))
        for linear in (self[0], self[3]):
            nn.init.normal_(linear.weight, std=0.02)
            nn.init.zeros_(linear.bias)


def add_prompts(
    encoder: nn.Module, width: int, prompts: int, patch_size: int, num_channels: int, tasks: Sequence[Task],
    dedicated: Callable[[int], bool], seed_of: Callable[[str], int],
) -> None:
    bound = math.sqrt(6.0 / (num_channels * patch_size * patch_size + width))

    def make() -> nn.Parameter:
        return nn.Parameter(torch.empty(prompts, width).uniform_(-bound, bound))

    blocks = transformer_blocks(encoder)
    for index in range(len(blocks)):
        copies = copies_for_block(index, dedicated, tasks, seed_of, make)
        blocks[index] = PromptedBlock(blocks[index], nn.ParameterDict(dict(copies)), replaces_prompts=index > 0)


def task_heads(backbone: Backbone, tasks: Sequence[Task], seed_of: Callable[[str], int]) -> TaskHeads:
    """One head per task, built by its kind under a seed of its own and tagged with the task."""
    heads = {}
    for task in tasks:
        torch.manual_seed(seed_of(f"{task_key(task.index)}:head"))
        heads[task_key(task.index)] = tag_tasks(task.kind.build_head(backbone, task) or nn.Identity(), [task.index])
    return TaskHeads(heads)


def dedicated_blocks(sharing: str, num_blocks: int) -> Callable[[int], bool]:
    """Which blocks get one module per task: ``none`` shared -> all, ``half`` -> the second half, ``all`` -> none."""
    if sharing == "none":
        return lambda index: True
    if sharing == "half":
        return lambda index: index >= num_blocks // 2
    return lambda index: False


@torch.no_grad()
def head_features(
    model: nn.Module, params: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor] | torch.Tensor, batch_size: int,
) -> torch.Tensor:
    """The head's input features of ``inputs`` (named columns, or images) with ``params`` loaded (left loaded), in
    float32. Call it under the evaluation's precision (:func:`rayfed.training.mixed_precision`): on a GPU under bf16
    autocast the model's frozen layers are stored in bf16 (:mod:`rayfed.models.frozen_weights`)."""
    model.eval()
    model.load_trainable(params)
    columns = {"pixel_values": inputs} if isinstance(inputs, torch.Tensor) else inputs
    rows = len(next(iter(columns.values())))
    return torch.cat([model.features({k: v[start:start + batch_size] for k, v in columns.items()}).float()
                      for start in range(0, rows, batch_size)])


def feature_shift(before: torch.Tensor, after: torch.Tensor) -> float:
    """``1 - mean_x cos(before(x), after(x))`` (the representation shift)."""
    return 1.0 - nn.functional.cosine_similarity(before, after, dim=1).mean().item()


def representation_shift(
    model: nn.Module, initial: dict[str, torch.Tensor], current: dict[str, torch.Tensor],
    inputs: dict[str, torch.Tensor] | torch.Tensor, batch_size: int,
) -> float:
    """The shift of the head's input features over ``inputs`` from ``initial`` to ``current`` parameters."""
    before = head_features(model, initial, inputs, batch_size)
    return feature_shift(before, head_features(model, current, inputs, batch_size))
