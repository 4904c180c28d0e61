"""Whether Mooncake can run here: the error saying why not, and the checks both the master process
(:mod:`kvpolicy.mooncake.master`) and the store clients (:mod:`kvpolicy.mooncake.client`) make first."""

from __future__ import annotations

import ctypes

INSTALL_HINT = (
    "mooncake_master not found; install mooncake-transfer-engine-cuda13==0.3.13.post1 beside a CUDA 13 torch"
    " (what '.[vllm]' brings) or mooncake-transfer-engine-non-cuda==0.3.13.post1 beside a CPU torch;"
    " kvpolicy doctor says which"
)
IBVERBS_HINT = "libibverbs1 is missing: apt-get install -y libibverbs1"


class MooncakeUnavailable(RuntimeError):
    """Mooncake cannot run here: package, binary or system library missing, or the master died."""


def require_ibverbs() -> None:
    """Raise :class:`MooncakeUnavailable` unless ``libibverbs.so.1`` loads.

    Both the master binary and ``mooncake.store`` link it, even for the TCP protocol.
    """
    try:
        ctypes.CDLL("libibverbs.so.1")
    except OSError as error:
        raise MooncakeUnavailable(IBVERBS_HINT) from error
