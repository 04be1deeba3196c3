import json

import pytest
import torch
from builders import draft_config_dict, random_prompts, tiny_draft, tiny_target
from safetensors import safe_open
from safetensors.torch import save_file

from speculative.checkpoint import CheckpointError, load_draft, save_draft
from speculative.decode import DecodeConfig, spec_generate
from speculative.sampling import SamplingParams

OFFICIAL_LAYER_NAMES = [
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]


def official_tensors(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, head_dim: int = 16):
    """Tensors named and shaped as in a published DFlash checkpoint, written by hand."""
    g = torch.Generator().manual_seed(7)
    shapes = {"fc.weight": (hidden, 2 * hidden), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                p + "self_attn.q_norm.weight": (head_dim,),
                p + "self_attn.k_norm.weight": (head_dim,),
                p + "mlp.gate_proj.weight": (128, hidden),
                p + "mlp.up_proj.weight": (128, hidden),
                p + "mlp.down_proj.weight": (hidden, 128),
            }
        )
    return {name: torch.randn(shape, generator=g) * 0.1 for name, shape in shapes.items()}


def write_official(path, tensors, config=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or draft_config_dict()))
    save_file(tensors, str(path / "model.safetensors"))


def test_state_dict_uses_exactly_the_official_names():
    names = set(tiny_draft().state_dict())
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    expected |= {f"layers.{i}.{n}" for i in range(2) for n in OFFICIAL_LAYER_NAMES}
    assert names == expected


def test_handwritten_official_checkpoint_loads_and_runs(tmp_path):
    tensors = official_tensors()
    write_official(tmp_path, tensors)
    draft = load_draft(tmp_path)
    for name, tensor in tensors.items():
        assert torch.equal(draft.state_dict()[name], tensor)
    target = tiny_target()
    prompts = random_prompts(3, seed=1)
    result = spec_generate(target, draft, prompts, DecodeConfig(block_size=8, max_new_tokens=12))
    assert [len(t) for t in result.tokens] == [12, 12, 12]


def test_save_load_round_trip_is_bit_identical(tmp_path):
    draft = tiny_draft(seed=3)
    save_draft(draft, tmp_path)
    loaded = load_draft(tmp_path)
    original, reloaded = draft.state_dict(), loaded.state_dict()
    assert original.keys() == reloaded.keys()
    for name in original:
        assert torch.equal(original[name], reloaded[name]), name
    assert json.loads((tmp_path / "config.json").read_text())["dflash_config"]["mask_token_id"] == draft.mask_token_id
    target = tiny_target()
    prompts = random_prompts(2, seed=2)
    config = DecodeConfig(block_size=4, max_new_tokens=10)
    assert spec_generate(target, draft, prompts, config).tokens == spec_generate(target, loaded, prompts, config).tokens


def test_a_draft_saved_in_bf16_loads_as_the_draft_cast_to_bf16(tmp_path):
    draft = tiny_draft(seed=3)
    draft.set_draft_vocab(torch.arange(0, 64, 2))
    save_draft(draft, tmp_path, dtype=torch.bfloat16)
    full = tmp_path / "full"
    save_draft(draft, full)
    assert (tmp_path / "model.safetensors").stat().st_size < 0.6 * (full / "model.safetensors").stat().st_size
    loaded = load_draft(tmp_path, dtype=torch.bfloat16)
    expected = {name: t.to(torch.bfloat16) if t.is_floating_point() else t for name, t in draft.state_dict().items()}
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert loaded.state_dict()["draft_vocab_ids"].dtype == torch.int64


