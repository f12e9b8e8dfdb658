"""Drafter model definitions and their serving format, keyed by algorithm.

``DRAFTERS[algorithm] = (ConfigClass, ModelClass)``; ``drafters/format.py`` saves and loads
the serving format (config.json + model.safetensors + export.json).
"""

from specray.drafters.dflash import DFlashConfig, DFlashDrafter

DRAFTERS = {"dflash": (DFlashConfig, DFlashDrafter)}
