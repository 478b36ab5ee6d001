"""`polyrl export` of a LoRA run both ways (merged weights, peft adapter), and the run's own train.log."""

from __future__ import annotations

import json

import pytest
import torch

from polyrl.cli import main
from polyrl.trainer.commands import train


def test_export_lora_merged_and_as_adapter(base_overrides, manifest_file, tiny_model, tmp_path, capfd):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    train(manifest_file, [], base_overrides + [
        "trainer.executor=local", "trainer.save_freq=2", "trainer.logger=[console,jsonl]",
        "actor.model.lora.rank=4", "actor.model.lora.alpha=8", "actor.optim.lr=1e-2"])
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_2"

    # the run's log file holds the console's step lines (and is appended to, not replaced, on resume)
    log_text = (run / "train.log").read_text()
    assert "polyrl.metrics: step 1:" in log_text and "polyrl.metrics: step 2:" in log_text

    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    assert main(["export", str(ckpt), "--to", str(merged), "actor.fsdp.export_max_shard_size=30KB"]) == 0
    assert main(["export", str(ckpt), "--to", str(adapter), "actor.fsdp.lora_export=adapter"]) == 0
    assert f"exported {ckpt} to {merged}" in capfd.readouterr().err

    assert (merged / "model.safetensors.index.json").exists() and len(list(merged.glob("model-*.safetensors"))) > 1
    assert (merged / "generation_config.json").exists()
    assert GenerationConfig.from_pretrained(merged).eos_token_id == GenerationConfig.from_pretrained(
        tiny_model).eos_token_id
    assert AutoTokenizer.from_pretrained(merged).get_vocab() == AutoTokenizer.from_pretrained(tiny_model).get_vocab()
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    assert not list(adapter.glob("model*.safetensors"))

    ids = torch.tensor([[3, 7, 11, 5, 9, 2]])
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        before = base(ids).logits
        by_merge = AutoModelForCausalLM.from_pretrained(merged)(ids).logits
        by_adapter = PeftModel.from_pretrained(base, adapter)(ids).logits
    assert not torch.allclose(by_merge, before, atol=1e-4)  # training moved the model
    assert torch.allclose(by_merge, by_adapter, atol=1e-5)


def test_export_names_a_bad_override(base_overrides, manifest_file, tmp_path, capfd):
    train(manifest_file, [], base_overrides + ["trainer.executor=local", "trainer.save_freq=2",
                                               "trainer.total_steps=1", "trainer.test_freq=0"])
    ckpt = tmp_path / "run" / "checkpoints" / "step_1"
    assert main(["export", str(ckpt), "--to", str(tmp_path / "out"), "actor.fsdp.lora_expor=adapter"]) == 2
    assert "actor.fsdp.lora_expor" in capfd.readouterr().err


@pytest.mark.parametrize("verb", ["train", "sft"])
def test_unreachable_hub_model_fails_before_workers(verb, base_overrides, manifest_file, tmp_path, capfd,
                                                    monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # what a machine without the Hub sees, without waiting on a timeout
    overrides = [o for o in base_overrides if not o.startswith("model.path=")] + ["model.path=org/not-here"]
    if verb == "sft":
        overrides = [o for o in overrides if o.startswith(("model.", "data.train_files", "trainer.run_dir"))]
        overrides += ["trainer.total_steps=1"]
    code = main([verb, "--manifest", str(manifest_file), *overrides])
    err = capfd.readouterr().err
    assert code == 2, err
    assert "actor.model.path=org/not-here is not a local folder" in err and "set actor.model.path=DIR" in err


def test_sft_cosine_schedule_log_file_and_export(tiny_model, arithmetic_files, manifest_file, tmp_path):
    """`polyrl sft` with the quickstart's schedule keys: the logged LRs are the old cosine-with-warmup formula's,
    the run has its train.log, and RUN_DIR/hf is a full save_pretrained folder."""
    import math

    from transformers import AutoModelForCausalLM

    from polyrl.data.synthetic import write_jsonl
    from polyrl.trainer.commands import sft

    rows = [json.loads(line) for line in arithmetic_files["train"].read_text().splitlines()]
    rows = [dict(r, response=str(r["reward_model"]["ground_truth"])) for r in rows]
    write_jsonl(rows, tmp_path / "sft.jsonl")
    sft(manifest_file, [], [f"model.path={tiny_model}", f"data.train_files=[{tmp_path / 'sft.jsonl'}]",
                            f"trainer.run_dir={tmp_path / 'sft'}", "trainer.executor=local", "trainer.total_steps=6",
                            "trainer.logger=[jsonl]", "data.train_batch_size=8", "data.max_prompt_length=32",
                            "data.max_response_length=6", "actor.optim.lr=1e-3", "actor.optim.lr_warmup_steps=2",
                            "actor.optim.lr_scheduler_type=cosine", "actor.optim.weight_decay=0.0"])
    run = tmp_path / "sft"
    lrs = [json.loads(line)["actor/lr"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    total, warmup = 6, 2
    old = [(s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup)))
           for s in range(total)]
    assert lrs == pytest.approx([1e-3 * f for f in old], rel=1e-12)
    assert (run / "train.log").exists()
    assert (run / "hf" / "generation_config.json").exists() and (run / "hf" / "tokenizer_config.json").exists()
    AutoModelForCausalLM.from_pretrained(run / "hf")


def test_step_lines_and_progress_bar_do_not_share_a_line(base_overrides, manifest_file, tmp_path):
    """`polyrl train` with the bar and the console logger: each step line is a line of its own on stderr."""
    import os
    import subprocess
    import sys

    overrides = [o for o in base_overrides if not o.startswith(("trainer.progress_bar", "trainer.logger"))]
    proc = subprocess.run([sys.executable, "-m", "polyrl", "train", "--manifest", str(manifest_file), *overrides,
                           "trainer.executor=local", "trainer.progress_bar=true", "trainer.logger=[console,jsonl]"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = [seg.rsplit("\r", 1)[-1] for seg in proc.stderr.split("\n") if "step 1:" in seg or "step 2:" in seg]
    assert len(shown) == 2 and all(line.startswith("step ") for line in shown), shown
    assert "polyrl train: 100%" in proc.stderr  # the bar was live meanwhile
