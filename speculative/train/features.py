"""The target's context features, computed once per training record and reused
by every epoch.

A draft trains for several epochs on the same regenerated records, and the
target forward that produces their features costs more than the draft's own
step. So the features of every record (the selected layers' outputs over prompt
and response) are computed once, in batches of similar length, and stored as
bf16 safetensors shards (bf16 keeps fp32's range: hidden states with large
outlier dimensions do not overflow). Building is resumable shard by shard; the
index records which target and layers the features belong to and a digest of
each shard's records. Data that grows by appended records (regeneration goes
on between training chunks) extends the store: its shards are kept and only
the new records' features are computed (a last shard that was partial is
recomputed whole). A store of other records, layers or target is refused.

With ``teacher_top_k`` k > 0 the same forward also stores, per position, the
target's k most likely next tokens and their log-probabilities (the soft labels
of distillation: what the target would say next, not only what it said).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from speculative.target import TargetModel

INDEX = "index.json"
STORE_DTYPE = torch.bfloat16
TEACHER_IDS, TEACHER_LOGPROBS = "top_ids", "top_logprobs"
"""Tensor name suffixes of a record's teacher top-k (``"<record>.top_ids"``)."""


def teacher_top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's k most likely next tokens [..., k] and their log-probabilities."""
    top = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return top.indices, top.values


def records_digest(records: Sequence[tuple[list[int], int]]) -> str:
    """Hash of the records' tokens and response starts (which data a store holds)."""
    digest = hashlib.sha256()
    for tokens, start in records:
        digest.update(json.dumps([start, tokens]).encode())
    return digest.hexdigest()


