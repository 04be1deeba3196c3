"""``dflash-train``: reproducible training commands with fixed seeds.

dflash-train target --out models/pycoder-12m                  # the bundled target LM
dflash-train data --target models/pycoder-12m --out runs/data # target-regenerated responses
dflash-train prompts --limit 20000 --seed 4 --out runs/prompts.jsonl  # the mixed set, to regenerate elsewhere
dflash-train prompts --written-by DIR --limit 20000 --out runs/own.jsonl  # prompts the target writes itself
dflash-train data --target DIR --prompts-file runs/prompts.jsonl --backend generate --device cuda --out runs/gpu
dflash-train draft --target models/pycoder-12m --data runs/data.jsonl --out models/pycoder-12m-dflash-b16
dflash-train assistant --target models/smollm2-135m-instruct --data runs/data.jsonl --out runs/assistant-2l
dflash-train ngram-table --data runs/data.jsonl --draft models/smollm2-135m-instruct-dflash  # lookup's corpus table
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from speculative.cliflags import add_dataclass_flags, dataclass_kwargs
from speculative.ngram_table import DEFAULT_MIN_COUNT, DEFAULT_SIZES
from speculative.train.assistant import AssistantTrainConfig, train_assistant
from speculative.train.corpus import Corpus, function_pairs, request_prompts
from speculative.train.draft_train import DraftTrainConfig, train_draft
from speculative.train.lookup_table import build_draft_table
from speculative.train.model_card import write_card
from speculative.train.prompt_writer import WriterConfig, write_own_prompts
from speculative.train.prompts import Prompt, build_prompts, provenance
from speculative.train.regenerate import RegenerateConfig, regenerate_chat_prompts
from speculative.train.target_lm import TargetTrainConfig, train_target

PATH_FIELDS = {"out_dir", "run_dir", "target_dir", "data"}
LM_CARD = (
    "A small Qwen3 language model trained from scratch on the Python standard library's sources "
    "(PSF licence) and function-completion chat pairs made from them; ChatML chat template. "
)
TARGET_CARD = LM_CARD + "The bundled target of dflash-serve."
ASSISTANT_CARD = LM_CARD + (
    "It shares the tokenizer of {tokenizer}: an autoregressive assistant for the assisted-generation "
    "peer of dflash-bench, not a target."
)
CUT_ASSISTANT_CARD = (
    "The first layers of the target named in the command below, with its final norm and tied embeddings "
    "(frozen), fine-tuned on its regenerated responses: an autoregressive assistant with the target's "
    "tokenizer for the assisted-generation peer of dflash-bench, not a target. Stored without the target's "
    "embeddings: load it with `speculative.assistant.load_assistant(directory, target)` "
    "(dflash-bench --assistant does)."
)
DRAFT_CARD = (
    "A DFlash draft (official checkpoint format) for the bundled target, trained on the target's own "
    "regenerated responses with the DFlash objective."
)


def lm_card(cfg: TargetTrainConfig) -> str:
    """What a trained LM is: a model started fresh on another model's tokenizer is
    an assistant; everything else (new tokenizer, or continued training) a target."""
    if cfg.tokenizer and not cfg.init_from:
        return ASSISTANT_CARD.format(tokenizer=cfg.tokenizer)
    return TARGET_CARD


PROMPT_FAMILIES: dict[str, tuple[str, Callable[[str], list[str]]]] = {
    "functions": ("stdlib function prompts", lambda text: [pair.prompt for pair in function_pairs(text)]),
    "requests": ("stdlib docstring requests", request_prompts),
}
"""``dflash-train data --prompts``: name -> (provenance label, prompts of one source file)."""
MIXED = "mixed"
"""``--prompts mixed``: the decontaminated multi-family set of ``speculative.train.prompts``."""


def corpus_prompts(family: str, limit: int, seed: int) -> list[Prompt]:
    """Distinct prompts with their sources, the same for the same seed: the mixed
    set, or one corpus family shuffled with ``seed``."""
    if family == MIXED:
        return build_prompts(limit, seed)
    label, extract = PROMPT_FAMILIES[family]
    texts = list(dict.fromkeys(prompt for text in Corpus.stdlib().texts() for prompt in extract(text)))
    random.Random(seed).shuffle(texts)
    return [Prompt(text, label) for text in (texts[:limit] if limit else texts)]


def write_prompts(path: Path, prompts: list[Prompt], made: dict[str, object]) -> None:
    """Prompts as JSON lines (``text``, ``source``) with their provenance in
    ``<path>.meta.json``, to be answered wherever the target runs (``data --prompts-file``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": p.text, "source": p.source}) + "\n" for p in prompts))
    path.with_suffix(".meta.json").write_text(json.dumps(made, indent=2) + "\n")


def read_prompts(path: Path) -> tuple[list[Prompt], dict[str, object] | None]:
    """Prompts written by ``write_prompts`` and their provenance (None without a meta file)."""
    prompts = [Prompt(r["text"], r["source"]) for r in map(json.loads, path.read_text().splitlines())]
    meta = path.with_suffix(".meta.json")
    return prompts, json.loads(meta.read_text()) if meta.is_file() else None


def prompt_set(args: dict[str, Any]) -> tuple[list[Prompt], dict[str, object]]:
    """``dflash-train prompts``' set and its provenance: written by the target
    (``--written-by``) or the mixed templated set."""
    if args["written_by"]:
        writer = WriterConfig(**dataclass_kwargs(args, WriterConfig))
        return write_own_prompts(args["written_by"], args["limit"], args["seed"], writer)
    prompts = build_prompts(args["limit"], args["seed"])
    return prompts, provenance(prompts, args["seed"])


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(
        prog="dflash-train", description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    target = commands.add_parser("target", help="train the bundled target LM from scratch")
    target.add_argument("--out", type=Path, required=True, help="final model directory")
    target.add_argument("--run-dir", type=Path, default=Path("runs/target"), help="checkpoints and token cache")
    add_dataclass_flags(target, TargetTrainConfig, PATH_FIELDS)

    data = commands.add_parser("data", help="regenerate responses to corpus prompts with the target")
    data.add_argument("--target", type=Path, required=True, help="target model directory")
    data.add_argument("--out", type=Path, required=True, help="output path without suffix (.jsonl, .meta.json)")
    data.add_argument("--limit", type=int, default=0, help="number of prompts (0: all)")
    data.add_argument(
        "--prompts",
        choices=sorted([*PROMPT_FAMILIES, MIXED]),
        default="functions",
        help="functions: a signature and docstring to complete; requests: a docstring's summary as an English "
        "request; mixed: code, math, chat, writing and explanations, decontaminated against the benchmarks",
    )
    data.add_argument(
        "--prompts-file", type=Path, help="answer the prompts of this file (`dflash-train prompts`) instead"
    )
    data.add_argument("--time-limit-minutes", type=float, default=0.0, help="stop resumably after this long")

    prompts = commands.add_parser(
        "prompts", help="write the mixed prompt set, or prompts the target writes itself, to a file"
    )
    prompts.add_argument("--out", type=Path, required=True, help="prompts .jsonl (provenance beside it)")
    prompts.add_argument("--limit", type=int, default=0, help="number of prompts (0: all; with --written-by: asked)")
    prompts.add_argument("--seed", type=int, default=0, help="which prompts and their order")
    prompts.add_argument(
        "--written-by",
        type=Path,
        help="this target model directory writes the prompts (user turns sampled from its chat template)",
    )
    add_dataclass_flags(prompts, WriterConfig)
    add_dataclass_flags(data, RegenerateConfig, PATH_FIELDS)

    for name, purpose, out, config in (
        ("draft", "train a DFlash draft on regenerated data", "draft directory (official format)", DraftTrainConfig),
        (
            "assistant",
            "cut an assisted-generation assistant from a pretrained target",
            "assistant directory (transformers format)",
            AssistantTrainConfig,
        ),
    ):
        trainer = commands.add_parser(name, help=purpose)
        trainer.add_argument("--target", type=Path, required=True, help="target model directory")
        trainer.add_argument("--data", type=Path, nargs="+", required=True, help="regenerated .jsonl files")
        trainer.add_argument("--out", type=Path, required=True, help=out)
        trainer.add_argument("--run-dir", type=Path, default=Path(f"runs/{name}"), help="checkpoints")
        add_dataclass_flags(trainer, config, PATH_FIELDS)

    table = commands.add_parser(
        "ngram-table", help="count regenerated answers into the draft's n-gram table for lookup paths"
    )
    table.add_argument("--data", type=Path, nargs="+", required=True, help="regenerated .jsonl files")
    table.add_argument("--draft", type=Path, required=True, help="draft directory: the table is written into it")
    table.add_argument(
        "--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="context lengths in tokens (at most 4)"
    )
    table.add_argument(
        "--min-count", type=int, default=DEFAULT_MIN_COUNT, help="times the kept token must have followed its context"
    )

    argv = sys.argv[1:] if argv is None else argv
    args = vars(parser.parse_args(argv))
    command = args.pop("command")
    if command == "ngram-table":
        print(json.dumps(build_draft_table(args["data"], args["draft"], args["sizes"], args["min_count"])))
        return
    if command == "prompts":
        if args["written_by"] and not args["limit"]:
            parser.error("prompts --written-by needs --limit (how many prompts to ask the target for)")
        written, about = prompt_set(args)
        write_prompts(args["out"], written, about)
        print(json.dumps({"prompts": str(args["out"]), "count": len(written)}))
        return
    cfg: TargetTrainConfig | RegenerateConfig | DraftTrainConfig | AssistantTrainConfig
    if command == "target":
        cfg = TargetTrainConfig(
            out_dir=args["out"], run_dir=args["run_dir"], **dataclass_kwargs(args, TargetTrainConfig, PATH_FIELDS)
        )
        summary = train_target(cfg)
        if summary["finished"]:
            write_card(cfg.out_dir, cfg.out_dir.name, lm_card(cfg), "dflash-train " + " ".join(argv))
    elif command == "data":
        cfg = RegenerateConfig(**dataclass_kwargs(args, RegenerateConfig, PATH_FIELDS))
        if args["prompts_file"]:
            chosen, made = read_prompts(args["prompts_file"])
            chosen = chosen[: args["limit"]] if args["limit"] else chosen
        else:
            chosen = corpus_prompts(args["prompts"], args["limit"], cfg.seed)
            made = provenance(chosen, cfg.seed) if args["prompts"] == MIXED else None
        summary = regenerate_chat_prompts(
            args["target"],
            [p.text for p in chosen],
            args["out"],
            cfg,
            source=[p.source for p in chosen],
            time_limit_minutes=args["time_limit_minutes"],
            provenance=made,
        )
    else:
        paths = dict(target_dir=args["target"], data=tuple(args["data"]), out_dir=args["out"], run_dir=args["run_dir"])
        if command == "assistant":
            cfg = AssistantTrainConfig(**paths, **dataclass_kwargs(args, AssistantTrainConfig, PATH_FIELDS))
            summary, card = train_assistant(cfg), CUT_ASSISTANT_CARD
        else:
            cfg = DraftTrainConfig(**paths, **dataclass_kwargs(args, DraftTrainConfig, PATH_FIELDS))
            summary, card = train_draft(cfg), DRAFT_CARD
        if summary["finished"]:
            write_card(cfg.out_dir, cfg.out_dir.name, card, "dflash-train " + " ".join(argv))
    print(json.dumps({k: v for k, v in summary.items() if k != "curve"}))


if __name__ == "__main__":
    main()
