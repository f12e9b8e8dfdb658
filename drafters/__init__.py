"""Drafter model definitions and their serving format, keyed by algorithm.

The algorithm seam (DESIGN.md §5): an algorithm ``<a>`` is its modules and one line in each
registry — ``DRAFTERS`` here, ``STRATEGIES`` in ``specray.trainer.strategies``, the serving
worker registry, and its feature contract in ``specray.capture.contract.CONTRACT_SPECS``.
Shared code names no algorithm; it looks the algorithm up here.

``DRAFTERS[<a>] = DrafterSpec(section=…, config=…, model=…, debug_config=…)``
(``drafters/common.py::DrafterSpec`` says what each is). ``drafters/<a>.py`` owns all four:
its manifest section (a variant of the ``drafter`` union, discriminated by ``algorithm``),
the derivation of its model config from that section and a target, its module and a tiny
debug config; ``drafters/common.py`` gives it small-M linear, RMSNorm, RoPE and the draft
vocabulary. ``drafters/format.py`` saves and loads the serving format (config.json +
model.safetensors + export.json) of any registered drafter.

``ALGORITHMS`` is the seam's name list; a name in it without a registered drafter is refused
(``get_drafter``) with the list of implemented ones.
"""

from specray.drafters import dflash, dflash2, dspark, eagle3
from specray.drafters.common import DrafterSpec

ALGORITHMS = ("eagle3", "dflash", "dspark", "dflash2")
DEFAULT_ALGORITHM = "dflash"  # a manifest's drafter section without ``algorithm``

DRAFTERS: dict[str, DrafterSpec] = {
    "dflash": DrafterSpec(section=dflash.DFlashSection, config=dflash.DFlashConfig, model=dflash.DFlashDrafter,
                          debug_config=dflash.debug_config),
    "dflash2": DrafterSpec(dflash2.DFlash2Section, dflash2.DFlash2Config, dflash2.DFlash2Drafter, dflash2.debug_config),
    "dspark": DrafterSpec(dspark.DSparkSection, dspark.DSparkConfig, dspark.DSparkDrafter, dspark.debug_config),
    "eagle3": DrafterSpec(eagle3.Eagle3Section, eagle3.Eagle3Config, eagle3.Eagle3Drafter, eagle3.debug_config),
}


def get_drafter(algorithm: str) -> DrafterSpec:
    """The registered drafter of ``algorithm``; ValueError naming the implemented ones otherwise."""
    if algorithm in DRAFTERS:
        return DRAFTERS[algorithm]
    if algorithm in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r} has no drafter implemented yet; implemented: {sorted(DRAFTERS)}")
    raise ValueError(f"unknown algorithm {algorithm!r}; algorithms: {list(ALGORITHMS)}, implemented: {sorted(DRAFTERS)}")
