"""Train a DFlash draft for a target on target-regenerated data.

Recipe (REFERENCE section 3): random anchors from response positions, many
blocks per sequence in one forward under the block-sparse mask, same-position
labels, slot 0 excluded, decaying position weights; the target, its embedding
and LM head frozen; AdamW with warm-up and cosine decay, clipping 1.0.
Resumable from ``run_dir/checkpoint.pt``; the result is written in the official
checkpoint format (what SGLang and vLLM load), plus the draft vocabulary map
when ``draft_vocab_size`` asks for one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from speculative.chat import stop_token_ids
from speculative.checkpoint import load_draft, save_draft
from speculative.config import DFlashConfig, build_target_layer_ids
from speculative.draft import VOCAB_IDS_NAME, DFlashDraftModel
from speculative.target import TargetModel
from speculative.train.draft_vocab import frequent_token_ids, response_tokens, token_coverage
from speculative.train.loop import ResumableRun, warmup_cosine
from speculative.train.objective import default_gamma, dflash_loss, sample_anchors
from speculative.train.tokenizer import MASK


@dataclass(frozen=True)
class DraftTrainConfig:
    """Draft training settings. ``target_layer_ids`` is a comma list ("" = the
    official default for the draft depth); ``gamma`` 0 = the paper's value for
    the block size; ``epochs`` may be fractional; ``draft_vocab_size`` K > 0
    gives the draft a reduced vocabulary, the K most frequent response tokens
    of the data (stop tokens always included), 0 = the whole vocabulary (or
    the ``init_from`` draft's map)."""

    target_dir: Path
    data: tuple[Path, ...]
    out_dir: Path
    run_dir: Path
    num_layers: int = 1
    block_size: int = 16
    target_layer_ids: str = ""
    anchors_per_sequence: int = 64
    batch_size: int = 8
    max_length: int = 768
    epochs: float = 6.0
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    gamma: float = 0.0
    checkpoint_every: int = 100
    time_limit_minutes: float = 0.0
    seed: int = 0
    init_from: str = ""
    draft_vocab_size: int = 0


def draft_config_for(target: TargetModel, mask_token_id: int, cfg: DraftTrainConfig) -> DFlashConfig:
    """An official-format draft config: the target's config with the draft depth
    and the DFlash keys."""
    layer_ids = (
        [int(x) for x in cfg.target_layer_ids.split(",")]
        if cfg.target_layer_ids
        else build_target_layer_ids(target.num_layers, cfg.num_layers)
    )
    raw = target.config.to_dict()
    for key in ("architectures", "auto_map", "transformers_version", "dtype", "torch_dtype"):
        raw.pop(key, None)
    raw.update(
        architectures=["DFlashDraftModel"],
        num_hidden_layers=cfg.num_layers,
        layer_types=["full_attention"] * cfg.num_layers,
        block_size=cfg.block_size,
        num_target_layers=target.num_layers,
        dflash_config={"mask_token_id": mask_token_id, "target_layer_ids": layer_ids},
    )
    return DFlashConfig.from_dict(raw)


def load_records(paths: Sequence[Path], max_length: int) -> list[tuple[list[int], int]]:
    """(tokens, response start) per record of every file, truncated to
    ``max_length``; records with fewer than two response tokens are dropped."""
    records = []
    for path in paths:
        with Path(path).open() as f:
            for line in f:
                record = json.loads(line)
                tokens = (record["prompt_ids"] + record["response_ids"])[:max_length]
                if len(tokens) - len(record["prompt_ids"]) >= 2:
                    records.append((tokens, len(record["prompt_ids"])))
    if not records:
        raise ValueError(f"no usable records in {', '.join(map(str, paths))}")
    return records


def collate(records: list[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded tokens [B, S], lengths [B], response starts [B]."""
    width = max(len(t) for t, _ in records)
    tokens = torch.full((len(records), width), pad_id, dtype=torch.long)
    for i, (t, _) in enumerate(records):
        tokens[i, : len(t)] = torch.tensor(t)
    lengths = torch.tensor([len(t) for t, _ in records])
    starts = torch.tensor([s for _, s in records])
    return tokens, lengths, starts


def train_draft(cfg: DraftTrainConfig) -> dict:
    """Train (or resume) a draft; write it when all steps are done. Returns the
    run summary (also ``training.json`` next to the checkpoint)."""
    tokenizer = AutoTokenizer.from_pretrained(str(cfg.target_dir), local_files_only=True)
    target = TargetModel.from_pretrained(cfg.target_dir)
    for p in target.model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(cfg.seed)
    draft = DFlashDraftModel(draft_config_for(target, tokenizer.convert_tokens_to_ids(MASK), cfg)).train()
    records = load_records(cfg.data, cfg.max_length)
    if cfg.draft_vocab_size:
        ids = frequent_token_ids(
            response_tokens(records),
            cfg.draft_vocab_size,
            vocab_size=target.vocab_size,
            always=stop_token_ids(tokenizer),
        )
        draft.set_draft_vocab(ids)
    if cfg.init_from:
        grow_from(draft, load_draft(cfg.init_from))
    steps = max(1, math.ceil(cfg.epochs * len(records) / cfg.batch_size))
    gamma = cfg.gamma or default_gamma(cfg.block_size)
    warmup = max(1, int(cfg.warmup_ratio * steps))
    optimizer = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, steps, warmup))
    generator = torch.Generator().manual_seed(cfg.seed)
    run = ResumableRun(
        cfg.run_dir / "checkpoint.pt",
        {"draft": draft, "optimizer": optimizer, "scheduler": scheduler},
        generator,
        total_steps=steps,
        checkpoint_every=cfg.checkpoint_every,
        time_limit_minutes=cfg.time_limit_minutes,
        name="draft",
    )
    correct = torch.zeros(cfg.block_size - 1)
    counted = torch.zeros(cfg.block_size - 1)
    while not run.finished:
        batch = [records[i] for i in torch.randint(0, len(records), (cfg.batch_size,), generator=generator).tolist()]
        tokens, lengths, starts = collate(batch, tokenizer.pad_token_id)
        anchors, valid = sample_anchors(lengths, starts, cfg.anchors_per_sequence, generator)
        features = target.forward_sequences(tokens, feature_layers=draft.config.target_layer_ids).features
        out = dflash_loss(draft, target, tokens, features, lengths, anchors, valid, gamma)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        correct += out.correct
        counted += out.counted
        accuracy = correct / counted.clamp(min=1)
        run.advance(loss=f"{out.loss.item():.3f}", acc1=f"{accuracy[0]:.2f}", tau=f"{expected_tau(accuracy):.2f}")
        if run.due():
            run.record(
                {
                    "loss": out.loss.item(),
                    "accuracy_per_position": [round(a, 4) for a in accuracy.tolist()],
                    "expected_tau": expected_tau(accuracy),
                }
            )
            correct.zero_()
            counted.zero_()
        if run.out_of_time():
            return {"finished": False, **run.state}
    run.close()
    draft.eval()
    save_draft(draft, cfg.out_dir)
    config = {k: " ".join(map(str, v)) if isinstance(v, tuple) else str(v) for k, v in asdict(cfg).items()}
    summary = {"finished": True, "steps": steps, "config": config, **run.state}
    if draft.draft_vocab_ids is not None:
        coverage = token_coverage(response_tokens(records), draft.draft_vocab_ids, vocab_size=target.vocab_size)
        summary["draft_vocab"] = {"size": draft.draft_vocab_ids.numel(), "response_token_coverage": round(coverage, 4)}
    (cfg.out_dir / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def grow_from(draft: DFlashDraftModel, source: DFlashDraftModel) -> None:
    """Start ``draft`` from a trained ``source`` draft with the same target
    layers and at most its depth: every source weight is copied, and the layers
    ``draft`` has beyond the source's start as identities (their attention and
    MLP output projections zeroed, so the residual stream passes through).
    The grown draft predicts exactly what the source did; training then makes
    use of the new depth. A source's draft vocabulary carries over (a draft
    that already has a different one is refused: its head would not be the
    one the source was trained with); a full-vocabulary source keeps the
    draft's own map."""
    if len(draft.layers) < len(source.layers):
        raise ValueError(f"cannot start a {len(draft.layers)}-layer draft from a {len(source.layers)}-layer one")
    if source.draft_vocab_ids is not None:
        own = draft.draft_vocab_ids
        if own is not None and not torch.equal(own.cpu(), source.draft_vocab_ids.cpu()):
            raise ValueError(
                f"the source draft has its own draft vocabulary ({source.draft_vocab_ids.numel()} ids), different "
                f"from this draft's ({own.numel()} ids): train without draft_vocab_size to keep the source's"
            )
        draft.set_draft_vocab(source.draft_vocab_ids)
    missing, unexpected = draft.load_state_dict(source.state_dict(), strict=False)
    if unexpected or any(not key.startswith("layers.") and key != VOCAB_IDS_NAME for key in missing):
        raise ValueError(f"the source draft does not fit: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for layer in draft.layers[len(source.layers) :]:
            for projection in (layer.self_attn.o_proj, layer.mlp.down_proj):
                projection.weight.zero_()
                if projection.bias is not None:
                    projection.bias.zero_()


def expected_tau(accuracy: torch.Tensor) -> float:
    """Acceptance length implied by per-position accuracies under greedy
    verification, treating them as acceptance rates: 1 + sum_k prod_{j<=k} acc_j."""
    return 1.0 + float(torch.cumprod(accuracy, dim=0).sum())
