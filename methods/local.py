"""Local: every client trains alone and nothing is communicated (the no-federation baseline)."""

from rayfed.method import Method


class Local(Method):
    communicates = False
