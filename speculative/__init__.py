"""DFlash speculative decoding in plain PyTorch: draft model, target adapter,
verification and batched generation. No web code lives here."""

from speculative.checkpoint import CheckpointError, load_draft, save_draft
from speculative.config import DFlashConfig, DraftConfigError, DraftTargetMismatch, build_target_layer_ids
from speculative.decode import DecodeConfig, GenerationResult, RoundStats, spec_generate
from speculative.draft import DFlashDraftModel
from speculative.sampling import SamplingParams
from speculative.target import TargetModel

__all__ = [
    "CheckpointError",
    "DFlashConfig",
    "DFlashDraftModel",
    "DecodeConfig",
    "DraftConfigError",
    "DraftTargetMismatch",
    "GenerationResult",
    "RoundStats",
    "SamplingParams",
    "TargetModel",
    "build_target_layer_ids",
    "load_draft",
    "save_draft",
    "spec_generate",
]
