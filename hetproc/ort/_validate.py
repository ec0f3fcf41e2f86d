"""Crash-isolated validation (placeholder, filled in below)."""


def validate(model, providers, inputs=None, **kwargs):
    raise NotImplementedError
