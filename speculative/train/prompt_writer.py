"""Prompts the target writes itself: users' requests in the target's own words.

A chat model fine-tuned on conversations has learnt what users ask. Given its
chat template up to the start of a user turn (system prompt included) and
nothing else, it samples a user message, which ends where its turn would (the
end-of-turn token). This is the Magpie recipe (Xu et al., 2024, "Magpie:
Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with
Nothing"). SmolLM2-Instruct, tuned on such data, writes varied, realistic
requests this way, where an instruction such as "write a question a user might
ask about X" gets answers instead of questions.

The templated families of ``speculative.train.prompts`` are far from what
people ask a chat model (a draft trained on them reached slot-1 accuracy 0.53 on
their held-out records but 0.31 on MT-Bench answers, docs/LOG.md). Requests
the target writes are, by construction, the ones its fine-tuning made it
expect. To spread them over the kinds of request a chat service sees, each
user turn may start with a short opening of a category (``OPENINGS``: writing,
role-play, reasoning, maths, coding, extraction, science, humanities, and
``open``, the target's own choice); the target writes the rest.

Written prompts are cleaned (``clean_written``), deduplicated and
decontaminated with the same 13-gram rule as the templated families.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence, Set
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from speculative.chat import stop_token_ids
from speculative.target import TargetModel
from speculative.train.prompts import DECONTAMINATION, Prompt, benchmark_ngrams, decontaminate
from speculative.train.regenerate import RegenerateConfig, backend_stream, weights_sha256

OPENINGS: dict[str, tuple[str, ...]] = {
    "open": ("",),
    "writing": ("Write a", "Compose a", "Draft an email", "Write a short story", "Write a poem", "Help me write"),
    "roleplay": ("Imagine you are", "Pretend you are", "Act as a", "You are a", "Let's role-play:"),
    "reasoning": ("Solve this riddle:", "If", "Which", "Is it true that", "Think step by step:"),
    "math": ("Solve", "Calculate", "What is the probability", "Find the", "A store"),
    "coding": ("Write a Python function", "How do I", "Write a program", "Fix this code:", "Implement"),
    "extraction": ("Extract", "Summarize the following", "Given the following text", "Classify", "Identify"),
    "stem": ("Explain how", "What is the difference between", "Why does", "How does", "Describe"),
    "humanities": ("Discuss", "What were the causes of", "Compare", "What is the significance of", "Analyze"),
}
"""Category -> the openings a written request may start with ("": the target's own start)."""

SHARES = {"open": 0.3} | dict.fromkeys(list(OPENINGS)[1:], 0.7 / (len(OPENINGS) - 1))
"""Each category's fraction of the requests: a third the target's own choice, the rest spread evenly."""

MIN_WORDS, MAX_WORDS = 4, 300
"""A written request shorter or longer than this is dropped (a fragment, or a ramble)."""

SENTINEL = "\x00the user's message\x00"


@dataclass(frozen=True)
class WriterConfig:
    """How the target writes prompts. ``temperature``/``top_p``: sampling (written
    requests need variety; greedy would write one per opening). ``max_new_tokens``:
    a longer request is dropped. ``batch_size``, ``dtype``, ``backend``, ``device``:
    as in ``RegenerateConfig``."""

    temperature: float = 0.9
    top_p: float = 0.95
    max_new_tokens: int = 160
    batch_size: int = 32
    dtype: str = "float32"
    backend: str = "session"
    device: str = "cpu"

    def regenerate_config(self, seed: int) -> RegenerateConfig:
        """The regeneration settings that sample the requests."""
        return RegenerateConfig(
            max_new_tokens=self.max_new_tokens,
            batch_size=self.batch_size,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=seed,
            dtype=self.dtype,
            backend=self.backend,
            device=self.device,
        )


def user_turn_prefix(tokenizer: PreTrainedTokenizerBase) -> str:
    """The chat template's text up to where a user's message begins (the default
    system prompt and the user header included)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False)
    if not isinstance(text, str) or SENTINEL not in text:
        raise ValueError("the tokenizer's chat template does not place the user's message verbatim")
    return text[: text.index(SENTINEL)]


def writer_openings(limit: int, seed: int) -> list[tuple[str, str]]:
    """``limit`` (category, opening) pairs, the same for the same seed: each next
    one from the category furthest below its share, its opening a seeded draw."""
    taken = dict.fromkeys(SHARES, 0)
    chosen = []
    for index in range(limit):
        category = min(SHARES, key=lambda c: taken[c] / SHARES[c])
        taken[category] += 1
        chosen.append((category, random.Random(f"{seed}:{index}").choice(OPENINGS[category])))
    return chosen


def clean_written(opening: str, written: str, finish_reason: str) -> tuple[str | None, str]:
    """The user message the target wrote after ``opening`` and why it is dropped
    if it is: ``unfinished`` (its turn never ended), ``too short``/``too long``
    (outside ``MIN_WORDS``..``MAX_WORDS`` words). Returns (text or None, reason)."""
    text = (opening + written).strip()
    if finish_reason != "stop":
        return None, "unfinished"
    words = len(text.split())
    if words < MIN_WORDS:
        return None, "too short"
    if words > MAX_WORDS:
        return None, "too long"
    return text, "kept"


def write_own_prompts(
    target_dir: Path, limit: int, seed: int, config: WriterConfig
) -> tuple[list[Prompt], dict[str, object]]:
    """Up to ``limit`` prompts the target at ``target_dir`` writes (sources
    ``written:<category>``), cleaned, distinct and decontaminated, with their
    provenance (what was asked, what was dropped and why)."""
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    target = TargetModel.from_pretrained(target_dir, dtype=getattr(torch, config.dtype), device=config.device)
    prefix = user_turn_prefix(tokenizer)
    openings = writer_openings(limit, seed)
    prompt_ids = {
        i: tokenizer(prefix + opening, add_special_tokens=False)["input_ids"] for i, (_, opening) in enumerate(openings)
    }
    regenerate = config.regenerate_config(seed)
    written: dict[int, tuple[str, str, str, str]] = {}
    for record in backend_stream(target, prompt_ids, stop_token_ids(tokenizer), regenerate):
        category, opening = openings[record["id"]]
        tail = str(tokenizer.decode(record["response_ids"], skip_special_tokens=True))
        written[record["id"]] = (category, opening, tail, record["finish_reason"])
    kept, dropped = keep_written([written[i] for i in sorted(written)], benchmark_ngrams())
    made = {
        "written_by": str(target_dir),
        "target_weights_sha256": weights_sha256(target_dir),
        "method": "the target samples a user turn from its chat template's user header (Magpie)",
        "seed": seed,
        "asked": limit,
        "prompts": len(kept),
        "per_source": dict(Counter(p.source for p in kept)),
        "shares": SHARES,
        "openings": {category: list(openings_) for category, openings_ in OPENINGS.items()},
        "dropped": dict(dropped),
        "decontamination": DECONTAMINATION,
        "writer": asdict(config),
    }
    return kept, made


def keep_written(
    written: Sequence[tuple[str, str, str, str]], banned: Set[tuple[str, ...]]
) -> tuple[list[Prompt], Counter[str]]:
    """The prompts worth answering among ``written`` ((category, opening, what the
    target wrote after it, finish reason), in order): cleaned (``clean_written``),
    each text once (case and spacing ignored, first kept), none sharing an
    13-gram with ``banned``. Returns them (source ``written:<category>``)
    and how many were dropped, by reason."""
    dropped: Counter[str] = Counter()
    seen: set[str] = set()
    unique = []
    for category, opening, tail, finish_reason in written:
        text, reason = clean_written(opening, tail, finish_reason)
        key = " ".join(text.lower().split()) if text is not None else ""
        if text is None or key in seen:
            dropped[reason if text is None else "repeat"] += 1
            continue
        seen.add(key)
        unique.append(Prompt(text, f"written:{category}"))
    kept, dropped["benchmark overlap"] = decontaminate(unique, banned)
    return kept, dropped
