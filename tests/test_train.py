"""The training pipeline on a tiny scale: target LM, regenerated data, draft."""

import copy
import dataclasses
import itertools
import json
import math
import textwrap

import pytest
import torch
import torch.nn.functional as F
from builders import HIDDEN, SMALL_CORPUS, VOCAB, draft_config_dict, tiny_draft, tiny_target
from transformers import AutoTokenizer

from speculative.chat import stop_token_ids
from speculative.checkpoint import load_draft
from speculative.config import DFlashConfig
from speculative.decode import DecodeConfig, spec_generate
from speculative.draft import DFlashDraftModel
from speculative.sampling import SamplingParams
from speculative.target import TargetModel
from speculative.train.cli import lm_card, main
from speculative.train.corpus import Corpus, request_prompts
from speculative.train.draft_train import DraftTrainConfig, grow_from, load_records, train_draft
from speculative.train.draft_vocab import frequent_token_ids, response_tokens, token_coverage
from speculative.train.loop import ResumableRun
from speculative.train.model_card import parameter_count
from speculative.train.objective import (
    block_logits,
    block_visibility,
    default_gamma,
    dflash_loss,
    position_weights,
    sample_anchors,
    teacher_cross_entropy,
)
from speculative.train.regenerate import RegenerateConfig, regenerate
from speculative.train.target_lm import TargetTrainConfig, train_target


def test_block_visibility_matches_brute_force():
    anchors = torch.tensor([[2, 5, 9], [0, 3, 4]])
    seq_len, b = 12, 4
    visible = block_visibility(anchors, seq_len, b)
    assert visible.shape == (2, 3 * b, seq_len + 3 * b)
    for row in range(2):
        for q in range(3 * b):
            block = q // b
            for k in range(seq_len + 3 * b):
                # Context strictly before the anchor; block tokens of the own block only.
                expected = k < anchors[row, block] if k < seq_len else (k - seq_len) // b == block
                assert visible[row, q, k].item() == expected, (row, q, k)


def test_position_weights_and_gamma():
    w = position_weights(16, 7.0)
    assert w.shape == (15,)
    torch.testing.assert_close(w, torch.exp(-torch.arange(15.0) / 7.0))
    assert w[0] == 1.0
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)


