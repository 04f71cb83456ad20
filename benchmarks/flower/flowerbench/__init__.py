"""flowerbench: rayfed's benchmark workload (benchmarks/overhead.py) as a Flower app.

task.py               the workload: model, data, local training step (all reused from rayfed)
client_app.py         the ClientApp as Flower's docs write one: the model is built in every handler call
client_app_cached.py  the same ClientApp with the model built once per actor process (module-level cache)
server_app.py         the ServerApp: FedAvg over the trainable parameters, round timestamps
"""
