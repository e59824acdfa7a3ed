"""Strict checkpoint loading: the real 446 names at tiny widths, exact logits, and every kind of mismatch."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.config import ConfigError, ModelConfig
from runtime.model import MossSpeechForCausalLM, build_model
from runtime.weights import INDEX_FILE, SINGLE_FILE, CheckpointError, load_pretrained, save_checkpoint

ROWS = [(151644, 512), (104, 512), (151646, 512), (151667, 33), (151667, 16384), (7, 9)]
SMALL = ModelConfig.preset("tiny").replace(num_shared_layers=2, num_modality_layers=1)


@pytest.fixture(scope="module")
def tiny_model() -> MossSpeechForCausalLM:
    return build_model(ModelConfig.preset("tiny"), seed=3)


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("small")
    save_checkpoint(build_model(SMALL, seed=4), path)
    return path


def mutated_copy(src: Path, dst: Path, edit) -> Path:
    """Copy a single-file checkpoint, applying `edit` to its tensor dict."""
    dst.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    tensors = load_file(str(src / SINGLE_FILE))
    edit(tensors)
    save_file(tensors, str(dst / SINGLE_FILE))
    return dst


def test_full_layout_has_the_446_checkpoint_names(tiny_model: MossSpeechForCausalLM) -> None:
    names = set(tiny_model.state_dict())
    assert len(names) == 446
    expected = {"model.embed_tokens.weight", "model.audio_embed.weight", "model.text_norm.weight",
                "model.audio_norm.weight", "text_lm_head.weight", "audio_lm_head.weight"}
    per_layer = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight"]
    for block, count in (("shared_block", 32), ("text_block", 4), ("audio_block", 4)):
        for i in range(count):
            expected |= {f"model.{block}.layers.{i}.{p}" for p in per_layer}
    assert names == expected
    sd = tiny_model.state_dict()
    assert sd["model.shared_block.layers.0.self_attn.q_norm.weight"].shape == (16,)
    assert sd["model.shared_block.layers.0.self_attn.k_proj.weight"].shape == (32, 64)
    assert sd["model.audio_embed.weight"].shape == (16512, 64)
    assert sd["text_lm_head.weight"].data_ptr() != sd["model.embed_tokens.weight"].data_ptr()


@pytest.mark.parametrize("num_shards", [1, 3])
def test_round_trip_reproduces_logits_exactly(
    tiny_model: MossSpeechForCausalLM, tmp_path: Path, num_shards: int
) -> None:
    save_checkpoint(tiny_model, tmp_path, num_shards=num_shards)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "moss_speech" and config["architectures"] == ["MossSpeechForCausalLM"]
    assert config["num_hidden_layers"] == 36 and config["rope_theta"] == 1e6
    if num_shards == 1:
        assert (tmp_path / SINGLE_FILE).is_file() and not (tmp_path / INDEX_FILE).exists()
    else:
        index = json.loads((tmp_path / INDEX_FILE).read_text())
        assert len(index["weight_map"]) == 446
        assert sorted(set(index["weight_map"].values())) == [
            f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)
        ]
    model, tokenizer = load_pretrained(tmp_path, device="cpu", dtype=torch.float32, progress=False)
    assert model.config == tiny_model.config
    assert tokenizer.token_to_id("<|im_end|>") == 151645
    assert not any(p.requires_grad or p.is_meta for p in model.parameters())
    expected_text, expected_audio = tiny_model.reference_forward(ROWS)
    text, audio = model.reference_forward(ROWS)
    assert torch.equal(text, expected_text) and torch.equal(audio, expected_audio)


def test_load_casts_to_the_requested_dtype(small_checkpoint: Path) -> None:
    model, _ = load_pretrained(small_checkpoint, device="cpu", dtype=torch.bfloat16, progress=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    reference, _ = load_pretrained(small_checkpoint, device="cpu", dtype=torch.float32, progress=False)
    text, audio = model.reference_forward(ROWS)
    ref_text, ref_audio = reference.reference_forward(ROWS)
    assert text.dtype == torch.float32 and audio.dtype == torch.float32
    torch.testing.assert_close(text, ref_text, atol=0.03, rtol=0)  # bf16 weights: measured max error ~0.006
    torch.testing.assert_close(audio, ref_audio, atol=0.03, rtol=0)  # bf16 weights: measured max error ~0.006


def test_renamed_tensor_is_rejected(small_checkpoint: Path, tmp_path: Path) -> None:
    def rename(t: dict) -> None:
        t["model.text_block.layers.0.mlp.gate.weight"] = t.pop("model.text_block.layers.0.mlp.gate_proj.weight")

    path = mutated_copy(small_checkpoint, tmp_path / "ckpt", rename)
    with pytest.raises(CheckpointError) as info:
        load_pretrained(path, device="cpu", dtype=torch.float32, progress=False)
    message = str(info.value)
    assert "missing keys: model.text_block.layers.0.mlp.gate_proj.weight (1 in all)" in message
    assert "unexpected keys: model.text_block.layers.0.mlp.gate.weight (1 in all)" in message


def test_missing_tensor_is_rejected(small_checkpoint: Path, tmp_path: Path) -> None:
    path = mutated_copy(small_checkpoint, tmp_path / "ckpt", lambda t: t.pop("audio_lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"missing keys: audio_lm_head.weight \(1 in all\)$"):
        load_pretrained(path, device="cpu", dtype=torch.float32, progress=False)


def test_extra_tensors_are_rejected_and_listed_sorted(small_checkpoint: Path, tmp_path: Path) -> None:
    def add(t: dict) -> None:
        for i in range(7):
            t[f"model.extra.{i}"] = torch.zeros(2)

    path = mutated_copy(small_checkpoint, tmp_path / "ckpt", add)
    with pytest.raises(CheckpointError) as info:
        load_pretrained(path, device="cpu", dtype=torch.float32, progress=False)
    assert str(info.value).endswith(
        "unexpected keys: model.extra.0, model.extra.1, model.extra.2, model.extra.3, model.extra.4, ... (7 in all)"
    )


def test_wrong_shape_is_rejected(small_checkpoint: Path, tmp_path: Path) -> None:
    def reshape(t: dict) -> None:
        t["model.shared_block.layers.1.self_attn.k_norm.weight"] = torch.ones(8)

    path = mutated_copy(small_checkpoint, tmp_path / "ckpt", reshape)
    with pytest.raises(CheckpointError, match=rf"^{path}: wrong tensor shapes \(1\): model.shared_block.layers.1."
                       r"self_attn.k_norm.weight in model.safetensors: checkpoint \[8\] vs model \[16\]$"):
        load_pretrained(path, device="cpu", dtype=torch.float32, progress=False)


def test_missing_weights_file_and_missing_shard(small_checkpoint: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_bytes((small_checkpoint / "config.json").read_bytes())
    (empty / "tokenizer.json").write_bytes((small_checkpoint / "tokenizer.json").read_bytes())
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        load_pretrained(empty, device="cpu", dtype=torch.float32, progress=False)
    sharded = tmp_path / "sharded"
    save_checkpoint(build_model(SMALL, seed=4), sharded, num_shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors listed in .* is missing"):
        load_pretrained(sharded, device="cpu", dtype=torch.float32, progress=False)


def test_a_key_stored_in_two_shards_names_both_files(tmp_path: Path) -> None:
    save_checkpoint(build_model(SMALL, seed=4), tmp_path, num_shards=2)
    first, second = (tmp_path / f"model-0000{i}-of-00002.safetensors" for i in (1, 2))
    key = min(load_file(str(first)))
    save_file({**load_file(str(second)), key: load_file(str(first))[key]}, str(second))
    with pytest.raises(CheckpointError, match=rf"^{tmp_path}: keys stored in more than one file: {key} "
                                              rf"\({first.name} and {second.name}\) \(1 in all\)$"):
        load_pretrained(tmp_path, device="cpu", dtype=torch.float32, progress=False)


def test_tensors_that_are_not_floating_point_are_rejected_by_name(small_checkpoint: Path, tmp_path: Path) -> None:
    """An integer, bool or FP8 tensor would be cast to garbage: refused, named (floats of any width load)."""
    def retype(t: dict) -> None:
        t["model.text_norm.weight"] = t["model.text_norm.weight"].bool()
        down = "model.shared_block.layers.0.mlp.down_proj.weight"
        t[down] = (t[down] * 1000).to(torch.int64)
        t["model.audio_norm.weight"] = t["model.audio_norm.weight"].half()  # a float: cast, fine

    path = mutated_copy(small_checkpoint, tmp_path / "ckpt", retype)
    with pytest.raises(CheckpointError, match=rf"^{path}: tensors of a type other than BF16, F16, F32 \(2\): "
                       r"model.shared_block.layers.0.mlp.down_proj.weight in model.safetensors: I64; "
                       r"model.text_norm.weight in model.safetensors: BOOL$"):
        load_pretrained(path, device="cpu", dtype=torch.float32, progress=False)


@pytest.mark.parametrize("shard", ["../elsewhere.safetensors", "/tmp/elsewhere.safetensors", "sub/x.safetensors",
                                   ".."])
def test_a_shard_index_naming_a_file_outside_the_folder_is_rejected(small_checkpoint: Path, tmp_path: Path,
                                                                     shard: str) -> None:
    path = tmp_path / "sharded"
    save_checkpoint(build_model(SMALL, seed=4), path, num_shards=2)
    index = json.loads((path / INDEX_FILE).read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = shard
    (path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"names '{shard}': shard files must be plain names in the folder"):
        load_pretrained(path, device="cpu", dtype=torch.float32, progress=False)


def test_a_truncated_shard_or_a_malformed_index_is_a_checkpoint_error(small_checkpoint: Path, tmp_path: Path) -> None:
    path = tmp_path / "sharded"
    save_checkpoint(build_model(SMALL, seed=4), path, num_shards=2)
    index = (path / INDEX_FILE).read_text()
    (path / INDEX_FILE).write_text(json.dumps({"weight_map": ["model-00001-of-00002.safetensors"]}))
    with pytest.raises(CheckpointError, match="weight_map must map tensor names to file names"):
        load_pretrained(path, device="cpu", dtype=torch.float32, progress=False)
    (path / INDEX_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json is not valid JSON"):
        load_pretrained(path, device="cpu", dtype=torch.float32, progress=False)
    (path / INDEX_FILE).write_text(index)
    shard = path / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors is not a readable safetensors file"):
        load_pretrained(path, device="cpu", dtype=torch.float32, progress=False)


def test_config_json_must_be_an_object_and_keep_the_runtimes_special_ids(small_checkpoint: Path,
                                                                         tmp_path: Path) -> None:
    good = ModelConfig.preset("full").to_hf_dict()
    with pytest.raises(ConfigError, match=r"sosp_token_id 151650 is not the id this runtime uses \(151646\)"):
        ModelConfig.from_hf_dict({**good, "sosp_token_id": 151650})
    with pytest.raises(ConfigError, match=r"eosp_token_id 16000 is not the id this runtime uses \(16384\)"):
        ModelConfig.from_hf_dict({**good, "eosp_token_id": 16000})
    with pytest.raises(ConfigError, match="config.json must hold a JSON object, got list"):
        ModelConfig.from_hf_dict([good])  # type: ignore[arg-type]
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="config.json is not valid JSON"):
        ModelConfig.from_pretrained_dir(folder)


def test_config_layer_count_and_model_type_are_validated() -> None:
    good = ModelConfig.preset("full").to_hf_dict()
    assert ModelConfig.from_hf_dict(good) == ModelConfig.preset("full")
    assert ModelConfig.preset("full").num_layer_instances == 40
    with pytest.raises(ConfigError, match=r"num_shared_layers \(32\) \+ num_modality_layers \(4\) != "
                       r"num_hidden_layers \(40\)"):
        ModelConfig.from_hf_dict({**good, "num_hidden_layers": 40})
    with pytest.raises(ConfigError, match="unsupported model_type 'qwen3'"):
        ModelConfig.from_hf_dict({**good, "model_type": "qwen3"})
    with pytest.raises(ConfigError, match="lacks required fields: rope_theta"):
        ModelConfig.from_hf_dict({k: v for k, v in good.items() if k != "rope_theta"})
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        ModelConfig.from_hf_dict({**good, "tie_word_embeddings": True})
    with pytest.raises(ConfigError, match="unknown model preset 'huge'"):
        ModelConfig.preset("huge")


def test_loaded_weights_own_their_memory_not_the_files(tmp_path: Path, zero_tensor_bytes) -> None:
    """On CPU, safetensors hands back views of the file's mapping when no cast is needed: a checkpoint
    rewritten in place (a new download over the old one) changed the live model, a truncated one crashed it."""
    save_checkpoint(build_model(SMALL, seed=4), tmp_path)
    model, _ = load_pretrained(tmp_path, device="cpu", dtype=torch.float32, progress=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    weights = tmp_path / SINGLE_FILE
    zero_tensor_bytes(weights)
    assert not load_file(str(weights))["model.audio_norm.weight"].any()  # the file did change
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_mapped_loading_leaves_the_weights_in_the_files_mappings(tmp_path: Path, zero_tensor_bytes) -> None:
    """`mapped=True` (FP8 staging) keeps tensors stored in the load dtype as views of the file: the same values
    as a copying load, and they follow the file (here zeroed in place), so the process holds no copy of them.
    A cast still copies; a device other than the CPU is refused."""
    save_checkpoint(build_model(SMALL, seed=4), tmp_path)
    copied, _ = load_pretrained(tmp_path, device="cpu", dtype=torch.float32, progress=False)
    mapped, _ = load_pretrained(tmp_path, device="cpu", dtype=torch.float32, progress=False, mapped=True)
    cast, _ = load_pretrained(tmp_path, device="cpu", dtype=torch.bfloat16, progress=False, mapped=True)
    want = copied.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in mapped.state_dict().items())
    assert all(torch.equal(v, want[k].to(torch.bfloat16)) for k, v in cast.state_dict().items())
    zero_tensor_bytes(tmp_path / SINGLE_FILE)
    assert all(not v.any() for v in mapped.state_dict().values())
    assert all(torch.equal(v, want[k].to(torch.bfloat16)) for k, v in cast.state_dict().items())
    with pytest.raises(ValueError, match="mapped loading keeps the tensors in the files' mappings, on the CPU; "
                                         "device is meta"):
        load_pretrained(tmp_path, device="meta", dtype=torch.float32, progress=False, mapped=True)


def test_config_refuses_booleans_for_float_fields_and_other_attention_shapes() -> None:
    good = ModelConfig.preset("full").to_hf_dict()
    for name in ("rope_theta", "rms_norm_eps"):
        with pytest.raises(ConfigError, match=f"{name} must be a finite positive number, got True"):
            ModelConfig.from_hf_dict({**good, name: True})
    with pytest.raises(ConfigError, match="use_sliding_window=true is not supported"):
        ModelConfig.from_hf_dict({**good, "use_sliding_window": True, "sliding_window": 4096})
    with pytest.raises(ConfigError, match="rope_parameters .* is not supported"):
        ModelConfig.from_hf_dict({**good, "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                              "rope_theta": good["rope_theta"]}})
    with pytest.raises(ConfigError, match="rope_parameters .* is not supported"):
        ModelConfig.from_hf_dict({**good, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    with pytest.raises(ConfigError, match="rope_parameters .* is not supported"):
        ModelConfig.from_hf_dict({**good, "rope_parameters": {"rope_theta": good["rope_theta"],
                                                              "partial_rotary_factor": 0.5}})
    # the plain forms a Qwen3 config.json carries stay accepted
    plain = {**good, "use_sliding_window": False, "sliding_window": None,
             "rope_parameters": {"rope_type": "default", "rope_theta": int(good["rope_theta"]),
                                 "partial_rotary_factor": 1.0}}
    assert ModelConfig.from_hf_dict(plain) == ModelConfig.preset("full")