def test_packed_blocks_equal_separate_blocks():
    """Many blocks in one forward under the block-sparse mask give the same loss
    as each block run alone through the serving path (context < anchor only)."""
    torch.manual_seed(0)
    target = tiny_target()
    draft = DFlashDraftModel(DFlashConfig.from_dict(draft_config_dict(block_size=4)))
    tokens = torch.randint(0, 90, (2, 14))
    lengths = torch.tensor([14, 11])
    anchors = torch.tensor([[3, 7, 12], [2, 5, 9]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    positions = torch.arange(14).expand(2, -1)
    with torch.no_grad():
        layers = draft.config.target_layer_ids
        features = target.forward(
            tokens, positions, target.new_cache(), positions[:, :0], feature_layers=layers
        ).features
        packed = dflash_loss(draft, target, tokens, features, lengths, anchors, valid, gamma=2.0)
        weights = position_weights(4, 2.0)
        total, norm = 0.0, 0.0
        for row in range(2):
            for j in range(3):
                a = int(anchors[row, j])
                if not valid[row, j]:
                    continue
                ctx_pos = torch.where(positions[row : row + 1] < a, positions[row : row + 1], -1)
                context = draft.context_kv(features[row : row + 1], positions[row : row + 1])
                block = torch.tensor([[tokens[row, a], *[draft.mask_token_id] * 3]])
                hidden = draft(target.embed(block), a + torch.arange(4)[None], context, ctx_pos)
                logits = target.lm_head(hidden[0, 1:])
                for k in range(1, 4):
                    if a + k < lengths[row]:
                        ce = torch.nn.functional.cross_entropy(logits[k - 1], tokens[row, a + k])
                        total += weights[k - 1] * ce
                        norm += weights[k - 1]
    torch.testing.assert_close(packed.loss, total / norm, rtol=1e-5, atol=1e-5)
    assert packed.counted.tolist() == [5, 4, 4]


def test_sample_anchors_respects_response_and_padding():
    g = torch.Generator().manual_seed(0)
    anchors, valid = sample_anchors(torch.tensor([20, 6]), torch.tensor([10, 3]), 5, g)
    assert valid.tolist() == [[True] * 5, [True, True, False, False, False]]
    assert all(10 <= a < 19 for a in anchors[0].tolist())
    assert sorted(anchors[1, :2].tolist()) == [3, 4]
    assert anchors[0].tolist() == sorted(anchors[0].tolist())


def test_target_training_lowers_loss_and_writes_a_loadable_model(tiny_pipeline):
    root, summary, _ = tiny_pipeline
    assert summary["finished"]
    curve = summary["curve"]
    assert curve[-1]["train_loss"] < curve[0]["train_loss"] and curve[-1]["valid_loss"] < math.log(320)
    assert summary["data"]["chat_pairs"] > 0 and len(summary["data"]["corpus_sha256"]) == 64
    files = {p.name for p in (root / "target").iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "training.json"} <= files


def test_target_training_resumes_to_the_same_weights(tmp_path):
    common = dict(
        vocab_size=300,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        seq_len=32,
        batch_size=2,
        steps=6,
        warmup_steps=2,
        checkpoint_every=100,
    )
    corpus = Corpus.stdlib(SMALL_CORPUS)
    train_target(TargetTrainConfig(out_dir=tmp_path / "a", run_dir=tmp_path / "ra", **common), corpus)
    stopped = train_target(
        TargetTrainConfig(out_dir=tmp_path / "b", run_dir=tmp_path / "rb", time_limit_minutes=1e-9, **common), corpus
    )
    assert not stopped["finished"] and stopped["step"] == 1
    train_target(TargetTrainConfig(out_dir=tmp_path / "b", run_dir=tmp_path / "rb", **common), corpus)
    a = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "b" / "model.safetensors").read_bytes()


def test_regenerated_data_is_the_targets_own_output(tiny_pipeline):
    root, _, meta = tiny_pipeline
    records = [json.loads(line) for line in (root / "data.jsonl").read_text().splitlines()]
    assert meta["records"] == len(records) == 11 and meta["skipped_too_long"] == 1
    assert len(meta["target_weights_sha256"]) == 64
    target = TargetModel.from_pretrained(root / "target")
    stop = tuple(meta["stop_token_ids"])
    for record in records[:4]:
        alone = spec_generate(target, None, [record["prompt_ids"]], DecodeConfig(1, 48, stop))
        assert alone.tokens[0] == record["response_ids"]


def test_sampled_regeneration_does_not_depend_on_batching():
    target = tiny_target()
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    config = dict(max_new_tokens=10, temperature=1.0, seed=3)
    one = regenerate(target, prompts, (), RegenerateConfig(batch_size=1, **config))
    three = regenerate(target, prompts, (), RegenerateConfig(batch_size=3, **config))
    assert one == three


def test_draft_training_learns_resumes_and_writes_official_format(tiny_pipeline, tmp_path):
    root, _, _ = tiny_pipeline
    common = dict(
        target_dir=root / "target",
        data=(root / "data.jsonl",),
        block_size=8,
        anchors_per_sequence=8,
        batch_size=4,
        epochs=8.0,
        lr=3e-3,
        checkpoint_every=4,
    )
    full = train_draft(DraftTrainConfig(out_dir=tmp_path / "a", run_dir=tmp_path / "ra", **common))
    usable = len(load_records([root / "data.jsonl"], 768))
    assert full["finished"] and full["steps"] == math.ceil(8.0 * usable / 4) >= 12
    assert full["curve"][-1]["loss"] < full["curve"][0]["loss"]
    assert len(full["curve"][0]["accuracy_per_position"]) == 7
    stopped = train_draft(
        DraftTrainConfig(out_dir=tmp_path / "b", run_dir=tmp_path / "rb", time_limit_minutes=1e-9, **common)
    )
    assert not stopped["finished"]
    # A stopped chunk leaves the draft so far, loadable, marked unfinished; the checkpoint resumes it.
    assert json.loads((tmp_path / "b" / "training.json").read_text())["finished"] is False
    assert load_draft(tmp_path / "b").block_size == 8
    train_draft(DraftTrainConfig(out_dir=tmp_path / "b", run_dir=tmp_path / "rb", **common))
    a, b = load_draft(tmp_path / "a"), load_draft(tmp_path / "b")
    assert all(torch.equal(a.state_dict()[n], t) for n, t in b.state_dict().items())
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["num_target_layers"] == 4
    assert config["dflash_config"]["mask_token_id"] == 3 and config["block_size"] == 8
    target = TargetModel.from_pretrained(root / "target")
    prompt = [1, 50, 60, 70]
    greedy = spec_generate(target, None, [prompt], DecodeConfig(1, 20)).tokens
    assert spec_generate(target, a, [prompt], DecodeConfig(8, 20), SamplingParams()).tokens == greedy


def test_assistant_reuses_the_targets_tokenizer(tiny_pipeline, tmp_path):
    root, _, _ = tiny_pipeline
    cfg = TargetTrainConfig(
        out_dir=tmp_path / "assistant",
        run_dir=tmp_path / "run",
        vocab_size=320,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        seq_len=32,
        batch_size=2,
        steps=2,
        warmup_steps=1,
        tokenizer=str(root / "target"),
    )
    train_target(cfg, Corpus.stdlib(SMALL_CORPUS))
    assert (tmp_path / "assistant" / "tokenizer.json").read_text() == (root / "target" / "tokenizer.json").read_text()
    assert "assistant" in lm_card(cfg) and str(root / "target") in lm_card(cfg)
    assert "bundled target" in lm_card(dataclasses.replace(cfg, init_from=str(root / "target")))
    assert "bundled target" in lm_card(dataclasses.replace(cfg, tokenizer=""))


def test_cli_trains_and_writes_a_model_card(tiny_pipeline, tmp_path):
    root, _, _ = tiny_pipeline
    main(
        [
            "draft",
            "--target",
            str(root / "target"),
            "--data",
            str(root / "data.jsonl"),
            str(root / "data.jsonl"),
            "--out",
            str(tmp_path / "draft"),
            "--run-dir",
            str(tmp_path / "run"),
            "--block-size",
            "4",
            "--epochs",
            "1",
        ]
    )
    card = (tmp_path / "draft" / "README.md").read_text()
    assert "DFlash draft" in card and "final loss" in card and "dflash-train draft --target" in card
    assert load_draft(tmp_path / "draft").block_size == 4
    # Two data files (here the same one twice): one epoch covers the records of both.
    summary = json.loads((tmp_path / "draft" / "training.json").read_text())
    assert summary["steps"] == math.ceil(2 * len(load_records([root / "data.jsonl"], 768)) / 8)
    assert summary["config"]["data"] == f"{root / 'data.jsonl'} {root / 'data.jsonl'}"


def test_request_prompts_ask_for_each_docstring_summary_in_english():
    source = textwrap.dedent('''
        """Tools for parsing
        config files.

        Details nobody asks for."""

        class Reader:
            """Read settings from a file, one per line."""

            def close(self):
                """Close."""

        def parse(text):
            """Return the settings in text as a dict, keys lower-cased."""
            return {}

        def undocumented():
            pass
    ''')
    assert request_prompts(source) == [
        "Write Python code for this: Tools for parsing config files.",
        "Write Python code for this: Read settings from a file, one per line.",
        "Write Python code for this: Return the settings in text as a dict, keys lower-cased.",
    ]  # "Close." is too short to be a request; the module summary's two lines become one
    assert request_prompts("def broken(:") == []


def test_target_training_can_start_from_a_saved_model(tiny_pipeline, tmp_path):
    root, _, _ = tiny_pipeline
    saved = TargetModel.from_pretrained(root / "target").model.state_dict()
    cfg = TargetTrainConfig(
        out_dir=tmp_path / "more",
        run_dir=tmp_path / "run",
        vocab_size=320,
        hidden_size=HIDDEN,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        context_length=2048,
        seq_len=32,
        batch_size=2,
        steps=1,
        warmup_steps=1,
        lr=1e-12,
        tokenizer=str(root / "target"),
        init_from=str(root / "target"),
    )
    train_target(cfg, Corpus.stdlib(SMALL_CORPUS))
    continued = TargetModel.from_pretrained(tmp_path / "more").model.state_dict()
    for name, tensor in saved.items():
        torch.testing.assert_close(continued[name], tensor, rtol=0, atol=1e-2)  # bf16 storage


def test_draft_training_can_start_from_a_saved_draft(tiny_pipeline, tmp_path):
    root, _, _ = tiny_pipeline
    common = dict(
        target_dir=root / "target", data=(root / "data.jsonl",), block_size=8, batch_size=2, epochs=0.01, holdout=3
    )
    train_draft(DraftTrainConfig(out_dir=tmp_path / "first", run_dir=tmp_path / "r1", lr=3e-3, seed=1, **common))
    more = train_draft(
        DraftTrainConfig(
            out_dir=tmp_path / "more", run_dir=tmp_path / "r2", lr=1e-12, init_from=str(tmp_path / "first"), **common
        )
    )
    fresh_run = train_draft(DraftTrainConfig(out_dir=tmp_path / "fresh", run_dir=tmp_path / "r3", lr=1e-12, **common))
    # A continued run first scores its source on the held-out records (step 0), the mark it has to beat;
    # at lr 1e-12 the last checkpoint scores the same. A fresh draft has no such mark.
    start, end = more["curve"][0], more["curve"][-1]
    assert start["step"] == 0 and end["step"] > 0 and "loss" not in start
    assert start["holdout_accuracy_per_position"] == end["holdout_accuracy_per_position"]
    assert start["holdout_expected_tau"] > 1
    assert fresh_run["curve"][0]["step"] > 0
    first, more, fresh = (load_draft(tmp_path / d).state_dict() for d in ("first", "more", "fresh"))
    for name, tensor in first.items():
        torch.testing.assert_close(more[name], tensor, rtol=0, atol=1e-2)  # bf16 storage
    assert any(not torch.allclose(fresh[name], tensor, atol=1e-2) for name, tensor in first.items())


def test_a_deeper_draft_grown_from_a_trained_one_predicts_the_same():
    source = tiny_draft(layers=1, seed=3)
    grown = DFlashDraftModel(DFlashConfig.from_dict(draft_config_dict(layers=3))).float().eval()
    grow_from(grown, source)
    g = torch.Generator().manual_seed(0)
    features = torch.randn(2, 10, 2 * HIDDEN, generator=g)
    context_positions = torch.arange(10).expand(2, 10)
    block = torch.randn(2, 4, HIDDEN, generator=g)
    block_positions = torch.arange(10, 14).expand(2, 4)
    with torch.no_grad():
        expected = source(block, block_positions, source.context_kv(features, context_positions), context_positions)
        actual = grown(block, block_positions, grown.context_kv(features, context_positions), context_positions)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)
    assert grown.layers[1].mlp.up_proj.weight.abs().sum() > 0  # the new layers can learn: only outputs are zero
    with pytest.raises(ValueError, match="cannot start a 1-layer draft from a 3-layer one"):
        grow_from(source, grown)


