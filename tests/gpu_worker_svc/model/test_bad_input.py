"""Bad model inputs fail fast with an exception that names the file and what is wrong with it."""

from __future__ import annotations

import json
import multiprocessing as mp
import re
import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, Phi3Config, PreTrainedModel

from gpu_worker_svc.engine.model_runner import ModelRunner, RunnerConfig
from gpu_worker_svc.model.attention_metadata import StepBatch
from gpu_worker_svc.model.checkpoint import CheckpointError
from gpu_worker_svc.model.config import ModelConfigError
from gpu_worker_svc.model.loader import load_config, load_model
from gpu_worker_svc.model.parallel import TPGroup
from shardline.core.model_path import ModelNotFoundError, default_model_path
from tests.gpu_worker_svc.model.random_checkpoints import hf_logits, random_hf_model, write_gguf


@pytest.fixture(scope="module")
def tiny_model() -> PreTrainedModel:
    return random_hf_model(
        LlamaConfig(
            vocab_size=64,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        seed=5,
    )


@pytest.fixture
def hf_folder(tiny_model, tmp_path) -> Path:
    folder = tmp_path / "tiny-llama"
    tiny_model.save_pretrained(folder)
    return folder


@pytest.fixture
def gguf_file(tiny_model, tmp_path) -> Path:
    path = tmp_path / "tiny-llama.Q8_0.gguf"
    write_gguf(tiny_model, path, GGMLQuantizationType.Q8_0)
    return path


def names(path: Path, *problem: str) -> str:
    """A `match` pattern: the message names `path`, then each part of the problem, in order."""
    return ".*".join(map(re.escape, (str(path), *problem)))


def test_missing_path(tmp_path):
    path = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError, match=names(path, "not found")):
        ModelRunner(RunnerConfig(model=str(path)))


def test_folder_without_safetensors(hf_folder):
    (hf_folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=names(hf_folder, "no *.safetensors files")):
        load_config(hf_folder)


def test_folder_without_config_json(hf_folder):
    (hf_folder / "config.json").unlink()
    with pytest.raises(ModelConfigError, match=names(hf_folder / "config.json", "not found")):
        load_config(hf_folder)


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2)).save_pretrained(tmp_path)
    with pytest.raises(
        ModelConfigError,
        match=names(
            tmp_path / "config.json",
            "unsupported architecture",
            "GPT2LMHeadModel",
            "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM",
        ),
    ):
        load_config(tmp_path)


def _phi3_folder(tmp_path: Path, settings: dict) -> Path:
    """A tiny Phi-3 folder whose config.json then gets `settings`: written over the file, as a checkpoint
    from elsewhere may carry them, since transformers itself refuses some of them."""
    model = random_hf_model(
        Phi3Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            pad_token_id=0,
        )
    )
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **settings}))
    return tmp_path


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        pytest.param(
            {
                "max_position_embeddings": 1024,
                "rope_parameters": {
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "short_factor": [1.0] * 8,
                    "long_factor": [2.0] * 7,
                    "original_max_position_embeddings": 64,
                },
            },
            ("longrope long_factor must list 8 factors",),
            id="phi3-longrope-factors-short-of-head-dim",
        ),
        pytest.param(
            {"rope_parameters": {"rope_type": "ntk-by-parts", "rope_theta": 10000.0, "factor": 4.0}},
            ("rope_scaling type", "ntk-by-parts", "not supported", "dynamic, yarn"),
            id="unknown-rope-type",
        ),
        pytest.param(
            {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}},
            ("partial_rotary_factor 0.75", "not supported"),
            id="phi4-mini-partial-rotary",
        ),
        pytest.param({"hidden_act": "gelu"}, ("hidden_act", "gelu", "not supported"), id="activation"),
        pytest.param(
            {"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True},
            ("use_bidirectional_attention", "not supported"),
            id="gemma3-as-an-encoder",
        ),
    ],
)
def test_settings_no_family_computes_are_refused_at_load_naming_them(tmp_path, settings, problem):
    folder = _phi3_folder(tmp_path, settings)
    with pytest.raises(ModelConfigError, match=names(folder / "config.json", *problem)):
        load_model(folder, TPGroup())


@pytest.mark.parametrize("arch", ["gpt2", "phi3"])  # Phi-3 loads from safetensors only
def test_unsupported_gguf_architecture(tmp_path, arch):
    path = tmp_path / f"tiny-{arch}.gguf"
    writer = GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelConfigError, match=names(path, f"unsupported GGUF architecture '{arch}'", "llama")):
        load_config(path)


def test_tp_size_the_heads_do_not_divide_names_the_valid_sizes():
    """SmolLM2-135M has 9 heads and 3 KV heads: it splits 1 or 3 ways, and the runner says so before spawning."""
    with pytest.raises(ModelConfigError, match=r"invalid tensor-parallel size 2 .*valid sizes: 1, 3$"):
        load_config(default_model_path()).check_tp(2)
    before = set(mp.active_children())
    with pytest.raises(ModelConfigError, match="valid sizes: 1, 3"):
        ModelRunner(RunnerConfig(tp_size=2))
    assert set(mp.active_children()) == before


