"""Stand-in torchvision submodule (see the package docstring)."""

from torchvision._stub import InterpolationMode, module_getattr

__all__ = ["InterpolationMode"]
__getattr__ = module_getattr
