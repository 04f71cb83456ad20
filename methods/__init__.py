"""The built-in PFL methods, one module each; each registers itself by name (``rayfed.register_method``).

Importing this package registers them all; configs name them (``methods: [fedavg, ditto]``) and the
engine finds them through :mod:`rayfed.registry`, never by importing a method itself.
"""

from rayfed.methods import (
    clip_zeroshot, disentafl, ditto, fedavg, feddat, feddat_lora, feddpa, feddyn, fedmosaic, fedprox, fedsim, fedyolo,
    local, perfedavg, pfedmma, promptfl, tap,
)

__all__ = ["clip_zeroshot", "disentafl", "ditto", "fedavg", "feddat", "feddat_lora", "feddpa", "feddyn", "fedmosaic",
           "fedprox", "fedsim", "fedyolo", "local", "perfedavg", "pfedmma", "promptfl", "tap"]