class FeatureStore:
    """Read side: ``features(i)`` is record i's [len, n*H] feature matrix (float32)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.index = json.loads((path / INDEX).read_text())
        self._shards: dict[str, safe_open] = {}

    @property
    def teacher_top_k(self) -> int:
        """How many of the target's most likely next tokens each position stores (0: none)."""
        return int(self.index.get("teacher_top_k", 0))

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """Target layers whose outputs the store holds, in feature order."""
        return tuple(self.index["layer_ids"])

    def features(self, record: int, layer_ids: Sequence[int] | None = None) -> torch.Tensor:
        """Record ``record``'s features, restricted to ``layer_ids`` (a subset of the store's, in that order)."""
        stored = self._tensor(record, str(record)).float()
        if layer_ids is None or tuple(layer_ids) == self.layer_ids:
            return stored
        width = stored.shape[-1] // len(self.layer_ids)
        missing = sorted(set(layer_ids) - set(self.layer_ids))
        if missing:
            raise ValueError(f"the feature store holds layers {self.layer_ids}, not {missing}")
        parts = [stored[:, self.layer_ids.index(i) * width : (self.layer_ids.index(i) + 1) * width] for i in layer_ids]
        return torch.cat(parts, dim=-1)

    def teacher(self, record: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Record ``record``'s teacher: the target's top-k next-token ids [len, k]
        (int64) and log-probabilities [len, k] (float32) at every position."""
        if not self.teacher_top_k:
            raise ValueError(f"the feature store {self.path} holds no teacher top-k (build it with teacher_top_k > 0)")
        ids = self._tensor(record, f"{record}.{TEACHER_IDS}").long()
        return ids, self._tensor(record, f"{record}.{TEACHER_LOGPROBS}").float()

    def teacher_batch(self, records: Sequence[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Teachers of ``records`` right-padded to ``width`` positions: ids [B, width, k]
        (padding -1) and log-probabilities [B, width, k] (padding -inf)."""
        k = self.teacher_top_k
        ids = torch.full((len(records), width, k), -1, dtype=torch.long)
        logprobs = torch.full((len(records), width, k), float("-inf"))
        for row, record in enumerate(records):
            record_ids, record_logprobs = self.teacher(record)
            ids[row, : len(record_ids)] = record_ids
            logprobs[row, : len(record_ids)] = record_logprobs
        return ids, logprobs

    def _tensor(self, record: int, name: str) -> torch.Tensor:
        shard = self.index["shards"][record // self.index["shard_records"]]
        if shard not in self._shards:
            self._shards[shard] = safe_open(str(self.path / shard), framework="pt")
        tensor: torch.Tensor = self._shards[shard].get_tensor(name)  # type: ignore[no-untyped-call]  # unannotated stub
        return tensor

    def batch(self, records: Sequence[int], width: int, layer_ids: Sequence[int] | None = None) -> torch.Tensor:
        """Features of ``records`` right-padded with zeros to ``width`` positions: [B, width, n*H]."""
        rows = [self.features(r, layer_ids) for r in records]
        out = rows[0].new_zeros(len(rows), width, rows[0].shape[-1])
        for i, row in enumerate(rows):
            out[i, : len(row)] = row
        return out


def build_feature_store(
    target: TargetModel,
    records: Sequence[tuple[list[int], int]],
    layer_ids: Sequence[int],
    path: Path,
    *,
    shard_records: int = 256,
    batch_tokens: int = 4096,
    time_limit_s: float = 0.0,
    teacher_top_k: int = 0,
) -> FeatureStore | None:
    """Compute (or finish computing) the features of every record into ``path``.

    Shards of ``shard_records`` consecutive records are written whole, so an
    interrupted build resumes at the first missing shard, and a store of the
    leading records of ``records`` is extended (see the module doc). Inside a
    shard, records run in batches of about ``batch_tokens`` padded tokens,
    sorted by length to limit padding. Past ``time_limit_s`` (0: none) the
    build stops after the shard in progress and returns None: call again to go
    on. ``teacher_top_k`` > 0 also stores the target's top-k next tokens per
    position."""
    identity = {
        "layer_ids": list(layer_ids),
        "target": str(getattr(target.model, "name_or_path", "")),
        "hidden_size": target.hidden_size,
        "shard_records": shard_records,
        "dtype": str(STORE_DTYPE).removeprefix("torch."),
        "teacher_top_k": teacher_top_k,
    }
    index_file = path / INDEX
    names: list[str] = []
    digests: list[str] = []
    seconds = 0.0
    if index_file.exists():
        stored = json.loads(index_file.read_text())
        if {k: stored.get(k) for k in identity} != identity:
            raise foreign_store(path)
        names, digests = reusable_shards(stored, records, path)
        seconds = stored["seconds"]
    path.mkdir(parents=True, exist_ok=True)
    shards = range(0, len(records), shard_records)
    deadline = time.monotonic() + time_limit_s if time_limit_s else float("inf")
    with tqdm(total=len(shards), initial=len(names), desc="features", unit="shard") as progress:
        for first in shards[len(names) :]:
            started = time.monotonic()
            name = f"features-{first // shard_records:05d}.safetensors"
            members = range(first, min(first + shard_records, len(records)))
            tensors = _shard_features(target, records, members, tuple(layer_ids), batch_tokens, teacher_top_k)
            save_file(tensors, str(path / name))
            names.append(name)
            digests.append(records_digest([records[i] for i in members]))
            seconds = round(seconds + time.monotonic() - started, 1)
            index = {**identity, "records": len(records), "shards": names, "shard_sha256": digests, "seconds": seconds}
            index_file.write_text(json.dumps(index, indent=2) + "\n")
            progress.update(1)
            if time.monotonic() > deadline and len(names) < len(shards):
                return None
    return FeatureStore(path)


def reusable_shards(
    index: dict[str, Any], records: Sequence[tuple[list[int], int]], path: Path
) -> tuple[list[str], list[str]]:
    """The stored shards (names, digests) that hold exactly the features of
    ``records``' leading records. A full shard must match its records; a last,
    partial shard whose records are a prefix of its range in ``records`` is
    dropped (recomputed with the records appended since). Anything else means
    the store belongs to other data: refused, not overwritten."""
    size = index["shard_records"]
    names, digests = index["shards"], index.get("shard_sha256", [])
    if len(digests) != len(names) or index["records"] > len(records):
        raise foreign_store(path)
    kept = len(names)
    for shard, digest in enumerate(digests):
        members = records[shard * size : min((shard + 1) * size, index["records"])]
        if records_digest(members) != digest:
            raise foreign_store(path)
        if len(members) < size and index["records"] < len(records):
            kept = shard
    return names[:kept], digests[:kept]


def foreign_store(path: Path) -> ValueError:
    return ValueError(f"{path} holds features of other records, layers or target: use another directory")


def _shard_features(
    target: TargetModel,
    records: Sequence[tuple[list[int], int]],
    members: range,
    layer_ids: tuple[int, ...],
    batch_tokens: int,
    teacher_top_k: int,
) -> dict[str, torch.Tensor]:
    order = sorted(members, key=lambda i: len(records[i][0]))
    tensors: dict[str, torch.Tensor] = {}
    while order:
        width = len(records[order[0]][0])
        batch = [order.pop(0)]
        while order and (len(batch) + 1) * len(records[order[0]][0]) <= batch_tokens:
            batch.append(order.pop(0))
            width = len(records[batch[-1]][0])
        ids = torch.zeros(len(batch), width, dtype=torch.long, device=target.device)
        for row, i in enumerate(batch):
            ids[row, : len(records[i][0])] = torch.tensor(records[i][0])
        # Right padding: causal attention keeps every real token's features exact.
        out = target.forward_sequences(ids, feature_layers=layer_ids, logits=teacher_top_k > 0)
        features = out.features
        assert features is not None  # the forward captured layer_ids
        if teacher_top_k:
            top_ids, top_logprobs = teacher_top(out.logits, teacher_top_k)
        for row, i in enumerate(batch):
            n = len(records[i][0])
            tensors[str(i)] = features[row, :n].to(STORE_DTYPE).contiguous().cpu()
            if teacher_top_k:
                tensors[f"{i}.{TEACHER_IDS}"] = top_ids[row, :n].to(torch.int32).contiguous().cpu()
                tensors[f"{i}.{TEACHER_LOGPROBS}"] = top_logprobs[row, :n].to(STORE_DTYPE).contiguous().cpu()
    return tensors
