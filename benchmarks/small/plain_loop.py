"""The small run's workload (``workload.yaml``) as a researcher's single-process script would write it.

20 Dirichlet(0.5) clients of scikit-learn's digits (8x8 grey images -> 16x16 RGB), a tiny ViT (d 64, 2 blocks,
patch 4) with LoRA r4 on q_proj/v_proj and a linear head, 10 rounds of 5 sampled clients x 10 SGD steps of batch 16,
FedAvg of the trainable tensors, each client's accuracy on its own test quarter at the end. No rayfed import: the
comparison point for ``compare.sh``.
"""

from __future__ import annotations

import time

started = time.perf_counter()

import numpy as np  # noqa: E402
import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

NUM_CLIENTS, ROUNDS, PER_ROUND, STEPS, BATCH, LR = 20, 10, 5, 10, 16, 0.05


class Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        vit_config = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=128, image_size=16, patch_size=4, num_channels=3,
                                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        encoder = transformers.ViTModel(vit_config, add_pooling_layer=False)
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        self.encoder = peft.get_peft_model(encoder, lora)
        self.head = torch.nn.Linear(64, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(pixel_values=images).last_hidden_state[:, 0])


def dirichlet_split(labels: np.ndarray, rng: np.random.Generator, alpha: float = 0.5, min_samples: int = 20):
    while True:
        clients: list[list[int]] = [[] for _ in range(NUM_CLIENTS)]
        for label in range(10):
            indices = rng.permutation(np.flatnonzero(labels == label))
            cuts = (np.cumsum(rng.dirichlet([alpha] * NUM_CLIENTS)) * len(indices)).astype(int)[:-1]
            for client, part in enumerate(np.split(indices, cuts)):
                clients[client] += part.tolist()
        if min(len(c) for c in clients) >= min_samples:
            return [np.array(c) for c in clients]


def main() -> None:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32)[:, None].repeat(1, 3, 1, 1)
    images = torch.nn.functional.interpolate(images, size=16, mode="bilinear")
    labels = torch.tensor(digits.target)
    splits = []
    for indices in dirichlet_split(digits.target, rng):
        indices = rng.permutation(indices)
        cut = int(0.75 * len(indices))
        splits.append((indices[:cut], indices[cut:]))

    model = Classifier()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    global_state = {n: p.detach().clone() for n, p in trainable.items()}
    round_times = []
    for _ in range(ROUNDS):
        round_started = time.perf_counter()
        sums, total = {n: torch.zeros_like(t) for n, t in global_state.items()}, 0
        for client in rng.choice(NUM_CLIENTS, PER_ROUND, replace=False):
            train = splits[client][0]
            with torch.no_grad():
                for name, param in trainable.items():
                    param.copy_(global_state[name])
            optimizer = torch.optim.SGD(trainable.values(), lr=LR)
            for _ in range(STEPS):
                batch = rng.choice(train, BATCH, replace=len(train) < BATCH)
                loss = torch.nn.functional.cross_entropy(model(images[batch]), labels[batch])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            for name, param in trainable.items():
                sums[name] += len(train) * param.detach()
            total += len(train)
        global_state = {n: s / total for n, s in sums.items()}
        round_times.append(time.perf_counter() - round_started)

    with torch.no_grad():
        for name, param in trainable.items():
            param.copy_(global_state[name])
        accuracies = [(model(images[test]).argmax(1) == labels[test]).float().mean().item() for _, test in splits]
    print(f"plain loop: local_acc {np.mean(accuracies):.4f}; rounds {min(round_times):.3f}-{max(round_times):.3f} s "
          f"(mean {np.mean(round_times):.3f}); process {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
