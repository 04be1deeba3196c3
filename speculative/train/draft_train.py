"""Train a DFlash draft for a target on target-regenerated data.

Recipe (the DFlash paper, section 4, and docs/training.md): random anchors from response positions, many
blocks per sequence in one forward under the block-sparse mask, same-position
labels, slot 0 excluded, decaying position weights; the target, its embedding
and LM head frozen; AdamW with warm-up and cosine decay, clipping 1.0.
Resumable from ``run_dir/checkpoint.pt``; the result is written in the official
checkpoint format (what SGLang and vLLM load), plus the draft vocabulary map
when ``draft_vocab_size`` asks for one.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from speculative.chat import stop_token_ids
from speculative.checkpoint import load_draft, save_draft
from speculative.config import DFlashConfig, build_target_layer_ids
from speculative.draft import VOCAB_IDS_NAME, DFlashDraftModel
from speculative.precision import DTYPES
from speculative.target import TargetModel
from speculative.train.draft_vocab import frequent_token_ids, response_tokens, token_coverage
from speculative.train.feature_scale import feature_scale, folded, standardized, unfold_into
from speculative.train.features import build_feature_store, teacher_top
from speculative.train.loop import ResumableRun, warmup_cosine
from speculative.train.objective import coverage_counts, default_gamma, dflash_loss, sample_anchors
from speculative.train.tokenizer import MASK


@dataclass(frozen=True)
class DraftTrainConfig:
    """Draft training settings. ``target_layer_ids`` is a comma list ("" = the
    official default for the draft depth); ``gamma`` 0 = the paper's value for
    the block size; ``epochs`` may be fractional; ``draft_vocab_size`` K > 0
    gives the draft a reduced vocabulary, the K most frequent response tokens
    of the data (stop tokens always included), 0 = the whole vocabulary (or
    the ``init_from`` draft's map). ``mask_token``: the target's vocabulary
    entry the MASK slots use (an unused special token; refused when absent).
    ``anchor_coverage`` > 0: anchors per sequence so each response token is a
    label of about that many blocks (``anchors_per_sequence`` the most),
    instead of ``anchors_per_sequence`` each. ``feature_store``: a directory
    where the target's features of every record are computed once and read by
    every epoch (layers ``feature_layers``, "" = the draft's; a superset lets
    drafts fed by different layers share one store). ``holdout``: records kept
    out of training (chosen by content: ``held_out_records``) whose
    teacher-forced slot accuracy is logged at each checkpoint. ``dtype``
    bfloat16: autocast the draft (where the CPU has native bf16); ``save_dtype``
    bfloat16 writes its weights at half the size (serving casts them to its own
    dtype; a deeper draft stays under 50 MB). ``distill_top_k`` k > 0 with ``distill_weight`` w > 0:
    distil the target's top-k next-token distribution beside the hard labels
    (loss ``(1 - w) * CE(label) + w * CE(teacher)``; with a feature store the
    top-k is stored once beside the features). ``packed_linears``: the
    target's linear weights packed once on a CPU (``speculative.packed``; its
    forwards run without gradients, the draft's LM-head pass with them falls
    back to ``F.linear``). ``standardize_features``: train ``fc`` on the
    features divided by their per-channel RMS over ``scale_records`` training
    records, folded back into ``fc`` when the draft is written
    (``speculative.train.feature_scale``). ``device``: where target and draft
    run (``cpu``, ``cuda``). ``schedule_minutes`` > 0: the learning rate's
    warm-up and cosine decay follow training time instead of steps, and the run
    ends after that many minutes (or at the step count ``epochs`` gives, if
    sooner): on a machine lent for a fixed time, the schedule ends when the
    time does."""

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
    mask_token: str = MASK
    anchor_coverage: float = 0.0
    feature_store: str = ""
    feature_layers: str = ""
    holdout: int = 0
    dtype: str = "float32"
    distill_top_k: int = 0
    distill_weight: float = 0.0
    packed_linears: bool = True
    standardize_features: bool = True
    scale_records: int = 32
    save_dtype: str = "float32"
    device: str = "cpu"
    schedule_minutes: float = 0.0

    def __post_init__(self) -> None:
        if self.save_dtype not in DTYPES:
            raise ValueError(f"save_dtype must be float32 or bfloat16, got {self.save_dtype!r}")
        if not 0 <= self.distill_weight <= 1 or self.distill_top_k < 0:
            raise ValueError("distill_weight must be in [0, 1] and distill_top_k >= 0")
        if self.distill_weight > 0 and not self.distill_top_k:
            raise ValueError("distill_weight > 0 needs distill_top_k > 0 (how many teacher tokens per position)")


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


def held_out_records(records: Sequence[tuple[list[int], int]], count: int, seed: int) -> list[int]:
    """Indices of the ``count`` records whose content hashes lowest under
    ``seed``. Each record's rank is its own, not its position's, so when the
    data grows by appended records (training resumed or continued on more
    data) a record the draft trained on never becomes held-out: new records
    can only displace held-out ones into training."""

    def rank(i: int) -> bytes:
        return hashlib.sha256(json.dumps([seed, *records[i]]).encode()).digest()

    return sorted(sorted(range(len(records)), key=rank)[:count])


def split_records(records: Sequence[tuple[list[int], int]], holdout: int, seed: int) -> tuple[list[int], list[int]]:
    """(training, held-out) record indices, the held-out ones ``held_out_records``;
    a holdout of every record is refused."""
    held_out = held_out_records(records, holdout, seed)
    training = sorted(set(range(len(records))) - set(held_out))
    if not training:
        raise ValueError(f"holdout {holdout} leaves none of the {len(records)} records to train on")
    return training, held_out


def collate(records: list[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded tokens [B, S], lengths [B], response starts [B]."""
    width = max(len(t) for t, _ in records)
    tokens = torch.full((len(records), width), pad_id, dtype=torch.long)
    for i, (t, _) in enumerate(records):
        tokens[i, : len(t)] = torch.tensor(t)
    lengths = torch.tensor([len(t) for t, _ in records])
    starts = torch.tensor([s for _, s in records])
    return tokens, lengths, starts


