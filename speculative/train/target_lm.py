"""Train the bundled target: a small Qwen3 language model, from scratch, on the
standard-library corpus (whole files plus function-completion chat pairs).

Resumable: every ``checkpoint_every`` steps and at the time limit the run
directory gets ``checkpoint.pt`` (model, optimizer, scheduler, RNG, step); a
rerun with the same arguments continues from it. The finished model is written
in transformers format (safetensors, bf16 to stay small) with its tokenizer.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from speculative.train.corpus import Corpus, function_pairs
from speculative.train.loop import ResumableRun, warmup_cosine
from speculative.train.tokenizer import END_OF_TEXT, chat_text, save_tokenizer, train_tokenizer


@dataclass(frozen=True)
class TargetTrainConfig:
    """Target LM training settings (sizes in tokens unless stated). ``tokenizer``:
    a directory whose tokenizer to reuse instead of training one (an assistant
    model for assisted generation must share the target's tokenizer).
    ``init_from``: a model directory whose weights start the run (to continue
    training a committed model; the optimizer starts fresh)."""

    out_dir: Path
    run_dir: Path
    vocab_size: int = 8192
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 6
    num_kv_heads: int = 2
    intermediate_size: int = 1024
    context_length: int = 1024
    seq_len: int = 512
    batch_size: int = 8
    steps: int = 1200
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    validation_fraction: float = 0.02
    checkpoint_every: int = 100
    time_limit_minutes: float = 0.0
    seed: int = 0
    tokenizer: str = ""
    init_from: str = ""


def model_config(cfg: TargetTrainConfig, tokenizer: PreTrainedTokenizerFast) -> Qwen3Config:
    """The target architecture: Qwen3 with tied embeddings (smaller checkpoint)."""
    return Qwen3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.context_length,
        rope_theta=10000.0,  # type: ignore[call-arg]  # a legacy kwarg transformers' configs still take
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(tokenizer.eos_token),
        pad_token_id=tokenizer.pad_token_id,
    )


def prepare_tokens(
    cfg: TargetTrainConfig, corpus: Corpus
) -> tuple[PreTrainedTokenizerFast, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Train (or reload) the tokenizer and tokenize the corpus once into the run
    directory: files and chat pairs, shuffled, joined by end-of-text; a fraction
    of the documents is held out for validation."""
    cache = cfg.run_dir / "tokens.pt"
    tokenizer_dir = cfg.run_dir / "tokenizer"
    if cache.exists() and tokenizer_dir.exists():
        data = torch.load(cache)
        return PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir)), data["train"], data["valid"], data["info"]
    texts = list(corpus.texts())
    documents = texts + [chat_text(p.prompt, p.response) for t in texts for p in function_pairs(t)]
    random.Random(cfg.seed).shuffle(documents)
    if cfg.tokenizer:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(cfg.tokenizer, local_files_only=True)
    else:
        tokenizer = train_tokenizer(texts, cfg.vocab_size)
    save_tokenizer(tokenizer, tokenizer_dir)
    eot = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    encoded = tokenizer(documents, add_special_tokens=False)["input_ids"]
    n_valid = max(1, int(len(encoded) * cfg.validation_fraction))

    def join(docs: list[list[int]]) -> torch.Tensor:
        return torch.tensor([t for d in docs for t in [*d, eot]], dtype=torch.int32)

    valid, train = join(encoded[:n_valid]), join(encoded[n_valid:])
    info = {
        "corpus": str(corpus.root),
        "corpus_sha256": corpus.fingerprint(),
        "files": len(texts),
        "chat_pairs": len(documents) - len(texts),
        "train_tokens": len(train),
        "valid_tokens": len(valid),
    }
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"train": train, "valid": valid, "info": info}, cache)
    return tokenizer, train, valid, info


def sample_batch(tokens: torch.Tensor, cfg: TargetTrainConfig, generator: torch.Generator) -> torch.Tensor:
    """Random windows of ``seq_len + 1`` tokens (transformers shifts the labels)."""
    starts = torch.randint(0, len(tokens) - cfg.seq_len - 1, (cfg.batch_size,), generator=generator)
    return torch.stack([tokens[s : s + cfg.seq_len + 1] for s in starts.tolist()]).long()


@torch.no_grad()
def validation_loss(model: Qwen3ForCausalLM, valid: torch.Tensor, cfg: TargetTrainConfig, batches: int = 8) -> float:
    """Mean next-token loss over fixed validation windows."""
    model.eval()  # type: ignore[no-untyped-call]  # transformers' PreTrainedModel.eval is unannotated
    generator = torch.Generator().manual_seed(1234)
    losses: list[float] = []
    for _ in range(batches):
        batch = sample_batch(valid, cfg, generator)
        losses.append(model(batch, labels=batch).loss.item())
    model.train()
    return sum(losses) / len(losses)


def train_target(cfg: TargetTrainConfig, corpus: Corpus | None = None) -> dict[str, Any]:
    """Train (or resume) the target; write the final model when all steps are done.
    Returns the run summary (also written as ``training.json`` beside the model)."""
    corpus = corpus or Corpus.stdlib()
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, train, valid, info = prepare_tokens(cfg, corpus)
    torch.manual_seed(cfg.seed)
    # transformers' float() is unannotated.
    model: Qwen3ForCausalLM = Qwen3ForCausalLM(model_config(cfg, tokenizer)).float().train()  # type: ignore[no-untyped-call]
    if cfg.init_from:
        start = Qwen3ForCausalLM.from_pretrained(cfg.init_from, local_files_only=True, dtype=torch.float32)
        model.load_state_dict(start.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, cfg.steps, cfg.warmup_steps, cfg.min_lr_ratio)
    )
    generator = torch.Generator().manual_seed(cfg.seed)
    run = ResumableRun(
        cfg.run_dir / "checkpoint.pt",
        {"model": model, "optimizer": optimizer, "scheduler": scheduler},
        generator,
        total_steps=cfg.steps,
        checkpoint_every=cfg.checkpoint_every,
        time_limit_minutes=cfg.time_limit_minutes,
        name="target",
    )
    while not run.finished:
        batch = sample_batch(train, cfg, generator)
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        run.advance(loss=f"{loss.item():.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
        if run.due():
            run.record({"train_loss": loss.item(), "valid_loss": validation_loss(model, valid, cfg)})
        if run.out_of_time():
            return {"finished": False, **run.state}
    run.close()
    summary = {"finished": True, "config": {k: str(v) for k, v in asdict(cfg).items()}, "data": info, **run.state}
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    # functools.wraps types PreTrainedModel.to with its unbound ``self`` as the first argument.
    model.to(torch.bfloat16).save_pretrained(str(cfg.out_dir), safe_serialization=True)  # type: ignore[arg-type]
    save_tokenizer(tokenizer, cfg.out_dir)
    (cfg.out_dir / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