def test_truncated_safetensors(hf_folder):
    file = hf_folder / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=names(file, "corrupt or truncated safetensors file")):
        load_model(hf_folder, TPGroup())


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_failed_tp2_load_leaves_no_rank_behind_and_the_next_load_works(tiny_model, tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    tiny_model.save_pretrained(good)
    shutil.copytree(good, bad)
    file = bad / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    before = set(mp.active_children())
    with pytest.raises(CheckpointError, match=names(file, "truncated")):
        ModelRunner(RunnerConfig(model=str(bad), tp_size=2, num_blocks=8))
    assert set(mp.active_children()) == before

    # The failed runner must not leave this process in a process group: a retry starts a new one.
    runner = ModelRunner(RunnerConfig(model=str(good), tp_size=2, num_blocks=8))
    try:
        prompt = [5, 17, 42]
        logits = runner.execute(
            StepBatch(torch.tensor(prompt), torch.tensor([0]), torch.tensor([3]), torch.tensor([[0]]))
        )
    finally:
        runner.shutdown()
    assert (logits[0] - hf_logits(tiny_model, prompt)[-1]).abs().max().item() <= 1e-4


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda data: (1 << 40).to_bytes(8, "little") + data[8:],  # header length far past the end of the file
        lambda data: data[:8] + b"#" + data[9:],  # the JSON header no longer parses
    ],
    ids=["header-length", "header-json"],
)
def test_corrupt_safetensors_header(hf_folder, corrupt):
    file = hf_folder / "model.safetensors"
    file.write_bytes(corrupt(file.read_bytes()))
    with pytest.raises(CheckpointError, match=names(file, "corrupt or truncated safetensors file")):
        load_model(hf_folder, TPGroup())


def test_gguf_truncated_in_the_tensor_data(gguf_file):
    data = gguf_file.read_bytes()
    gguf_file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=names(gguf_file, "truncated GGUF file: tensor 'blk.")):
        load_config(gguf_file)


def test_gguf_truncated_in_the_header(gguf_file):
    gguf_file.write_bytes(gguf_file.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=names(gguf_file, "corrupt or truncated GGUF header")):
        load_config(gguf_file)


def test_default_model_cut_inside_its_vocabulary(tmp_path):
    """The default model's header holds a 49k-token vocabulary; 64 KiB ends in the middle of it."""
    cut = tmp_path / "SmolLM2-cut.gguf"
    with open(default_model_path(), "rb") as f:
        cut.write_bytes(f.read(64 << 10))
    with pytest.raises(CheckpointError, match=names(cut, "truncated")):
        load_config(cut)


@pytest.mark.parametrize("content", [b"", b"<html>404 Not Found</html>\n" * 4], ids=["empty", "html"])
def test_not_a_gguf_file_despite_its_suffix(tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=names(path, "not a GGUF file")):
        load_config(path)


def test_checkpoint_missing_a_tensor_names_it(hf_folder):
    file = hf_folder / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=names(hf_folder, "lacks 1 tensor", "model.layers.1.mlp.up_proj.weight")):
        load_model(hf_folder, TPGroup())


def test_gguf_missing_a_tensor_names_it(tiny_model, tmp_path):
    """llama.cpp names are mapped to HF ones, so the message uses the HF name."""
    path = tmp_path / "tiny-llama.gguf"
    write_gguf(tiny_model, path, GGMLQuantizationType.F16, omit={"model.layers.0.self_attn.k_proj.weight"})
    with pytest.raises(CheckpointError, match=names(path, "lacks 1 tensor", "model.layers.0.self_attn.k_proj.weight")):
        load_model(path, TPGroup())


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("vocab_size", 48, ".weight' has shape (64, 64), but the config implies (48, 64)"),
        (
            "num_key_value_heads",
            1,
            "'model.layers.0.self_attn.k_proj.weight' has shape (32, 64), but the config implies (16, 64)",
        ),
        ("num_hidden_layers", 1, "'model.layers.1."),
    ],
    ids=["vocab-smaller", "fewer-kv-heads", "fewer-layers"],
)
def test_config_that_disagrees_with_the_tensors(hf_folder, field, value, problem):
    """Each of these would load part of a tensor, or skip a layer, and then run: it must fail instead."""
    cfg = json.loads((hf_folder / "config.json").read_text())
    cfg[field] = value
    (hf_folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=names(hf_folder, problem)):
        load_model(hf_folder, TPGroup())


def test_index_listing_a_missing_shard(hf_folder, tiny_model):
    shutil.rmtree(hf_folder)
    tiny_model.save_pretrained(hf_folder, max_shard_size="100KB")
    shard = sorted(hf_folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=names(shard, "listed in the index is missing")):
        load_config(hf_folder)


def test_undamaged_folder_loads(hf_folder, tiny_model):
    """The control: the failures above come from the damage each test does, not from the fixture."""
    model = load_model(hf_folder, TPGroup())
    assert torch.equal(model.model.embed_tokens.weight, tiny_model.model.embed_tokens.weight)


@pytest.mark.parametrize(
    "config",
    [
        RunnerConfig(quantization="fp16", batch_invariant=True),
        RunnerConfig(onednn_weights=False, batch_invariant=True),
        RunnerConfig(dtype="bfloat16", batch_invariant=True),
    ],
)
def test_batch_invariance_is_refused_where_the_gemms_round_with_the_batch(config):
    with pytest.raises(ValueError, match="batch_invariant needs int8 or float32 oneDNN-packed weights"):
        ModelRunner(config)
