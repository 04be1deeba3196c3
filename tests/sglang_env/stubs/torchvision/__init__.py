"""Stand-in torchvision for the SGLang CPU check only (tests/sglang_env): PyPI's
torchvision links libtorch_cuda.so and fails on a CPU torch; SGLang imports it at
module level for multimodal preprocessing, which the check never runs."""

from torchvision import io, ops, transforms
from torchvision._stub import InterpolationMode, module_getattr

__all__ = ["InterpolationMode", "io", "ops", "transforms"]
__version__ = "0.28.0+stub"
__getattr__ = module_getattr
