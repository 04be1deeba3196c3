"""Giving the C heap's freed memory back to the OS while the engine sits idle.

Activations and cache copies of a long request are freed when it ends, but
glibc keeps most of those pages in its heap for reuse: after a 2,234-token
request and three short ones, the SmolLM2 engine idled at 1.8-2.8 GB where it
had loaded at 1.1 GB, and ``malloc_trim(0)`` brought it back to 1.2-1.3 GB in
30-57 ms (docs/LOG.md 2026-12-07 (19)). Without it an idle replica looks, to
its pod's memory limit and to whoever packs pods onto nodes, like a busy one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


def heap_release() -> Callable[[], None] | None:
    """glibc's ``malloc_trim(0)`` as a call, or None where the C library has no
    such function (musl, macOS): there freed memory is left as the allocator keeps it."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        log.info("C library %s has no malloc_trim: idle memory stays with its allocator", name)
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)
