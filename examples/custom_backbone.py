"""Bring your own model: any ``nn.Module`` image encoder as a backbone, fine-tuned with LoRA through peft.

    python examples/custom_backbone.py [key.sub=value ...]

A backbone builder is called with a ``BackboneRequest`` (the model config and a seed) and returns a
``rayfed.Backbone``: the frozen encoder, the size of its features and its input size. ``model.lora.targets``
names the encoder's linear layers LoRA goes on; the engine adds a head per task and trains LoRA + head.
"""

from __future__ import annotations

import sys

from torch import nn

import rayfed


class SmallConvNet(nn.Module):
    """Two convolutions and a linear projection to ``width`` features."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                                  nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten())
        self.project = nn.Linear(16 * 4 * 4, width)
        self.mix = nn.Linear(width, width)

    def forward(self, pixel_values):
        return self.mix(nn.functional.relu(self.project(self.conv(pixel_values))))


@rayfed.register_backbone("small-convnet")
def small_convnet(request: rayfed.BackboneRequest) -> rayfed.Backbone:
    """A small random ConvNet (weights seeded by the run); images resized to model.image_size (default 8)."""
    return rayfed.Backbone(encoder=SmallConvNet(32), feature_dim=32, image_size=request.config.image_size or 8)


CONFIG = {
    "name": "custom_backbone",
    "data": {"source": "sklearn:digits", "num_clients": 8,
             "partition": {"name": "dirichlet", "alpha": 0.5, "min_samples": 20}},
    "model": {"backbone": "small-convnet", "lora": {"rank": 4, "alpha": 8, "targets": ["project", "mix"]}},
    "federation": {"rounds": 10, "clients_per_round": 4, "eval_every": 5},
    "train": {"local_steps": 5, "batch_size": 16, "lr": 0.01, "optimizer": "adam"},
    "methods": ["local", "fedavg"],
    "placement": {"clients_per_actor": 4},
}

if __name__ == "__main__":
    simulation = rayfed.Simulation(CONFIG, overrides=sys.argv[1:])
    summary = simulation.run()
    for label, result in summary["methods"].items():
        print(f"{label}: local_acc = {result['mean']['local_acc']:.4f}")
    print(f"results: {simulation.run_dir}")
