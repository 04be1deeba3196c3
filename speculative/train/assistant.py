"""Train an autoregressive assistant for a pretrained target: the peer that
transformers' assisted generation (``assistant_model``) needs in dflash-bench.

A pretrained target rarely ships a smaller sibling with its tokenizer (SmolLM2's
smallest is the default target itself), so the assistant is cut from the
target: its first ``num_layers`` decoder layers, its final norm and its tied
embeddings, the layers and norm then fine-tuned on the target's own regenerated
responses (the same records a DFlash draft trains on; loss on response tokens
only). The embeddings stay frozen: they are most of the parameters and the
LM head shares them. With as many layers as the DFlash draft, it costs about
what the draft costs per proposed token; unlike the draft it proposes one
token per forward.

Resumable like the other trainers (``loop.ResumableRun``); the finished model
is written without the target's embeddings (``speculative.assistant``: a
transformers config and every other tensor in bf16). Held-out
records (``draft_train.held_out_records``) give its top-1 agreement with the
target's tokens (what greedy assisted generation accepts) and its loss at each
checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from speculative.assistant import save_assistant
from speculative.precision import DTYPES
from speculative.train.draft_train import collate, load_records, split_records
from speculative.train.loop import ResumableRun, warmup_cosine

Record = tuple[list[int], int]


@dataclass(frozen=True)
class AssistantTrainConfig:
    """Assistant training settings. ``holdout``: records kept out of training
    for the agreement figure. ``dtype`` bfloat16: autocast (where the CPU has
    native bf16); the weights train in fp32."""

    target_dir: Path
    data: tuple[Path, ...]
    out_dir: Path
    run_dir: Path
    num_layers: int = 2
    steps: int = 300
    batch_size: int = 8
    max_length: int = 1024
    lr: float = 3e-4
    warmup_steps: int = 20
    holdout: int = 64
    checkpoint_every: int = 50
    time_limit_minutes: float = 0.0
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.steps < 1 or self.batch_size < 1:
            raise ValueError("num_layers, steps and batch_size must be >= 1")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")


def truncated_target(target_dir: Path, num_layers: int) -> PreTrainedModel:
    """The target with only its first ``num_layers`` decoder layers (fp32), its
    embeddings frozen; the rest of its weights as they were."""
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        str(target_dir), local_files_only=True, dtype=torch.float32
    )
    layers = model.model.layers
    if num_layers >= len(layers):
        raise ValueError(f"the assistant needs fewer layers than the target's {len(layers)}, got {num_layers}")
    model.model.layers = torch.nn.ModuleList(list(layers)[:num_layers])
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    model.get_input_embeddings().weight.requires_grad_(False)
    return model


def batch_inputs(records: Sequence[Record], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded tokens, their attention mask, and labels: the response
    tokens (prompt and padding -100; the model shifts them)."""
    tokens, lengths, starts = collate(list(records), pad_id)
    positions = torch.arange(tokens.shape[1])
    mask = positions < lengths[:, None]
    labels = tokens.masked_fill(~mask | (positions < starts[:, None]), -100)
    return tokens, mask.long(), labels


@torch.no_grad()
def held_out_scores(
    model: PreTrainedModel, records: Sequence[Record], pad_id: int, batch_size: int
) -> dict[str, float]:
    """Over held-out response tokens (teacher-forced): the share the model's
    argmax predicts (``holdout_agreement``) and the mean loss (``holdout_loss``)."""
    model.eval()  # type: ignore[no-untyped-call]  # transformers' PreTrainedModel.eval is unannotated
    right = total = 0
    loss = 0.0
    for first in range(0, len(records), batch_size):
        tokens, mask, labels = batch_inputs(records[first : first + batch_size], pad_id)
        logits = model(input_ids=tokens, attention_mask=mask).logits[:, :-1].float()
        wanted = labels[:, 1:]
        counted = wanted != -100
        right += int((logits.argmax(-1) == wanted)[counted].sum())
        loss += float(torch.nn.functional.cross_entropy(logits[counted], wanted[counted], reduction="sum"))
        total += int(counted.sum())
    model.train()
    return {"holdout_agreement": right / max(total, 1), "holdout_loss": loss / max(total, 1)}


def train_assistant(cfg: AssistantTrainConfig) -> dict[str, Any]:
    """Train (or resume) the assistant; write it when all steps are done.
    Returns the run summary (also ``training.json`` beside the model)."""
    tokenizer = AutoTokenizer.from_pretrained(str(cfg.target_dir), local_files_only=True)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    records = load_records(cfg.data, cfg.max_length)
    training, held_out = split_records(records, cfg.holdout, cfg.seed)
    train, holdout = [records[i] for i in training], [records[i] for i in held_out]
    torch.manual_seed(cfg.seed)
    model = truncated_target(cfg.target_dir, cfg.num_layers).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, cfg.steps, cfg.warmup_steps, 0.1)
    )
    generator = torch.Generator().manual_seed(cfg.seed)
    run = ResumableRun(
        cfg.run_dir / "checkpoint.pt",
        {"model": model, "optimizer": optimizer, "scheduler": scheduler},
        generator,
        total_steps=cfg.steps,
        checkpoint_every=cfg.checkpoint_every,
        time_limit_minutes=cfg.time_limit_minutes,
        name="assistant",
    )
    if run.step == 0:
        run.state["curve"].append({"step": 0, **held_out_scores(model, holdout, pad_id, cfg.batch_size)})
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16")
    while not run.finished:
        picks = torch.randint(0, len(train), (cfg.batch_size,), generator=generator).tolist()
        tokens, mask, labels = batch_inputs([train[i] for i in picks], pad_id)
        with autocast:
            loss = model(input_ids=tokens, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        scheduler.step()
        run.advance(loss=f"{loss.item():.3f}")
        if run.due():
            with autocast:
                scores = held_out_scores(model, holdout, pad_id, cfg.batch_size)
            run.record({"train_loss": loss.item(), **scores})
        if run.out_of_time():
            return {"finished": False, **run.state}
    run.close()
    data = {
        "records": len(train),
        "held_out_records": len(holdout),
        "response_tokens": sum(len(t) - s for t, s in train),
        "files": ", ".join(map(str, cfg.data)),
    }
    summary = {"finished": True, "config": {k: str(v) for k, v in asdict(cfg).items()}, "data": data, **run.state}
    save_assistant(model, cfg.out_dir)
    (cfg.out_dir / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