def _loss_inputs(draft, target, tokens):
    """(tokens, features, lengths, anchors, valid) of the packed-loss tests' layout."""
    features = target.forward_sequences(tokens, feature_layers=draft.config.target_layer_ids).features
    anchors = torch.tensor([[3, 7, 12], [2, 5, 9]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    return tokens, features, torch.tensor([14, 11]), anchors, valid


def test_loss_with_a_draft_vocabulary_uses_k_way_logits_only(monkeypatch):
    """With a map the draft's logits have K columns (the target's full LM head
    is never applied) equal to those columns of the full head, and the loss is
    the weighted CE over labels inside the vocabulary only; labels outside it
    are still counted."""
    torch.manual_seed(0)
    target = tiny_target()
    full = DFlashDraftModel(DFlashConfig.from_dict(draft_config_dict(block_size=4)))
    reduced = copy.deepcopy(full)
    ids = torch.arange(0, 90, 3)
    reduced.set_draft_vocab(ids)
    inputs = _loss_inputs(full, target, torch.randint(0, 90, (2, 14), generator=torch.Generator().manual_seed(1)))
    tokens, _, lengths, anchors, valid = inputs
    with torch.no_grad():
        full_logits = block_logits(full, target, *inputs[:4])
        full_out = dflash_loss(full, target, *inputs, gamma=2.0)
        monkeypatch.setattr(target, "lm_head", lambda hidden: pytest.fail("full-vocabulary logits in training"))
        logits = block_logits(reduced, target, *inputs[:4])
        out = dflash_loss(reduced, target, *inputs, gamma=2.0)
    assert logits.shape == (2, 3, 3, len(ids))
    torch.testing.assert_close(logits, full_logits[..., ids])
    weights, total, norm, outside = position_weights(4, 2.0), 0.0, 0.0, 0
    for row, j, k in itertools.product(range(2), range(3), range(1, 4)):
        a = int(anchors[row, j])
        if not valid[row, j] or a + k >= lengths[row]:
            continue
        label = int(tokens[row, a + k])
        if label % 3:
            outside += 1
            continue
        total += weights[k - 1] * F.cross_entropy(logits[row, j, k - 1], torch.tensor(label // 3))
        norm += weights[k - 1]
    assert outside > 0 and norm > 0
    torch.testing.assert_close(out.loss, total / norm)
    assert out.counted.tolist() == full_out.counted.tolist() == [5, 4, 4]


def test_labels_outside_the_draft_vocabulary_count_as_wrong():
    """Drafts whose hidden state is zero guess draft index 0 everywhere: token 0
    for the full vocabulary, token 1 for a map of the odd ids. On labels drawn
    from {0, 1, 2} the full draft is right exactly at the 0s, the reduced one
    exactly at the 1s (and the 0s and 2s, outside its map, count as wrong)."""
    target = tiny_target()
    full = DFlashDraftModel(DFlashConfig.from_dict(draft_config_dict(block_size=4)))
    with torch.no_grad():
        full.norm.weight.zero_()
    reduced = copy.deepcopy(full)
    reduced.set_draft_vocab(torch.arange(1, VOCAB, 2))
    tokens = torch.randint(0, 3, (2, 14), generator=torch.Generator().manual_seed(2))
    inputs = _loss_inputs(full, target, tokens)
    with torch.no_grad():
        full_out = dflash_loss(full, target, *inputs, gamma=2.0)
        out = dflash_loss(reduced, target, *inputs, gamma=2.0)
    label_positions = inputs[3][:, :, None] + torch.arange(1, 4)
    counted = inputs[4][:, :, None] & (label_positions < inputs[2][:, None, None])
    labels = tokens.gather(1, label_positions.clamp(max=13).flatten(1)).view_as(label_positions)
    assert full_out.correct.tolist() == ((labels == 0) & counted).sum(dim=(0, 1)).tolist()
    assert out.correct.tolist() == ((labels == 1) & counted).sum(dim=(0, 1)).tolist()
    assert out.counted.tolist() == full_out.counted.tolist() == counted.sum(dim=(0, 1)).tolist()
    assert 0 < out.correct.sum() < out.counted.sum()
    torch.testing.assert_close(out.loss, torch.tensor(math.log(VOCAB // 2)))  # uniform over the K = 48 ids


def test_distilling_a_one_hot_teacher_of_the_labels_is_the_hard_loss():
    """A teacher whose top-1 is the label itself (the target's argmax, as in
    greedy data) gives the same loss as the labels; weight 0 is the hard loss
    exactly; a teacher elsewhere changes it."""
    torch.manual_seed(0)
    target = tiny_target()
    draft = DFlashDraftModel(DFlashConfig.from_dict(draft_config_dict(block_size=4)))
    tokens = torch.randint(0, VOCAB, (2, 14), generator=torch.Generator().manual_seed(3))
    inputs = _loss_inputs(draft, target, tokens)
    next_ids = torch.cat([tokens[:, 1:], torch.full((2, 1), -1)], dim=1)  # position p's next token
    one_hot = (next_ids[..., None], torch.where(next_ids[..., None] >= 0, 0.0, float("-inf")))
    with torch.no_grad():
        hard = dflash_loss(draft, target, *inputs, gamma=2.0)
        same = dflash_loss(draft, target, *inputs, gamma=2.0, teacher=one_hot, distill_weight=1.0)
        none = dflash_loss(draft, target, *inputs, gamma=2.0, teacher=one_hot, distill_weight=0.0)
        other = ((next_ids[..., None] + 1) % VOCAB, one_hot[1])
        moved = dflash_loss(draft, target, *inputs, gamma=2.0, teacher=other, distill_weight=0.5)
    torch.testing.assert_close(same.loss, hard.loss)
    assert torch.equal(none.loss, hard.loss)
    assert not torch.isclose(moved.loss, hard.loss)
    assert same.correct.tolist() == hard.correct.tolist()


def test_the_teacher_is_renormalised_over_the_draft_vocabulary():
    """Cross-entropy against a two-token teacher: inside a reduced vocabulary
    only the token the draft can propose keeps the mass; a teacher wholly
    outside it has nothing to teach."""
    draft = DFlashDraftModel(DFlashConfig.from_dict(draft_config_dict(block_size=4)))
    draft.set_draft_vocab(torch.tensor([0, 2, 4]))
    logits = torch.randn(1, 1, 3, 3)
    positions = torch.tensor([[[0, 1, 2]]])
    ids = torch.tensor([[[2, 3], [1, 3], [4, 0]]])  # position 1: no id in the vocabulary
    logprobs = torch.log(torch.tensor([[[0.7, 0.3], [0.6, 0.4], [0.5, 0.5]]]))
    ce, known = teacher_cross_entropy(draft, logits, (ids, logprobs), positions)
    log_q = torch.log_softmax(logits[0, 0], dim=-1)
    assert known.tolist() == [[[True, False, True]]]
    torch.testing.assert_close(ce[0, 0, 0], -log_q[0, 1])  # token 2 = draft index 1, renormalised to 1
    torch.testing.assert_close(ce[0, 0, 2], -(0.5 * log_q[2, 2] + 0.5 * log_q[2, 0]))


def test_frequent_token_ids_and_coverage():
    records = [([9, 9, 5, 5, 5, 3, 3], 2), ([8, 7, 7, 1], 1)]  # responses: 5 5 5 3 3 | 7 7 1
    tokens = list(response_tokens(records))
    assert tokens == [5, 5, 5, 3, 3, 7, 7, 1]
    assert frequent_token_ids(tokens, 3, vocab_size=10).tolist() == [3, 5, 7]
    assert frequent_token_ids(tokens, 2, vocab_size=10).tolist() == [3, 5]  # 3 and 7 tie: the smaller id
    assert frequent_token_ids(tokens, 3, vocab_size=10, always=[0]).tolist() == [0, 3, 5]
    assert frequent_token_ids(tokens, 6, vocab_size=10).tolist() == [0, 1, 2, 3, 5, 7]  # unseen ids fill up by id
    assert token_coverage(tokens, torch.tensor([0, 3, 5]), vocab_size=10) == 5 / 8
    for bad in (dict(k=0), dict(k=11), dict(k=1, always=[0, 1]), dict(k=2, always=[10])):
        with pytest.raises(ValueError):
            frequent_token_ids(tokens, **{"vocab_size": 10, **bad})


def test_draft_training_with_a_reduced_vocabulary_writes_the_map(tiny_pipeline, tmp_path):
    """``dflash-train draft --draft-vocab-size K``: the trained draft's checkpoint
    holds the K most frequent response tokens (stop tokens included), the
    summary their coverage, the model card counts no id as a parameter; it
    decodes losslessly, and training started from it keeps the map."""
    root, _, _ = tiny_pipeline
    common = dict(target_dir=root / "target", data=(root / "data.jsonl",), block_size=4, batch_size=4, epochs=0.5)
    main(
        [
            "draft",
            "--target",
            str(root / "target"),
            "--data",
            str(root / "data.jsonl"),
            "--out",
            str(tmp_path / "a"),
            "--run-dir",
            str(tmp_path / "ra"),
            "--block-size",
            "4",
            "--batch-size",
            "4",
            "--epochs",
            "0.5",
            "--draft-vocab-size",
            "16",
        ]
    )
    summary = json.loads((tmp_path / "a" / "training.json").read_text())
    records = load_records([root / "data.jsonl"], 768)
    stops = stop_token_ids(AutoTokenizer.from_pretrained(str(root / "target")))
    expected = frequent_token_ids(response_tokens(records), 16, vocab_size=320, always=stops)
    draft = load_draft(tmp_path / "a")
    assert torch.equal(draft.draft_vocab_ids, expected) and set(stops) <= set(expected.tolist())
    assert json.loads((tmp_path / "a" / "config.json").read_text())["dflash_config"]["draft_vocab_size"] == 16
    coverage = token_coverage(response_tokens(records), expected, vocab_size=320)
    assert summary["draft_vocab"] == {"size": 16, "response_token_coverage": round(coverage, 4)} and coverage > 0
    assert parameter_count(tmp_path / "a") == sum(p.numel() for p in draft.parameters())
    assert "DFlash draft" in (tmp_path / "a" / "README.md").read_text()
    target = TargetModel.from_pretrained(root / "target")
    prompt = records[0][0][: records[0][1]]
    greedy = spec_generate(target, None, [prompt], DecodeConfig(1, 20)).tokens
    assert spec_generate(target, draft, [prompt], DecodeConfig(4, 20)).tokens == greedy
    train_draft(
        DraftTrainConfig(out_dir=tmp_path / "b", run_dir=tmp_path / "rb", init_from=str(tmp_path / "a"), **common)
    )
    assert torch.equal(load_draft(tmp_path / "b").draft_vocab_ids, expected)


def test_growing_carries_the_draft_vocabulary():
    source = tiny_draft(layers=1, seed=3)
    source.set_draft_vocab(torch.arange(0, VOCAB, 2))
    grown = DFlashDraftModel(DFlashConfig.from_dict(draft_config_dict(layers=2))).float().eval()
    grow_from(grown, source)
    assert torch.equal(grown.draft_vocab_ids, source.draft_vocab_ids) and grown.config.draft_vocab_size == VOCAB // 2
    other = DFlashDraftModel(DFlashConfig.from_dict(draft_config_dict(layers=2)))
    other.set_draft_vocab(torch.arange(1, VOCAB, 2))
    with pytest.raises(ValueError, match="has its own draft vocabulary"):
        grow_from(other, source)
    full_source, reduced = tiny_draft(layers=1), DFlashDraftModel(DFlashConfig.from_dict(draft_config_dict(layers=2)))
    reduced.set_draft_vocab(torch.arange(5))
    grow_from(reduced, full_source)  # a full-vocabulary source: the draft keeps its own map
    assert reduced.draft_vocab_ids.tolist() == [0, 1, 2, 3, 4]


def test_each_rerun_gets_the_whole_time_limit(tmp_path):
    """The limit is per run of the command: a checkpoint that already holds an
    hour of training does not stop the next 50-minute chunk at its first step."""
    model = torch.nn.Linear(2, 2)

    def run() -> ResumableRun:
        return ResumableRun(
            tmp_path / "checkpoint.pt",
            {"model": model},
            torch.Generator(),
            total_steps=10,
            checkpoint_every=1,
            time_limit_minutes=50,
            name="t",
        )

    first = run()
    first.state["seconds"] = 3600.0
    first.advance()
    first.save()
    assert not run().out_of_time()
