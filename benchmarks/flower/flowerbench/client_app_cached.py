"""flowerbench ClientApp with the model cached per actor process: the fastest way we know to write it.

Flower's Simulation Engine runs ClientApps in long-lived Ray actors, so a module-level cache
survives from one message to the next inside an actor (Flower's examples cache their
FederatedDataset this way). Here the whole client model (frozen backbone + LoRA + head) is built
once per actor process and kept on the device, with its backbone to encode the clients' text; each
message only loads the received trainable values into it and trains with a fresh optimizer, which
is what rayfed's ClientActor does too.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flowerbench.task import get_backbone, get_device, get_model, load_data, memory_metrics
from flowerbench.task import test as test_fn
from flowerbench.task import train as train_fn
from rayfed.models import Backbone, ClientModel

_cached: tuple[Backbone, ClientModel] | None = None  # built on this actor's first message, then reused


def cached_model(device: torch.device) -> tuple[Backbone, ClientModel]:
    global _cached
    if _cached is None:
        backbone = get_backbone()
        _cached = backbone, get_model(backbone).to(device)
    return _cached


# Flower ClientApp
app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the cached model, from the received weights, on local data."""
    device = get_device()
    backbone, model = cached_model(device)
    params = msg.content["arrays"].to_torch_state_dict()
    partition_id = int(context.node_config["partition-id"])
    data = load_data(partition_id, backbone)
    result = train_fn(model, data, params, partition_id, int(msg.content["config"]["server-round"]), device)
    metrics = {"train_loss": result.loss, "num-examples": data.num_train, **memory_metrics(device)}
    content = RecordDict({"arrays": ArrayRecord(result.params), "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the cached model, with the received weights, on local data."""
    device = get_device()
    backbone, model = cached_model(device)
    params = msg.content["arrays"].to_torch_state_dict()
    partition_id = int(context.node_config["partition-id"])
    data = load_data(partition_id, backbone)
    results = test_fn(model, data, params, partition_id, int(msg.content["config"]["server-round"]), device)
    metrics = {**{f"eval-{name}": value for name, value in results.items()}, "num-examples": data.num_test}
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
