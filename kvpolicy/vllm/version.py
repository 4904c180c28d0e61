"""Which vLLM releases the connector is built for, checked before any of vLLM's connector classes load.

kvpolicy overrides three methods of vLLM's ``MooncakeStoreWorker`` and rebuilds its ``__init__``
(:func:`kvpolicy.vllm.internals.init_standalone`); both are checked against 0.32 and 0.33 by the equivalence and
drift tests. Another release may have moved what the overrides rely on, so it is refused at import
with one line rather than run on trust.
"""

from __future__ import annotations

import re

SUPPORTED_SERIES = ((0, 32), (0, 33))
"""(major, minor) of the vLLM releases the connector supports; any patch release of them."""


class UnsupportedVLLMError(ImportError):
    """The installed vLLM is outside :data:`SUPPORTED_SERIES`."""


def supported_range() -> str:
    return " and ".join(f"{major}.{minor}" for major, minor in SUPPORTED_SERIES)


def check_vllm_version(version: str) -> None:
    """Raise :class:`UnsupportedVLLMError` (one line: what is installed, what is supported, the fix)
    unless ``version`` (``vllm.__version__``, e.g. ``0.32.0``, ``0.33.1.dev4+g1234``) is supported."""
    found = re.match(r"(\d+)\.(\d+)(?:\.|$|[^\d])", version.strip())
    if found is None or (int(found.group(1)), int(found.group(2))) not in SUPPORTED_SERIES:
        raise UnsupportedVLLMError(
            f"kvpolicy supports vLLM {supported_range()}, but vLLM {version!r} is installed; install a supported "
            "release (in a kvpolicy checkout: pip install '.[vllm]' on GPUs, '.[cpu]' on CPUs; see the README's "
            "Install) or a kvpolicy that supports it"
        )
