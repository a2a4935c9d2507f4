"""`sparsetune models path`: the HF-format folder other engines (SGLang) load."""

from __future__ import annotations

import json

from helpers import run

from sparsetune.models.registry import REGISTRY
from sparsetune.models.weights import _name_architecture


def test_a_random_weights_folder_holds_the_registered_config_only(tmp_path):
    proc = run("models", "path", "qwen3-8b", "--random-weights", "--json", env={"SPARSETUNE_MODELS": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    folder = tmp_path / "qwen3-8b-config"
    assert out == {"model": "qwen3-8b", "path": str(folder), "weights": False}
    assert sorted(p.name for p in folder.iterdir()) == ["config.json"]
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg == {**REGISTRY["qwen3-8b"].hf_config, "torch_dtype": "bfloat16"}
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["num_key_value_heads"] == 8


def test_the_embedded_model_is_a_loadable_hf_folder():
    proc = run("models", "path", "smollm2-135m")
    assert proc.returncode == 0, proc.stderr
    from pathlib import Path

    folder = Path(proc.stdout.strip())
    cfg = json.loads((folder / "config.json").read_text())
    # SGLang picks the model class from `architectures` (a GGUF-loaded config lacks it)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 30 and cfg["num_key_value_heads"] == 3
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()


def test_a_converted_copy_without_architectures_gets_it(tmp_path):
    f = tmp_path / "config.json"
    f.write_text(json.dumps({"model_type": "qwen2", "architectures": None, "hidden_size": 8}))
    _name_architecture(f)
    assert json.loads(f.read_text()) == {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 8}
    f.write_text(json.dumps({"model_type": "llama", "architectures": ["MyLlama"]}))
    _name_architecture(f)
    assert json.loads(f.read_text())["architectures"] == ["MyLlama"]  # kept