def train_draft(cfg: DraftTrainConfig) -> dict[str, Any]:
    """Train (or resume) a draft; write it when all steps are done. Returns the
    run summary (also ``training.json`` next to the checkpoint)."""
    tokenizer = AutoTokenizer.from_pretrained(str(cfg.target_dir), local_files_only=True)
    # The target runs in the training dtype too: its features (computed once, or per batch) cost the most, and
    # bf16 is what a CPU with native bf16 serves it in.
    target = TargetModel.from_pretrained(
        cfg.target_dir, dtype=getattr(torch, cfg.dtype), device=cfg.device, packed=cfg.packed_linears
    )
    for p in target.model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(cfg.seed)
    draft = DFlashDraftModel(draft_config_for(target, mask_token_id(tokenizer, cfg.mask_token), cfg))
    draft = draft.to(cfg.device).train()
    records = load_records(cfg.data, cfg.max_length)
    training, held_out = split_records(records, cfg.holdout, cfg.seed)
    features = feature_source(target, records, draft, cfg)
    if features is None:
        return {"finished": False, "stage": "features"}
    scale = None
    if cfg.standardize_features:
        scale = feature_scale(features, records, training[: cfg.scale_records], tokenizer.pad_token_id)
        features = standardized(features, scale)
    if cfg.draft_vocab_size:
        ids = frequent_token_ids(
            response_tokens([records[i] for i in training]),
            cfg.draft_vocab_size,
            vocab_size=target.vocab_size,
            always=stop_token_ids(tokenizer),
        )
        draft.set_draft_vocab(ids)
    if cfg.init_from:
        grow_from(draft, load_draft(cfg.init_from))
        if scale is not None:
            unfold_into(draft, scale)
    steps = max(1, math.ceil(cfg.epochs * len(training) / cfg.batch_size))
    gamma = cfg.gamma or default_gamma(cfg.block_size)
    clock = TrainingClock(steps, cfg.warmup_ratio, cfg.schedule_minutes * 60)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, clock.factor)
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
    started, trained_tokens = run.elapsed(), 0
    autocast = torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16")

    def score_holdout() -> dict[str, Any]:
        with autocast:
            held = heldout_accuracy(draft, target, records, held_out, features, tokenizer.pad_token_id, gamma)
        return holdout_point(held)

    if cfg.init_from and held_out and not run.state["curve"]:
        # Step 0: the source draft on this run's held-out records, the mark the continued draft has to beat.
        run.record(score_holdout())
    while not run.finished and not clock.over(run.elapsed()):
        index = [training[i] for i in torch.randint(0, len(training), (cfg.batch_size,), generator=generator).tolist()]
        tokens, lengths, starts = collate([records[i] for i in index], tokenizer.pad_token_id)
        count: int | torch.Tensor = cfg.anchors_per_sequence
        if cfg.anchor_coverage:
            count = coverage_counts(lengths, starts, cfg.block_size, cfg.anchor_coverage, cfg.anchors_per_sequence)
        anchors, valid = sample_anchors(lengths, starts, count, generator)
        batch_tokens = int((lengths - starts).sum())  # before the move: no device sync for a count
        tokens, lengths, anchors, valid = (t.to(cfg.device) for t in (tokens, lengths, anchors, valid))
        inputs = features(index, tokens)
        with autocast:
            out = dflash_loss(
                draft,
                target,
                tokens,
                inputs.features,
                lengths,
                anchors,
                valid,
                gamma,
                inputs.teacher,
                cfg.distill_weight,
            )
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        correct += out.correct.cpu()
        counted += out.counted.cpu()
        trained_tokens += batch_tokens
        accuracy = correct / counted.clamp(min=1)
        run.advance(loss=f"{out.loss.item():.3f}", acc1=f"{accuracy[0]:.2f}", tau=f"{expected_tau(accuracy):.2f}")
        clock.seconds = run.elapsed()
        if run.due() or clock.over(clock.seconds):
            point = {
                "loss": out.loss.item(),
                "accuracy_per_position": [round(a, 4) for a in accuracy.tolist()],
                "expected_tau": expected_tau(accuracy),
                "response_tokens_per_second": round(trained_tokens / max(1e-9, run.elapsed() - started), 1),
            }
            if held_out:
                point.update(score_holdout())
            run.record(point)
            correct.zero_()
            counted.zero_()
        if run.out_of_time():
            # The draft so far, usable at once (training.json says "finished": false); the checkpoint resumes it.
            partial = {"finished": False, "steps": steps, **run.state}
            written = draft if scale is None else folded(draft, scale)
            return write_draft(written, cfg, partial, target.vocab_size, [records[i] for i in training])
    run.close()
    finished = {"finished": True, "steps": steps, **run.state}
    written = draft if scale is None else folded(draft, scale)
    return write_draft(written, cfg, finished, target.vocab_size, [records[i] for i in training])


