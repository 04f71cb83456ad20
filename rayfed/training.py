"""Local training and evaluation of one client, as methods call them from their hooks."""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rayfed import seeding
from rayfed.config import TrainConfig
from rayfed.method import TensorDict
from rayfed.metrics import with_derived
from rayfed.models import ClientModel
from rayfed.modules import select_task

log = logging.getLogger(__name__)

# An extra loss term computed from the live trainable parameters (e.g. a proximal term).
Penalty = Callable[[dict[str, torch.Tensor]], torch.Tensor]


@dataclass
class ClientData:
    """A client's own examples: raw (N, C, H, W) images in [0, 1] (the model resizes them) and labels."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor

    @property
    def num_train(self) -> int:
        return len(self.train_y)

    def to(self, device: torch.device) -> ClientData:
        return ClientData(*(resident(t, device) for t in vars(self).values()))

    @property
    def num_test(self) -> int:
        return len(self.test_y)


@dataclass
class EvalSet:
    """Test data every client is scored on with its own model (e.g. the base or novel classes), loaded once
    per actor: ``{name}_acc`` is the accuracy over the classes of the run's task ``task``."""

    name: str
    x: torch.Tensor
    y: torch.Tensor
    task: int
    exclude_own_classes: bool = False  # leave out the classes the client trains on

    def to(self, device: torch.device) -> EvalSet:
        return dataclasses.replace(self, x=resident(self.x, device), y=resident(self.y, device))


