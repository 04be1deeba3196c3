"""DFlash for SGLang 0.5.23: a plugin (no fork) that makes the DFlash verify
block follow a per-batch-size policy every step. ``logic`` is pure and runs
anywhere; ``plugin`` and ``worker`` run inside SGLang processes."""