class TrainingClock:
    """The learning-rate factor by step, or by training time when a schedule
    length in seconds is given (``seconds`` is set from the run each step; the
    schedule then ends the run)."""

    def __init__(self, steps: int, warmup_ratio: float, schedule_s: float) -> None:
        self.steps, self.schedule_s, self.seconds = steps, schedule_s, 0.0
        self.warmup = max(1, int(warmup_ratio * steps))
        self.warmup_permille = max(1, int(1000 * warmup_ratio))

    def factor(self, step: int) -> float:
        """What ``LambdaLR`` multiplies the learning rate by at ``step``."""
        if not self.schedule_s:
            return warmup_cosine(step, self.steps, self.warmup)
        # Per-mille of the time schedule, so the step-based curve serves both.
        return warmup_cosine(int(1000 * self.seconds / self.schedule_s), 1000, self.warmup_permille)

    def over(self, seconds: float) -> bool:
        """True once a time schedule has run its length."""
        return bool(self.schedule_s) and seconds >= self.schedule_s


def write_draft(
    draft: DFlashDraftModel,
    cfg: DraftTrainConfig,
    summary: dict[str, Any],
    vocab_size: int,
    records: list[tuple[list[int], int]],
) -> dict[str, Any]:
    """Save ``draft`` to ``cfg.out_dir`` in the official format with its
    ``training.json`` (the run summary, the config and, with a draft
    vocabulary, the share of the training ``records``' response tokens it
    covers); returns the summary."""
    draft.eval()
    save_draft(draft, cfg.out_dir, dtype=DTYPES[cfg.save_dtype])
    config = {k: " ".join(map(str, v)) if isinstance(v, tuple) else str(v) for k, v in asdict(cfg).items()}
    summary = {**summary, "config": config}
    if draft.draft_vocab_ids is not None:
        coverage = token_coverage(response_tokens(records), draft.draft_vocab_ids, vocab_size=vocab_size)
        summary["draft_vocab"] = {"size": draft.draft_vocab_ids.numel(), "response_token_coverage": round(coverage, 4)}
    (cfg.out_dir / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def mask_token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    """The id of ``token`` exactly as the vocabulary spells it. (The tokenizer's
    own lookup returns the unknown token's id for a missing entry, which
    would silently train every MASK slot as that token.)"""
    vocab = tokenizer.get_vocab()
    if token not in vocab:
        special = ", ".join(str(t) for t in tokenizer.added_tokens_decoder.values())
        raise ValueError(
            f"mask token {token!r} is not in the target's vocabulary: pick one of its unused special "
            f"tokens with --mask-token ({special})"
        )
    return vocab[token]


@dataclass(frozen=True)
class TargetInputs:
    """What the target gives a batch: its features [B, S, n*H] and, when
    distilling, its top-k next-token ids and log-probabilities [B, S, k]."""

    features: torch.Tensor
    teacher: tuple[torch.Tensor, torch.Tensor] | None = None


Features = Callable[[list[int], torch.Tensor], TargetInputs]
"""(record indices, their collated tokens [B, S]) -> the target's inputs to the draft's loss."""


def feature_source(
    target: TargetModel, records: list[tuple[list[int], int]], draft: DFlashDraftModel, cfg: DraftTrainConfig
) -> Features | None:
    """Where a batch's target features come from: the feature store (built or
    finished first; None while its build is still out of time) or a target
    forward per batch."""
    layers = draft.config.target_layer_ids
    top_k = cfg.distill_top_k if cfg.distill_weight > 0 else 0
    if not cfg.feature_store:

        def forward(_: list[int], tokens: torch.Tensor) -> TargetInputs:
            out = target.forward_sequences(tokens.to(target.device), feature_layers=layers, logits=top_k > 0)
            assert out.features is not None  # the forward captured the draft's layers
            if not top_k:
                return TargetInputs(out.features)
            return TargetInputs(out.features, teacher_top(out.logits, top_k))

        return forward
    stored = tuple(int(x) for x in cfg.feature_layers.split(",")) if cfg.feature_layers else layers
    store = build_feature_store(
        target,
        records,
        stored,
        Path(cfg.feature_store),
        time_limit_s=cfg.time_limit_minutes * 60,
        teacher_top_k=cfg.distill_top_k,
    )
    if store is None:
        return None

    def read(index: list[int], tokens: torch.Tensor) -> TargetInputs:
        batch_features = store.batch(index, tokens.shape[1], layers).to(target.device)
        if not top_k:
            return TargetInputs(batch_features)
        ids, logprobs = (t[..., :top_k].to(target.device) for t in store.teacher_batch(index, tokens.shape[1]))
        return TargetInputs(batch_features, (ids, logprobs))

    return read


@torch.no_grad()
def heldout_accuracy(
    draft: DFlashDraftModel,
    target: TargetModel,
    records: list[tuple[list[int], int]],
    held_out: list[int],
    features: Features,
    pad_id: int,
    gamma: float,
    anchors_per_record: int = 128,
) -> torch.Tensor:
    """Teacher-forced accuracy per block slot on the held-out records: up to
    ``anchors_per_record`` anchors each, drawn with a fixed seed so every
    checkpoint is judged on the same blocks."""
    generator = torch.Generator().manual_seed(0)
    correct = torch.zeros(draft.block_size - 1)
    counted = torch.zeros(draft.block_size - 1)
    was_training = draft.training
    draft.eval()
    for i in held_out:
        tokens, lengths, starts = collate([records[i]], pad_id)
        anchors, valid = sample_anchors(lengths, starts, anchors_per_record, generator)
        tokens, lengths, anchors, valid = (t.to(target.device) for t in (tokens, lengths, anchors, valid))
        out = dflash_loss(draft, target, tokens, features([i], tokens).features, lengths, anchors, valid, gamma)
        correct += out.correct.cpu()
        counted += out.counted.cpu()
    draft.train(was_training)
    return correct / counted.clamp(min=1)


def holdout_point(held: torch.Tensor) -> dict[str, Any]:
    """The held-out entries of a curve point, from ``heldout_accuracy``: slot accuracies and the tau they imply."""
    return {
        "holdout_accuracy_per_position": [round(a, 4) for a in held.tolist()],
        "holdout_expected_tau": expected_tau(held),
    }


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
        for layer in draft.draft_layers()[len(source.layers) :]:
            for projection in (layer.self_attn.o_proj, layer.mlp.down_proj):
                projection.weight.zero_()
                if projection.bias is not None:
                    projection.bias.zero_()


def expected_tau(accuracy: torch.Tensor) -> float:
    """Acceptance length implied by per-position accuracies under greedy
    verification, treating them as acceptance rates: 1 + sum_k prod_{j<=k} acc_j."""
    return 1.0 + float(torch.cumprod(accuracy, dim=0).sum())
