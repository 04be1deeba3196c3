"""Regeneration through the continuously batched decode session: resumable,
independent of batching, a seeded share of sampled responses, and DFlash-made
data identical to the target's own."""

import dataclasses
import json

import pytest
from builders import tiny_draft

from speculative.decode import DecodeConfig, spec_generate
from speculative.target import TargetModel
from speculative.train.cli import main
from speculative.train.generate_batched import generate_batches
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


def test_the_generate_backend_gives_the_sessions_greedy_records(tiny_pipeline, tmp_path):
    root, _, _ = tiny_pipeline
    session = RegenerateConfig(max_new_tokens=16, batch_size=4, prefill_group=2)
    batched = dataclasses.replace(session, backend="generate", batch_size=5)
    regenerate_chat_prompts(root / "target", PROMPTS, tmp_path / "session", session, source="t")
    meta = regenerate_chat_prompts(root / "target", PROMPTS, tmp_path / "generate", batched, source="t")
    assert meta["finished"] and meta["backend"] == "generate"
    by_session, by_generate = _records(tmp_path / "session.jsonl"), _records(tmp_path / "generate.jsonl")
    assert by_generate == by_session  # left padding and one call per batch change nothing greedy decoding keeps
    assert {r["finish_reason"] for r in by_generate.values()} <= {"stop", "length"}


def test_the_generate_backend_groups_prompts_by_temperature_and_refuses_a_draft():
    prompts = {i: [1] * (i % 7 + 1) for i in range(20)}
    temperature_of = {i: 0.7 if i % 4 == 0 else 0.0 for i in prompts}
    batches = generate_batches(prompts, temperature_of, batch_size=6, seed=0)
    assert sorted(k for batch in batches for k in batch) == list(prompts)
    assert all(len({temperature_of[k] for k in batch}) == 1 for batch in batches)
    with pytest.raises(ValueError, match="target alone"):
        RegenerateConfig(backend="generate", draft="some-draft")
    with pytest.raises(ValueError, match="backend must be"):
        RegenerateConfig(backend="vllm")


def test_a_prompt_file_written_here_is_answered_by_the_data_command(tiny_pipeline, tmp_path):
    root, _, _ = tiny_pipeline
    prompts_file = tmp_path / "prompts.jsonl"
    main(["prompts", "--out", str(prompts_file), "--limit", "30", "--seed", "4"])
    written = [json.loads(line) for line in prompts_file.read_text().splitlines()]
    assert len(written) == 30 and all(r["text"] and r["source"] for r in written)
    out = tmp_path / "answered"
    flags = ["--prompts-file", str(prompts_file), "--limit", "4", "--max-new-tokens", "6", "--backend", "generate"]
    main(["data", "--target", str(root / "target"), "--out", str(out), *flags])
    meta = json.loads(out.with_suffix(".meta.json").read_text())
    assert meta["records"] == 4 and meta["prompt_provenance"]["seed"] == 4 and meta["backend"] == "generate"
    answered = {r["prompt"] for r in map(json.loads, out.with_suffix(".jsonl").read_text().splitlines())}
    assert answered == {r["text"] for r in written[:4]}


def test_a_generate_run_stopped_by_its_time_limit_keeps_the_batch_it_made(tiny_pipeline, tmp_path):
    root, _, _ = tiny_pipeline
    config = RegenerateConfig(max_new_tokens=12, batch_size=5, backend="generate")
    stopped = regenerate_chat_prompts(
        root / "target", PROMPTS, tmp_path / "part", config, source="t", time_limit_minutes=1e-9
    )
    assert not stopped["finished"] and stopped["records"] in (4, 5)  # one whole batch of 5, 5, 4, not one record
    resumed = regenerate_chat_prompts(root / "target", PROMPTS, tmp_path / "part", config, source="t")
    whole = regenerate_chat_prompts(root / "target", PROMPTS, tmp_path / "whole", config, source="t")
    assert resumed["finished"] and _records(tmp_path / "part.jsonl") == _records(tmp_path / "whole.jsonl")
    assert whole["records"] == len(PROMPTS)
