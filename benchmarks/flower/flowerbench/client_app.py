"""flowerbench ClientApp, written the way Flower's documentation and examples write one.

As in quickstart-pytorch and flowertune-llm, each handler call builds the model, loads the
received arrays into it, loads the node's partition, trains (or evaluates) and replies with a
Message. The ClientApp keeps nothing between calls, so every call pays for the backbone again.
"""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flowerbench.task import get_backbone, get_device, get_model, load_data, memory_metrics
from flowerbench.task import test as test_fn
from flowerbench.task import train as train_fn

# Flower ClientApp
app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the model on local data."""
    # Build the model and move it to the device
    backbone = get_backbone()
    model = get_model(backbone)
    device = get_device()
    model.to(device)
    params = msg.content["arrays"].to_torch_state_dict()

    # Load the data
    partition_id = int(context.node_config["partition-id"])
    data = load_data(partition_id, backbone)

    # Call the training function (it loads the received weights first)
    result = train_fn(model, data, params, partition_id, int(msg.content["config"]["server-round"]), device)

    # Construct and return reply Message
    metrics = {"train_loss": result.loss, "num-examples": data.num_train, **memory_metrics(device)}
    content = RecordDict({"arrays": ArrayRecord(result.params), "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the model on local data."""
    backbone = get_backbone()
    model = get_model(backbone)
    device = get_device()
    model.to(device)
    params = msg.content["arrays"].to_torch_state_dict()
    partition_id = int(context.node_config["partition-id"])
    data = load_data(partition_id, backbone)
    results = test_fn(model, data, params, partition_id, int(msg.content["config"]["server-round"]), device)
    metrics = {**{f"eval-{name}": value for name, value in results.items()}, "num-examples": data.num_test}
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
