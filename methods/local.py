"""Local: every client trains alone and nothing is communicated (the no-federation baseline)."""

from rayfed.method import Method
from rayfed.registry import register_method


@register_method("local")
class Local(Method):
    communicates = False