def test_sharded_checkpoint_loads(tmp_path):
    tensors = official_tensors()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(tmp_path / file))
        weight_map.update(dict.fromkeys(shard_names, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(draft_config_dict()))
    draft = load_draft(tmp_path)
    assert all(torch.equal(draft.state_dict()[n], t) for n, t in tensors.items())
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_draft(tmp_path)


def test_missing_tensor_is_named(tmp_path):
    tensors = official_tensors()
    del tensors["layers.1.self_attn.k_norm.weight"]
    write_official(tmp_path, tensors)
    with pytest.raises(CheckpointError, match=r"missing tensors \['layers.1.self_attn.k_norm.weight'\]"):
        load_draft(tmp_path)


def test_extra_tensor_is_named(tmp_path):
    tensors = official_tensors()
    tensors["embed_tokens.weight"] = torch.zeros(96, 64)
    write_official(tmp_path, tensors)
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['embed_tokens.weight'\]"):
        load_draft(tmp_path)


def test_misshaped_tensor_is_named(tmp_path):
    tensors = official_tensors()
    tensors["fc.weight"] = torch.zeros(64, 3 * 64)
    write_official(tmp_path, tensors)
    with pytest.raises(CheckpointError, match=r"fc.weight: checkpoint \(64, 192\), model \(64, 128\)"):
        load_draft(tmp_path)


def test_no_weights_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(draft_config_dict()))
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        load_draft(tmp_path)


def test_draft_vocabulary_survives_save_and_load(tmp_path):
    """The map is saved as an int64 tensor next to the weights and the config
    records its size; the reloaded draft has both and drafts the same."""
    draft = tiny_draft(seed=3)
    ids = torch.tensor([0, 4, 5, 17, 30, 31, 60, 95])
    draft.set_draft_vocab(ids)
    save_draft(draft, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dflash_config"]["draft_vocab_size"] == 8
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        stored = f.get_tensor("draft_vocab_ids")
    assert stored.dtype == torch.int64 and torch.equal(stored, ids)
    loaded = load_draft(tmp_path)
    assert torch.equal(loaded.draft_vocab_ids, ids) and loaded.config.draft_vocab_size == 8
    assert not any(name == "draft_vocab_ids" for name, _ in loaded.named_parameters())
    target = tiny_target()
    hidden = torch.randn(2, 3, 64)
    with torch.inference_mode():
        torch.testing.assert_close(loaded.draft_logits(hidden, target), draft.draft_logits(hidden, target))
    prompts = random_prompts(3, seed=2)
    config = DecodeConfig(block_size=4, max_new_tokens=10, proposal="sample")
    rows = [SamplingParams(1.0, seed=i) for i in range(3)]
    assert (
        spec_generate(target, draft, prompts, config, rows).tokens
        == spec_generate(target, loaded, prompts, config, rows).tokens
    )


def test_official_checkpoint_keeps_the_full_head(tmp_path):
    write_official(tmp_path, official_tensors())
    draft = load_draft(tmp_path)
    assert draft.draft_vocab_ids is None and draft.config.draft_vocab_size is None
    target = tiny_target()
    hidden = torch.randn(2, 3, 64)
    with torch.inference_mode():
        assert torch.equal(draft.draft_logits(hidden, target), target.lm_head(hidden))


def with_vocab(size: int | None) -> dict:
    raw = draft_config_dict()
    if size is not None:
        raw["dflash_config"] = {**raw["dflash_config"], "draft_vocab_size": size}
    return raw


@pytest.mark.parametrize(
    ("ids", "size", "message"),
    [
        (torch.tensor([5, 2, 9]), 3, "sorted and distinct: id 2 at index 1 follows 5"),
        (torch.tensor([2, 5, 96]), 3, r"must lie in \[0, 96\)"),
        (torch.tensor([2, 5, 9, 11]), 3, "has 4 ids but the config's draft_vocab_size says 3"),
        (torch.tensor([2, 5, 9]), None, "has 3 ids but the config's draft_vocab_size declares none"),
        (None, 3, "declares draft_vocab_size 3 but no draft_vocab_ids"),
    ],
)
def test_corrupt_draft_vocabulary_is_refused(tmp_path, ids, size, message):
    tensors = official_tensors()
    if ids is not None:
        tensors["draft_vocab_ids"] = ids
    write_official(tmp_path, tensors, with_vocab(size))
    with pytest.raises(CheckpointError, match=message):
        load_draft(tmp_path)
