"""Linear layers with weights packed once for the CPU (oneDNN), not per call.

``F.linear`` on a CPU repacks the weight into the GEMM kernel's blocked layout
on every call; at the few rows a decode step or a verify block has, that
packing costs as much as the multiplication, and a small-row GEMM is slower
than the one-row GEMV plain decoding runs. Measured on the 2-core AVX2 dev
machine (90 decoder MLP weights, 318 MB, fp32; docs/LOG.md): 54 / 82 / 79 ms
at 1 / 4 / 16 rows with ``F.linear``, 31 / 41 / 48 ms packed; the 49k-row LM
head at 4 rows 73 ms against 23 ms; 64 rows (regeneration) 235 against 113 ms.
So packing speeds up plain decoding, makes a verify block cheaper relative to
it, and doubles batched regeneration.

``pack_linears`` swaps every ``nn.Linear`` of a model for a ``PackedLinear``
that keeps the original weight (tied weights stay tied, autograd through the
layer still works: a forward that needs gradients uses ``F.linear``, and a
weight changed in place is packed again before its next use).
Packing is for inference on a CPU in a dtype oneDNN packs there (fp32 always;
bf16 only with AVX-512 or AVX-NE-CONVERT); ``packing_support`` says whether,
and why not.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in oneDNN's blocked layout, for ``packed_linear``."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    return packed


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the weight as ``pack_weight`` left it (no gradients)."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
        x, packed, None if bias is None else bias.detach(), "none", [], ""
    )
    return out


class PackedLinear(nn.Module):
    """``nn.Linear`` whose no-grad forward multiplies a weight packed once (and
    packed again if the weight has changed since: its version counter moved)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._packed = self._pack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)
        if self._packed[0] != self.weight._version:
            self._packed = self._pack()
        # oneDNN multiplies only in the weight's dtype. Under autocast (the bf16 held-out pass of draft
        # training) an fp32 draft hands a bf16 target head fp32 activations; F.linear would cast them too.
        if x.dtype != self.weight.dtype:  # a compare, not a no-op ``to`` dispatch: 211 linears run every step
            x = x.to(self.weight.dtype)
        return packed_linear(x, self._packed[1], self.bias)

    def _pack(self) -> tuple[int, torch.Tensor]:
        """(the weight's version counter, the weight packed)."""
        return self.weight._version, pack_weight(self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@functools.cache
def packing_support(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when linears in ``dtype`` on ``device`` can be packed here, else why not."""
    if device.type != "cpu":
        return f"packing is for CPUs, the model is on {device.type}"
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]  # unannotated in torch
        return "this torch build has no oneDNN"
    try:
        pack_weight(torch.zeros(8, 8, dtype=dtype))
    except RuntimeError as exc:
        return f"oneDNN cannot pack {dtype} here: {exc}"
    return None


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` inside ``model`` by a ``PackedLinear`` (in
    place); returns how many. Call ``packing_support`` first."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
