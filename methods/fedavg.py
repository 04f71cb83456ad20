"""FedAvg (McMahan et al., 2017): sample-count weighted averaging of every trainable parameter.

The behaviour is the engine's default (:class:`rayfed.method.Method`); this module names it.
"""

from rayfed.method import Method
from rayfed.registry import register_method


@register_method("fedavg")
class FedAvg(Method):
    pass
