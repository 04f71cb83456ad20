"""What every pretraining recipe shares: a deterministic CPU context, the training loop, input tensors
and held-out metrics."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from rayfed.data import multimodal
from rayfed.zoo.tokenizers import SPECIAL_TOKENS


@contextmanager
def deterministic_cpu(seed: int) -> Iterator[None]:
    """Seeded, single-threaded, deterministic torch; threads, flags and the global RNG are restored after.

    One thread makes float reductions run in one fixed order, so rebuilding gives the same weights, and
    restoring the RNG keeps a build from shifting the caller's random stream.
    """
    threads = torch.get_num_threads()
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            torch.use_deterministic_algorithms(was_deterministic)


def train(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    *,
    num_samples: int,
    steps: int,
    batch_size: int,
    lr: float,
    weight_decay: float,
    seed: int,
) -> None:
    """AdamW with linear warm-up (10% of steps) and cosine decay; ``loss_fn(batch_indices)`` -> loss.

    Trains the parameters that require grad (embeddings marked ``sparse`` with SparseAdam, which updates
    only the rows a batch uses) and shuffles ``range(num_samples)`` once per epoch.
    """
    sparse = [m.weight for m in model.modules() if isinstance(m, nn.Embedding) and m.sparse and m.weight.requires_grad]
    dense = [p for p in model.parameters() if p.requires_grad and all(p is not q for q in sparse)]
    optimizers: list[torch.optim.Optimizer] = [torch.optim.AdamW(dense, lr=lr, weight_decay=weight_decay)]
    if sparse:
        optimizers.append(torch.optim.SparseAdam(sparse, lr=lr))
    warmup = max(1, steps // 10)
    schedules = [
        torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        )
        for optimizer in optimizers
    ]
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_samples, generator=generator)
    position = 0
    model.train()
    for _ in range(steps):
        if position + batch_size > num_samples:
            order, position = torch.randperm(num_samples, generator=generator), 0
        loss = loss_fn(order[position : position + batch_size])
        position += batch_size
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(dense, 1.0)
        for optimizer, schedule in zip(optimizers, schedules):
            optimizer.step()
            schedule.step()
    model.eval()


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def save_float16(model: Any, out_dir: Path) -> None:
    """``save_pretrained`` with float16 tensors: half the bytes on disk, so that built folders can ship with
    rayfed (``rayfed/zoo/weights``). Every loader reads them back as float32 (``dtype=torch.float32``), and a
    build measures its metrics on the saved folder, so the numbers are those of the float16 weights.

    Converts ``model`` in place: save last.
    """
    model.to(torch.float16).save_pretrained(out_dir)


# ---------------------------------------------------------------------------------------------
# Data


def pixels(images: np.ndarray) -> torch.Tensor:
    """uint8 (N, H, W, C) -> float (N, C, H, W) in [-1, 1], the normalization ``rayfed.models`` gives its backbones."""
    return (torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 255.0 - 0.5) / 0.5


# Families built in one process (a test session, ``rayfed pretrain all``) render their images once.
image_text_pairs = functools.lru_cache(maxsize=8)(multimodal.shape_columns)
text_corpus = functools.lru_cache(maxsize=4)(multimodal.statement_columns)


def held_out(distribution: multimodal.Distribution, n: int, seed: int) -> dict[str, Any]:
    """``n`` shape images of ``distribution`` from the evaluation stream of ``seed`` (never trained on)."""
    return image_text_pairs(n, seed=seed + 10_000, distribution=distribution)


def encode(tokenizer: Any, texts: Sequence[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask, padded to ``max_length``."""
    batch = tokenizer(list(texts), padding="max_length", max_length=max_length, truncation=True, return_tensors="pt")
    # The backend keeps a call's padding and truncation, and save_pretrained would write them to tokenizer.json.
    tokenizer.backend_tokenizer.no_padding()
    tokenizer.backend_tokenizer.no_truncation()
    return batch["input_ids"], batch["attention_mask"]


def batched(n: int, size: int) -> Iterator[slice]:
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


# ---------------------------------------------------------------------------------------------
# Metrics


# Held-out classes in the pretraining styles: measures zero-shot transfer to unseen combinations.
NOVEL = multimodal.Distribution(multimodal.NOVEL_CLASSES, multimodal.PRETRAIN_STYLES, ())