def resident(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; on the host, in pinned memory when a GPU will read it (asynchronous copies)."""
    if device.type == "cpu" and torch.cuda.is_available():
        return tensor.pin_memory()
    return tensor.to(device)


@dataclass
class TrainResult:
    params: TensorDict
    loss: float  # mean training loss over the steps taken


def proximal_penalty(anchor: TensorDict | None, strength: float) -> Penalty | None:
    """``strength / 2 * ||w - anchor||^2`` over the parameters present in ``anchor``."""
    if anchor is None or strength == 0:
        return None

    anchor_on_device: TensorDict = {}

    def penalty(params: dict[str, torch.Tensor]) -> torch.Tensor:
        if not anchor_on_device:  # payloads arrive on the CPU; move them once, not every step
            anchor_on_device.update({n: a.to(params[n].device) for n, a in anchor.items()})
        return 0.5 * strength * sum(((params[n] - a) ** 2).sum() for n, a in anchor_on_device.items())

    return penalty


class ClientContext:
    """One client as a method sees it inside its actor: its data, the model, a seeded trainer."""

    def __init__(
        self, client_id: int, round_idx: int, seed: int, data: ClientData,
        model: ClientModel, train_config: TrainConfig, device: torch.device, eval_sets: Sequence[EvalSet] = (),
        task: int = 0,
    ):
        self.client_id = client_id
        self.round = round_idx
        self.seed = seed
        self.data = data
        self.model = model
        self.train_config = train_config
        self.device = device
        self.eval_sets = eval_sets
        self.task = task  # the index of the task (label space) the client learns

    @property
    def num_samples(self) -> int:
        return self.data.num_train

    def default_steps(self) -> int:
        return local_steps(self.train_config, self.data.num_train)

    def train(
        self, params: TensorDict, *, steps: int | None = None, purpose: str = "train",
        extra_loss: Penalty | None = None, lr: float | None = None,
    ) -> TrainResult:
        """Run ``steps`` minibatch steps from ``params``; batches and dropout seeded by (round, client, purpose)."""
        config = self.train_config
        steps = self.default_steps() if steps is None else steps
        self.model.load_trainable(params)
        named = {name: p for name, p in self.model.named_parameters() if name in params}
        self.model.train()
        graphed = None
        if config.cuda_graphs and self.device.type == "cuda" and extra_loss is None:
            # Before seeding: a first capture runs warm-up steps, which would draw dropout masks.
            graphed = _graphed_step(self.model, named, config, lr or config.lr, self.data, self.task)  # None: eager
        generator = seeding.torch_generator(self.seed, self.round, self.client_id, purpose + ":batches")
        torch.manual_seed(seeding.torch_seed(self.seed, self.round, self.client_id, purpose + ":dropout"))
        batches = _batches(self.data.num_train, config.batch_size, steps, generator, self.data.train_x.device)
        # Summed on the device: reading each step's loss would make the host wait for the GPU every step.
        total_loss = torch.zeros((), device=self.device)
        if graphed is not None:
            for indices in batches:
                total_loss += graphed.step(self.data.train_x[indices], self.data.train_y[indices])
        else:
            optimizer = _optimizer(config, list(named.values()), lr or config.lr)
            for step, indices in enumerate(batches):
                if config.schedule != "constant" and purpose == "train":  # global step: all rounds' local steps
                    for group in optimizer.param_groups:
                        group["lr"] = scheduled_lr(config, lr or config.lr, self.round * steps + step)
                x = self.data.train_x[indices].to(self.device, non_blocking=True)
                y = self.data.train_y[indices].to(self.device, non_blocking=True)
                with _autocast(self.device):
                    loss = nn.functional.cross_entropy(self.model(x), y)
                total_loss += loss.detach().float()
                if extra_loss is not None:
                    loss = loss + extra_loss(named)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if config.grad_clip is not None:
                    nn.utils.clip_grad_norm_(list(named.values()), config.grad_clip)
                optimizer.step()
        return TrainResult({n: p.detach().clone() for n, p in named.items()}, total_loss.item() / max(steps, 1))

    @torch.no_grad()
    def evaluate(self, params: TensorDict) -> dict[str, float]:
        """Accuracy and loss on the client's own test set (personalization), and accuracy on each shared
        evaluation set; plus the metrics derived from these (:mod:`rayfed.metrics`)."""
        self.model.load_trainable(params)
        self.model.eval()
        correct, loss_sum = self._score(self.data.test_x, self.data.test_y)
        metrics = {"local_acc": correct / self.data.num_test, "local_loss": loss_sum / self.data.num_test}
        for eval_set in self.eval_sets:
            x, y = eval_set.x, eval_set.y
            if eval_set.exclude_own_classes:
                keep = ~torch.isin(y, self.data.train_y.unique())
                x, y = x[keep], y[keep]
            select_task(self.model, eval_set.task)
            metrics[f"{eval_set.name}_acc"] = self._score(x, y)[0] / len(y)
        if self.eval_sets:
            select_task(self.model, self.task)
        return with_derived(metrics)

    def _score(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[int, float]:
        """(correct predictions, summed cross-entropy) of the model over ``images``."""
        correct, loss_sum = 0, 0.0
        size = self.train_config.eval_batch_size
        for start in range(0, len(labels), size):
            x = images[start:start + size].to(self.device)
            y = labels[start:start + size].to(self.device)
            with _autocast(self.device):
                logits = self.model(x).float()
            loss_sum += nn.functional.cross_entropy(logits, y, reduction="sum").item()
            correct += (logits.argmax(dim=1) == y).sum().item()
        return correct, loss_sum


def local_steps(config: TrainConfig, num_train: int) -> int:
    """Steps of one local update: ``local_steps``, or ``local_epochs`` passes over the client's data."""
    if config.local_epochs is not None:
        return config.local_epochs * math.ceil(num_train / config.batch_size)
    return config.local_steps


def scheduled_lr(config: TrainConfig, base_lr: float, global_step: int) -> float:
    """Linear warm-up to ``base_lr`` over ``warmup_steps``, then cosine decay to 0 at ``decay_steps``."""
    if global_step < config.warmup_steps:
        return base_lr * (global_step + 1) / config.warmup_steps
    span = max(config.decay_steps - config.warmup_steps, 1)
    progress = min((global_step - config.warmup_steps) / span, 1.0)
    return 0.5 * base_lr * (1.0 + math.cos(math.pi * progress))


def _optimizer(
    config: TrainConfig, params: list[torch.Tensor], lr: float, capturable: bool = False,
) -> torch.optim.Optimizer:
    # One fused kernel per step on the GPU instead of a few per tensor: the steps are launch-bound.
    fused = all(p.is_cuda for p in params) or None
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=config.momentum, weight_decay=config.weight_decay, fused=fused)
    adam = torch.optim.Adam if config.optimizer == "adam" else torch.optim.AdamW
    return adam(params, lr=lr, weight_decay=config.weight_decay, fused=fused, capturable=capturable)


