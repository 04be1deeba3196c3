"""Stand-in sgl_kernel for the SGLang CPU check only (tests/sglang_env): PyPI has
no CPU build. SGLang imports kernel names at module level; the plain CPU decode
path the check runs (``SGLANG_USE_CPU_ENGINE=1 --device cpu``, no speculation)
calls none of them, so every name imports and raises if it is ever called."""

from collections.abc import Callable

__version__ = "0.0.0+stub"


def __getattr__(name: str) -> Callable[..., None]:
    if name.startswith("__"):
        raise AttributeError(name)

    def not_available(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(f"sgl_kernel.{name}: test stand-in, there is no CPU build of sgl_kernel")

    not_available.__name__ = name
    return not_available