@torch.no_grad()
def zero_shot_metrics(
    encode_images: Callable[[torch.Tensor], torch.Tensor],
    encode_prompts: Callable[[list[str]], torch.Tensor],
    num_samples: int,
    seed: int,
) -> dict[str, float]:
    """Zero-shot accuracy with "a photo of a {class}." prompts (nearest prompt by cosine) on held-out images.

    ``zeroshot_acc``: the seen classes in the pretraining styles; ``novel_zeroshot_acc``: the 16 held-out
    classes in the pretraining styles; ``finetune_zeroshot_acc``: all 64 classes in the fine-tuning styles.
    """

    def accuracy(distribution: multimodal.Distribution) -> float:
        data = held_out(distribution, num_samples, seed)
        images = pixels(data["image"])
        image_features = torch.cat([encode_images(images[rows]) for rows in batched(num_samples, 256)])
        prompt_features = encode_prompts(multimodal.class_prompts(distribution.classes))
        image_features = nn.functional.normalize(image_features, dim=-1)
        similarity = image_features @ nn.functional.normalize(prompt_features, dim=-1).T
        labels = np.asarray([distribution.classes.index(name) for name in data["class_name"]])
        return float(np.mean(similarity.argmax(dim=-1).numpy() == labels))

    return {
        "zeroshot_acc": accuracy(multimodal.PRETRAIN),
        "novel_zeroshot_acc": accuracy(NOVEL),
        "finetune_zeroshot_acc": accuracy(multimodal.FINETUNE),
    }


@torch.no_grad()
def probe_accuracy(encode_images: Callable[[torch.Tensor], torch.Tensor], num_samples: int, seed: int) -> float:
    """Accuracy of a linear probe (:func:`ridge_probe`) on image features, 64 classes in the fine-tuning
    styles, over ``num_samples`` held-out images."""
    data = held_out(multimodal.FINETUNE, num_samples, seed)
    images = pixels(data["image"])
    features = torch.cat([encode_images(images[rows]) for rows in batched(num_samples, 256)])
    labels = np.asarray([multimodal.CLASSES.index(name) for name in data["class_name"]])
    return ridge_probe(features, labels, len(multimodal.CLASSES))


def ridge_probe(features: torch.Tensor, labels: np.ndarray, num_classes: int) -> float:
    """Ridge-regression linear probe on standardized features: fit on the first half of the rows,
    accuracy on the second half."""
    features = features.double().cpu().numpy()
    fit = len(labels) // 2
    mean, std = features[:fit].mean(0), features[:fit].std(0) + 1e-6
    x = np.concatenate([(features - mean) / std, np.ones((len(labels), 1))], axis=1)
    targets = np.eye(num_classes)[labels[:fit]]
    weights = np.linalg.solve(x[:fit].T @ x[:fit] + np.eye(x.shape[1]), x[:fit].T @ targets)
    return float(np.mean((x[fit:] @ weights).argmax(1) == labels[fit:]))


# ---------------------------------------------------------------------------------------------
# Masked language modelling and image-text matching (ViLT, FLAVA)


def random_mask(input_ids: torch.Tensor, mask_token_id: int, probability: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace each word token (not a special token) by the mask token with ``probability``.

    Returns the masked ids and MLM labels (the original id where masked, -100 elsewhere).
    """
    words = input_ids >= len(SPECIAL_TOKENS)
    chosen = words & (torch.rand(input_ids.shape) < probability)
    return torch.where(chosen, mask_token_id, input_ids), torch.where(chosen, input_ids, -100)


def attribute_mask(input_ids: torch.Tensor, tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask the colour word of even rows and the shape word of odd rows (one per caption), which only
    the image can tell; returns the masked ids and MLM labels."""
    colors = torch.as_tensor(tokenizer.convert_tokens_to_ids(list(multimodal.COLORS)))
    shapes = torch.as_tensor(tokenizer.convert_tokens_to_ids(list(multimodal.SHAPES)))
    even = (torch.arange(len(input_ids)) % 2 == 0)[:, None]
    chosen = torch.where(even, torch.isin(input_ids, colors), torch.isin(input_ids, shapes))
    return torch.where(chosen, tokenizer.mask_token_id, input_ids), torch.where(chosen, input_ids, -100)


def matching_pairs(class_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For image-text matching: the caption row each image row is paired with (its own on odd rows,
    the next row's on even rows) and whether the pair matches (same class)."""
    rows = torch.arange(len(class_ids))
    partner = torch.where(rows % 2 == 0, (rows + 1) % len(class_ids), rows)
    return partner, (class_ids[partner] == class_ids).long()