class GraphedStep:
    """One training step (forward, loss, backward, optimizer step) of one model, trained set and batch
    shape, captured once as a CUDA graph and replayed for every client that trains the same set.

    The steps of a foundation model with small adapters are bound by kernel launches (about a thousand
    per step); a replay launches them all at once. Each train call loads the client's values into the
    same parameter tensors and zeroes the optimizer's state in place, which is where a fresh optimizer
    starts; each batch is copied into the static inputs the graph reads.
    """

    def __init__(self, model: ClientModel, named: dict[str, torch.Tensor], config: TrainConfig, lr: float,
                 x: torch.Tensor, y: torch.Tensor):
        self.optimizer = _optimizer(config, list(named.values()), lr, capturable=True)
        self.x, self.y = x.clone(), y.clone()
        start = {name: param.detach().clone() for name, param in named.items()}
        try:
            side = torch.cuda.Stream(x.device)  # warm-up off the default stream, as graph capture requires
            side.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(side), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*capturable=True.*")  # uncaptured warm-up steps
                for _ in range(3):
                    self.optimizer.zero_grad(set_to_none=True)
                    self._forward_backward_step(model)
            torch.cuda.current_stream(x.device).wait_stream(side)
            self.optimizer.zero_grad(set_to_none=True)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.loss = self._forward_backward_step(model)
        finally:
            with torch.no_grad():  # undo the warm-up's steps
                for name, param in named.items():
                    param.copy_(start[name])

    def _forward_backward_step(self, model: ClientModel) -> torch.Tensor:
        with _autocast(self.x.device, cache_enabled=False):  # no cast cache under capture
            loss = nn.functional.cross_entropy(model(self.x), self.y)
        loss.backward()
        self.optimizer.step()
        return loss.detach().float()

    def reset_optimizer(self) -> None:
        for state in self.optimizer.state.values():
            for value in state.values():
                value.zero_()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One step on batch (x, y); returns its loss (a tensor on the GPU, valid until the next step)."""
        self.x.copy_(x, non_blocking=True)
        self.y.copy_(y, non_blocking=True)
        self.graph.replay()
        return self.loss


MAX_GRAPHS_PER_MODEL = 4  # each graph keeps a step's activations in a memory pool of its own
_GRAPHS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, GraphedStep | None]] = weakref.WeakKeyDictionary()


def _graphed_step(model: ClientModel, named: dict[str, torch.Tensor], config: TrainConfig, lr: float,
                  data: ClientData, task: int) -> GraphedStep | None:
    """The model's graph for this trained set, task (the forward path: heads, label space), batch shape
    and optimizer (captured on first use, the least recently used of :data:`MAX_GRAPHS_PER_MODEL`
    dropped), its optimizer state zeroed; None when the step cannot be captured (it then runs eagerly)."""
    batch = min(config.batch_size, data.num_train)
    key = (tuple(named), task, batch, tuple(data.train_x.shape[1:]), data.train_x.dtype, config.optimizer,
           config.weight_decay, lr)
    graphs = _GRAPHS.setdefault(model, {})
    if key in graphs:
        graphs[key] = graphs.pop(key)  # most recently used last
    else:
        if len(graphs) == MAX_GRAPHS_PER_MODEL:
            del graphs[next(iter(graphs))]
        device = next(iter(named.values())).device
        try:
            graphs[key] = GraphedStep(model, named, config, lr, data.train_x[:batch].to(device),
                                      data.train_y[:batch].to(device))
        except RuntimeError as err:  # e.g. a forward that reads a value back to the host mid-step
            log.warning("train.cuda_graphs: the training step of this %s could not be captured as a CUDA graph "
                        "(%s); it trains eagerly.", type(model).__name__, str(err).splitlines()[0])
            graphs[key] = None
    if graphs[key] is not None:
        graphs[key].reset_optimizer()
    return graphs[key]


def _batches(num_samples: int, batch_size: int, steps: int, generator: torch.Generator, device: torch.device):
    """``steps`` batches from successive seeded permutations (epochs) of the client's samples.

    The permutations are drawn on the CPU (the same numbers on every device) and moved once per
    epoch to where the data is, so indexing it never waits on a copy.
    """
    batch_size = min(batch_size, num_samples)
    order = torch.randperm(num_samples, generator=generator).to(device)
    position = 0
    for _ in range(steps):
        if position + batch_size > num_samples:
            order = torch.randperm(num_samples, generator=generator).to(device)
            position = 0
        yield order[position:position + batch_size]
        position += batch_size


def _autocast(device: torch.device, cache_enabled: bool = True):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda", cache_enabled=cache_enabled)
