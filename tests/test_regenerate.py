"""Regeneration through the continuously batched decode session: resumable,
independent of batching, a seeded share of sampled responses, and DFlash-made
data identical to the target's own."""

import dataclasses
import json

from builders import tiny_draft

from speculative.decode import DecodeConfig, spec_generate
from speculative.target import TargetModel
from speculative.train.regenerate import RegenerateConfig, regenerate_chat_prompts, regenerate_stream, row_sampling

PROMPTS = [f"Explain item {i} of the json module." + " again" * (i % 5) for i in range(14)]


def _records(path):
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_a_stopped_run_resumes_to_the_same_records(tiny_pipeline, tmp_path):
    root, _, _ = tiny_pipeline
    config = RegenerateConfig(max_new_tokens=24, batch_size=4, prefill_group=2, sampled_share=0.5, seed=5)
    whole = regenerate_chat_prompts(root / "target", PROMPTS, tmp_path / "whole", config, source="t")
    assert whole["finished"] and whole["records"] == len(PROMPTS)

    stopped = regenerate_chat_prompts(
        root / "target", PROMPTS, tmp_path / "part", config, source="t", time_limit_minutes=1e-9
    )
    assert not stopped["finished"] and 1 <= stopped["records"] < len(PROMPTS)
    assert not (tmp_path / "part.meta.json").exists()
    with (tmp_path / "part.jsonl").open("a") as f:
        f.write('{"id": 3, "prompt_ids": [1, 2')  # a line cut short by a killed run
    resumed = regenerate_chat_prompts(root / "target", PROMPTS, tmp_path / "part", config, source="t")
    assert resumed["finished"] and resumed["records"] == len(PROMPTS)
    assert _records(tmp_path / "part.jsonl") == _records(tmp_path / "whole.jsonl")
    assert json.loads((tmp_path / "part.meta.json").read_text())["source"] == {"t": len(PROMPTS)}


def test_sampled_share_is_seeded_per_prompt_and_greedy_rows_are_the_targets_own(tiny_pipeline):
    root, _, _ = tiny_pipeline
    target = TargetModel.from_pretrained(root / "target")
    prompts = {i: [5 + i, 7, 9 + i % 3] for i in range(12)}
    config = RegenerateConfig(max_new_tokens=12, batch_size=3, prefill_group=2, sampled_share=0.5, seed=1)
    records = {r["id"]: r for r in regenerate_stream(target, prompts, (), config)}
    temperatures = {r["temperature"] for r in records.values()}
    assert temperatures == {0.0, 0.7} and all(
        records[i]["temperature"] == row_sampling(i, config).temperature for i in prompts
    )
    for i, record in records.items():
        params = row_sampling(i, config)
        alone = spec_generate(target, None, [prompts[i]], DecodeConfig(1, 12), params)
        assert record["response_ids"] == alone.tokens[0]  # sampled rows too: each row has its own seed
    wider = dataclasses.replace(config, batch_size=5, prefill_group=5)
    assert {r["id"]: r for r in regenerate_stream(target, prompts, (), wider)} == records


def test_regeneration_through_dflash_gives_the_targets_greedy_data(tiny_pipeline):
    root, _, _ = tiny_pipeline
    target = TargetModel.from_pretrained(root / "target")
    draft = tiny_draft(vocab=target.vocab_size, block_size=4, mask_token_id=3, max_position_embeddings=2048)
    prompts = {i: [5 + i, 7, 9 + i % 3] for i in range(6)}
    config = RegenerateConfig(max_new_tokens=16, batch_size=4, prefill_group=2)
    plain = {r["id"]: r for r in regenerate_stream(target, prompts, (), config)}
    spec = {r["id"]: r for r in regenerate_stream(target, prompts, (), config, draft)}
    assert spec == plain and any(len(r["response_ids"]) > 1 for r in spec.values())
