"""Speculative-generation demo: DFlash against plain decoding, side by side.

With ``--target`` and ``--draft`` it runs a local transformers target and a local
DFlash checkpoint on text prompts; without them it runs the default pair
(``speculative.bundled``) when it is installed. Failing both, it builds a small random-weight Qwen3
target, trains a DFlash draft on the target's own greedy outputs for a minute,
and decodes trained-on and held-out prompts. Either way it checks that greedy DFlash output equals plain
decoding token for token, and prints acceptance length and speed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from speculative.bundled import DEFAULT_DRAFT, DEFAULT_TARGET
from speculative.chat import user_prompt_ids
from speculative.checkpoint import load_draft
from speculative.config import DFlashConfig
from speculative.decode import DecodeConfig, GenerationResult, spec_generate
from speculative.distill import distill_draft
from speculative.draft import DFlashDraftModel
from speculative.sampling import SamplingParams
from speculative.target import TargetModel

DEMO_VOCAB = 512
DEFAULT_PROMPTS = (
    'Complete this Python function:\ndef fibonacci(n):\n    """Return the n-th Fibonacci number."""',
    'Complete this Python function:\ndef is_palindrome(text):\n    """Return True if text reads the same backwards."""',
    'Complete this Python function:\ndef read_config(path):\n    """Read a JSON config file into a dict."""',
    'Complete this Python function:\ndef flatten(items):\n    """Flatten a list of lists into one list."""',
)


def build_demo_pair(seed: int, train_steps: int) -> tuple[TargetModel, DFlashDraftModel, dict[str, list[list[int]]]]:
    """A random 6-layer Qwen3 target, a 1-layer draft distilled on its greedy
    outputs, and two prompt sets: some the draft was trained on, some held out.

    A random target has no structure a draft could learn beyond what it saw, so
    only the trained-on prompts show high acceptance; the trained bundled pair
    (a later milestone) is what measures real, held-out acceptance."""
    torch.manual_seed(seed)
    arch: dict[str, Any] = dict(
        vocab_size=DEMO_VOCAB,
        hidden_size=256,
        intermediate_size=768,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=1024,
        rope_theta=10000.0,
    )
    model = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=6, tie_word_embeddings=False, **arch))
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # random weights give near-flat logits otherwise
    target = TargetModel(model.eval())  # type: ignore[no-untyped-call]  # transformers' eval is unannotated
    draft_raw = dict(
        arch,
        model_type="qwen3",
        num_hidden_layers=1,
        num_target_layers=6,
        block_size=16,
        dflash_config={"mask_token_id": DEMO_VOCAB - 1, "target_layer_ids": [1, 3]},
    )
    draft = DFlashDraftModel(DFlashConfig.from_dict(draft_raw))
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, DEMO_VOCAB - 1, (520, 8), generator=g).tolist()
    train, held_out = prompts[:512], prompts[512:]
    data = spec_generate(target, None, train, DecodeConfig(block_size=1, max_new_tokens=64))
    sequences = torch.tensor([p + o for p, o in zip(train, data.tokens, strict=True)])
    losses = distill_draft(draft, target, sequences, 8, steps=train_steps)
    print(f"draft distilled: {train_steps} steps, loss {losses[0]:.2f} -> {losses[-1]:.2f}")
    return target, draft, {"trained-on prompts": train[:8], "held-out prompts": held_out}


def load_pair(
    target_path: Path, draft_path: Path, prompts: list[str]
) -> tuple[TargetModel, DFlashDraftModel, dict[str, list[list[int]]]]:
    """Load a local target (with its tokenizer) and draft; tokenize the prompts,
    through the chat template when the tokenizer has one."""
    tokenizer = AutoTokenizer.from_pretrained(target_path, local_files_only=True)
    if tokenizer.chat_template:
        ids = user_prompt_ids(tokenizer, prompts)
    else:
        ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    return TargetModel.from_pretrained(target_path), load_draft(draft_path), {"prompts": ids}


def run(
    target: TargetModel, draft: DFlashDraftModel, prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, Any]:
    """Decode ``prompts`` at batch 1 with plain decoding and each block size;
    print a table and return the figures."""
    rows = []
    sampling = SamplingParams(repetition_penalty=args.repetition_penalty)
    baseline = _timed(target, None, prompts, DecodeConfig(block_size=1, max_new_tokens=args.max_new_tokens), sampling)
    base_tps = _tokens(baseline[0]) / baseline[1]
    print(f"{'block':>5} {'tau':>6} {'tok/s':>8} {'speedup':>8} {'lossless':>9}")
    print(f"{1:>5} {1.0:>6.2f} {base_tps:>8.1f} {1.0:>7.2f}x {'-':>9}")
    for b in args.block_sizes or [b for b in (2, 3, 4, 8, 16) if b <= draft.block_size]:
        config = DecodeConfig(block_size=b, max_new_tokens=args.max_new_tokens)
        result, seconds = _timed(target, draft, prompts, config, sampling)
        tps = _tokens(result) / seconds
        lossless = result.tokens == baseline[0].tokens
        rows.append(
            {
                "block_size": b,
                "tau": result.mean_acceptance_length,
                "tokens_per_s": tps,
                "speedup": tps / base_tps,
                "lossless": lossless,
            }
        )
        print(f"{b:>5} {result.mean_acceptance_length:>6.2f} {tps:>8.1f} {tps / base_tps:>7.2f}x {lossless!s:>9}")
    return {"baseline_tokens_per_s": base_tps, "results": rows}


def _timed(
    target: TargetModel,
    draft: DFlashDraftModel | None,
    prompts: list[list[int]],
    config: DecodeConfig,
    sampling: SamplingParams,
) -> tuple[GenerationResult, float]:
    start = time.perf_counter()
    result = GenerationResult(tokens=[], finish_reasons=[])
    for prompt in prompts:  # batch 1, as the paper's latency numbers
        one = spec_generate(target, draft, [prompt], config, sampling)
        result.tokens += one.tokens
        result.rounds += one.rounds
    return result, time.perf_counter() - start


def _tokens(result: GenerationResult) -> int:
    return sum(len(t) for t in result.tokens)


def main(argv: list[str] | None = None) -> None:
    """Command line entry point (`make run`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, help="local transformers target directory")
    parser.add_argument("--draft", type=Path, help="local DFlash draft directory (official format)")
    parser.add_argument("--prompt", action="append", default=[], help="text prompt (with --target); repeatable")
    parser.add_argument(
        "--block-sizes", type=int, nargs="+", default=[], help="default: 2, 3, 4, 8, 16 up to the draft's block"
    )
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--train-steps", type=int, default=300, help="draft distillation steps (built-in pair)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="greedy with this penalty (1: off; a tiny target that loops may need one)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if (args.target is None) != (args.draft is None):
        parser.error("--target and --draft go together")
    if args.target is None and DEFAULT_TARGET.exists() and DEFAULT_DRAFT.exists():
        args.target, args.draft = DEFAULT_TARGET, DEFAULT_DRAFT
    if args.target is not None:
        print(f"target {args.target}, draft {args.draft}")
        target, draft, prompts = load_pair(args.target, args.draft, args.prompt or list(DEFAULT_PROMPTS))
    else:
        target, draft, prompts = build_demo_pair(args.seed, args.train_steps)
    summary = {}
    for label, ids in prompts.items():
        penalty = f", repetition penalty {args.repetition_penalty}" if args.repetition_penalty != 1 else ""
        print(f"\n{label} ({len(ids)}, batch 1, greedy{penalty}, {args.max_new_tokens} new tokens)")
        summary[label] = run(target, draft, ids, args)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
