"""GGUF as a model source: ``polyrl models convert`` against transformers' own GGUF loading on the real
SmolLM2-135M-Instruct (the ``real_model_dir`` fixture), model blocks pointed at the converted folder, and the
bad inputs (a truncated file, an architecture transformers cannot dequantize, not a GGUF at all), each one line
naming the key and the file."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from polyrl.cli import main
from polyrl.config.roles import ModelConfig
from polyrl.errors import ConfigError
from polyrl.models.gguf import MARKER, file_sha256, inspect_gguf, supported_architectures
from polyrl.models.paths import check_model_paths
from polyrl.models.real import SMOLLM2

QUESTION = [{"role": "user", "content": "What is 7+8? Answer with the number only."}]


def _prompt_ids(tokenizer) -> list[int]:
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.timeout(300)  # about 35 s on 2 quiet cores
def test_convert_writes_a_folder_whose_logits_are_the_gguf_loaded_models(real_model_gguf, real_model_dir, tmp_path,
                                                                          capsys):
    """``polyrl models convert`` writes safetensors, tokenizer and chat template; the folder's logits equal those
    of the model transformers loads from the GGUF itself, and the folder equals the fixture's conversion."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "smol"
    assert main(["models", "convert", str(real_model_gguf), "--to", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", MARKER} <= names
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert json.loads((out / MARKER).read_text())["sha256"] == SMOLLM2.gguf_sha256

    tok = AutoTokenizer.from_pretrained(out)
    ids = _prompt_ids(tok)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n") and tok.eos_token == "<|im_end|>"
    gguf_model = AutoModelForCausalLM.from_pretrained(real_model_gguf.parent, gguf_file=real_model_gguf.name,
                                                      dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    batch = torch.tensor([ids])
    with torch.no_grad():
        expected, got = gguf_model(batch).logits, model(batch).logits
    assert got.shape == (1, len(ids), 49152)
    assert torch.equal(got, expected)
    # the fixture's folder (made by `make real-model`'s code) holds the same weights
    ours, fixture = load_file(out / "model.safetensors"), load_file(real_model_dir / "model.safetensors")
    assert sorted(ours) == sorted(fixture) and all(torch.equal(ours[k], fixture[k]) for k in ours)


def test_model_blocks_naming_a_gguf_point_at_its_converted_folder(real_model_gguf, real_model_dir, tmp_path,
                                                                  monkeypatch):
    """``path`` = the .gguf file, or a folder + ``gguf_file``: either way the block ends up on the cached HF
    folder (keyed by the file's sha256), before any worker reads it; an HF folder is left as it is."""
    monkeypatch.setenv("POLYRL_CACHE_DIR", str(tmp_path / "cache"))
    sha = file_sha256(real_model_gguf)
    cached = tmp_path / "cache" / "gguf" / f"{real_model_gguf.stem}-{sha[:12]}"
    cached.parent.mkdir(parents=True)
    shutil.copytree(real_model_dir, cached, copy_function=os.link)  # made earlier: a cache hit (hard links: read only)

    by_file = OmegaConf.structured(ModelConfig(path=str(real_model_gguf)))
    check_model_paths(by_file, "actor.model")
    assert by_file.path == str(cached) and by_file.gguf_file is None
    by_folder = OmegaConf.structured(ModelConfig(path=str(real_model_gguf.parent), gguf_file=real_model_gguf.name))
    check_model_paths(by_folder, "critic.model")
    assert by_folder.path == str(cached) and by_folder.gguf_file is None
    plain = OmegaConf.structured(ModelConfig(path=str(real_model_dir)))
    check_model_paths(plain, "ref.model")
    assert plain.path == str(real_model_dir)

    missing = OmegaConf.structured(ModelConfig(path=str(tmp_path / "nope.gguf")))
    with pytest.raises(ConfigError, match=r"^actor\.model\.path=.*nope\.gguf: no such GGUF file$"):
        check_model_paths(missing, "actor.model")


def test_a_truncated_gguf_is_one_line_naming_the_key(real_model_gguf, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("POLYRL_CACHE_DIR", str(tmp_path / "cache"))
    cut = tmp_path / "cut.gguf"
    with open(real_model_gguf, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(SMOLLM2.gguf_size // 2))
    block = OmegaConf.structured(ModelConfig(path=str(cut)))
    with pytest.raises(ConfigError) as err:
        check_model_paths(block, "actor.model")
    message = str(err.value)
    assert message.startswith(f"actor.model.path={cut}: the GGUF file is truncated") and "download it again" in message
    assert "\n" not in message and block.path == str(cut)
    assert main(["models", "convert", str(cut), "--to", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().startswith(f"polyrl models: error: FILE={cut}: the GGUF file is truncated")
    assert not (tmp_path / "out").exists()


def _write_gguf(path: Path, arch: str) -> None:
    """A small GGUF file of architecture ``arch`` written with gguf's own writer (one tensor)."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_name("made-in-a-test")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_an_architecture_transformers_cannot_dequantize_is_refused_with_the_list(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYRL_CACHE_DIR", str(tmp_path / "cache"))
    rwkv = tmp_path / "rwkv.gguf"
    _write_gguf(rwkv, "rwkv6")
    assert "rwkv6" not in supported_architectures() and "llama" in supported_architectures()
    block = OmegaConf.structured(ModelConfig(path=str(tmp_path), gguf_file="rwkv.gguf"))
    with pytest.raises(ConfigError) as err:
        check_model_paths(block, "actor.model")
    message = str(err.value)
    assert message.startswith(f"actor.model.gguf_file={rwkv}: GGUF architecture 'rwkv6' cannot be dequantized")
    assert "llama" in message and "qwen2" in message and "\n" not in message
    llama = tmp_path / "llama.gguf"
    _write_gguf(llama, "llama")
    assert inspect_gguf(llama).architecture == "llama"  # a supported architecture passes the header check


def test_a_file_that_is_not_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYRL_CACHE_DIR", str(tmp_path / "cache"))
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ConfigError, match=r"^reward_model\.model\.path=.*model\.gguf is not a GGUF file"):
        check_model_paths(OmegaConf.structured(ModelConfig(path=str(fake))), "reward_model.model")


def test_models_convert_usage(capsys):
    with pytest.raises(SystemExit):
        main(["models", "convert", "x.gguf"])  # --to is required
    assert "--to" in capsys.readouterr().err


def test_without_the_gguf_package_a_gguf_path_names_the_extra(tmp_path, monkeypatch):
    import sys

    llama = tmp_path / "llama.gguf"
    _write_gguf(llama, "llama")
    monkeypatch.setenv("POLYRL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "gguf", None)  # what Python does for a module that is not installed
    with pytest.raises(ConfigError, match=r"^actor\.model\.path=.*needs the 'gguf' package: pip install 'polyrl\[gguf\]'$"):
        check_model_paths(OmegaConf.structured(ModelConfig(path=str(llama))), "actor.model")
