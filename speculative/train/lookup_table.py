"""``dflash-train ngram-table``: a draft's corpus n-gram table from regenerated data.

The table (``speculative.ngram_table``) holds what the target most often wrote
after each short context in its own answers, so it is built from the same
regenerated ``.jsonl`` files the draft trained on (prompts decontaminated
against the benchmarks), and written beside the draft's weights, where
``load_draft`` finds it."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from pathlib import Path

from speculative.config import DFlashConfig
from speculative.ngram_table import TABLE_NAME, NgramTable
from speculative.packaged import file_sha256
from speculative.train.draft_train import load_records

WHOLE_RECORDS = 1 << 30  # load_records' truncation, off: the table counts every response token


def build_draft_table(data: Sequence[Path], draft_dir: Path, sizes: Sequence[int], min_count: int) -> dict[str, object]:
    """Count the responses of ``data`` into ``draft_dir/ngram_table.safetensors``
    for the draft's vocabulary; returns what the table's metadata records."""
    vocab_size = int(DFlashConfig.from_file(draft_dir).architecture.vocab_size)
    records = load_records(data, WHOLE_RECORDS)
    about = {
        "sources": [{"file": Path(p).name, "sha256": file_sha256(Path(p))} for p in data],
        "responses": len(records),
        "response_tokens": sum(len(tokens) - start for tokens, start in records),
        "built": datetime.date.today().isoformat(),
    }
    table = NgramTable.build(
        (tokens[start:] for tokens, start in records),
        vocab_size=vocab_size,
        sizes=sizes,
        min_count=min_count,
        about=about,
    )
    table.save(draft_dir / TABLE_NAME)
    return {"table": str(draft_dir / TABLE_NAME), "entries": len(table), **table.about}
