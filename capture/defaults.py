"""Defaults that the CLI shows in ``--help`` and the configs share, importable without torch."""

DEFAULT_TARGET = "embedded:smollm2-135m-instruct"
"""The embedded SmolLM2-135M-Instruct target (capture/target.py ``load_target``)."""
