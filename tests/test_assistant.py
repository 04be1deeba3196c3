"""An assisted-generation assistant cut from a pretrained target: its first
layers, fine-tuned on the target's regenerated responses, stored without the
target's embeddings and loaded with them, usable by ``generate``."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from speculative.assistant import load_assistant, save_assistant
from speculative.train.assistant import AssistantTrainConfig, batch_inputs, train_assistant, truncated_target
from speculative.train.cli import main


def test_labels_are_the_response_tokens_only():
    tokens, mask, labels = batch_inputs([([5, 6, 7, 8], 2), ([5, 6, 9], 1)], pad_id=0)
    assert tokens.tolist() == [[5, 6, 7, 8], [5, 6, 9, 0]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert labels.tolist() == [[-100, -100, 7, 8], [-100, 6, 9, -100]]


def test_bad_settings_fail_clearly(tiny_pipeline, tmp_path):
    root, _, _ = tiny_pipeline
    paths = dict(
        target_dir=root / "target", data=(root / "data.jsonl",), out_dir=tmp_path / "a", run_dir=tmp_path / "r"
    )
    with pytest.raises(ValueError, match="dtype must be float32 or bfloat16"):
        AssistantTrainConfig(**paths, dtype="float16")
    with pytest.raises(ValueError, match="num_layers, steps and batch_size must be >= 1"):
        AssistantTrainConfig(**paths, num_layers=0)
    with pytest.raises(ValueError, match="leaves none of the"):
        train_assistant(AssistantTrainConfig(**paths, holdout=1000))


def test_the_cut_keeps_the_targets_first_layers_and_freezes_its_embeddings(tiny_pipeline):
    root, _, _ = tiny_pipeline
    target = AutoModelForCausalLM.from_pretrained(str(root / "target"), dtype=torch.float32)
    cut = truncated_target(root / "target", 1)
    assert cut.config.num_hidden_layers == len(cut.model.layers) == 1
    assert cut.model.layers[0].mlp.up_proj.weight.equal(target.model.layers[0].mlp.up_proj.weight)
    assert not cut.get_input_embeddings().weight.requires_grad
    assert cut.get_output_embeddings().weight is cut.get_input_embeddings().weight  # the head stays tied
    with pytest.raises(ValueError, match="fewer layers than the target's 4"):
        truncated_target(root / "target", 4)


def test_a_trained_assistant_fits_the_targets_responses_and_assists_generate(tiny_pipeline, tmp_path):
    root, _, _ = tiny_pipeline
    out = tmp_path / "assistant"
    main(
        [
            "assistant",
            "--target",
            str(root / "target"),
            "--data",
            str(root / "data.jsonl"),
            "--out",
            str(out),
            "--run-dir",
            str(tmp_path / "run"),
            "--num-layers",
            "1",
            "--steps",
            "40",
            "--batch-size",
            "4",
            "--lr",
            "3e-3",
            "--warmup-steps",
            "4",
            "--holdout",
            "3",
            "--checkpoint-every",
            "20",
        ]
    )
    summary = json.loads((out / "training.json").read_text())
    curve = summary["curve"]
    assert [p["step"] for p in curve] == [0, 20, 40]
    assert curve[-1]["holdout_loss"] < curve[0]["holdout_loss"] - 0.2
    assert curve[-1]["holdout_agreement"] >= curve[0]["holdout_agreement"]
    assert summary["data"]["held_out_records"] == 3
    assert "dflash-train assistant" in (out / "README.md").read_text()

    target = AutoModelForCausalLM.from_pretrained(str(root / "target"), dtype=torch.float32)
    stored = load_file(str(out / "model.safetensors"))
    assert "model.embed_tokens.weight" not in stored and "lm_head.weight" not in stored  # the target's
    assistant = load_assistant(out, target)
    assert assistant.config.num_hidden_layers == 1
    assert assistant.get_input_embeddings().weight.equal(target.get_input_embeddings().weight)
    assert assistant.model.layers[0].mlp.up_proj.weight.equal(stored["model.layers.0.mlp.up_proj.weight"].float())
    assert not assistant.model.layers[0].mlp.up_proj.weight.equal(target.model.layers[0].mlp.up_proj.weight)
    prompt = AutoTokenizer.from_pretrained(str(root / "target"))("def add(a, b):", return_tensors="pt").input_ids
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False)
    assisted = target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=assistant)
    assert assisted.tolist() == plain.tolist()  # assisted generation is lossless in fp32


def test_a_stored_assistant_scores_as_it_did_and_needs_a_target_that_fits(tiny_pipeline, tmp_path):
    root, _, _ = tiny_pipeline
    cut = truncated_target(root / "target", 2)
    with torch.no_grad():
        cut.model.layers[1].self_attn.o_proj.weight.mul_(1.5)  # as if trained
    save_assistant(cut, tmp_path / "a", dtype=torch.float32)
    target = AutoModelForCausalLM.from_pretrained(str(root / "target"), dtype=torch.float32)
    tokens = torch.tensor([[1, 5, 9, 12, 7, 3]])
    expected = cut(input_ids=tokens).logits
    assert load_assistant(tmp_path / "a", target)(input_ids=tokens).logits.equal(expected)

    config = target.config.to_dict() | {"vocab_size": target.config.vocab_size + 8}
    other = AutoModelForCausalLM.from_config(type(target.config).from_dict(config))
    with pytest.raises(ValueError, match="the target's embeddings are"):
        load_assistant(tmp_path / "a", other)
    stored = load_file(str(tmp_path / "a" / "model.safetensors"))
    del stored["model.norm.weight"]
    save_file(stored, str(tmp_path / "a" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        load_assistant(tmp_path / "a", target)
