"""verl's GSM8K GRPO example as a verl user runs it, on the real pretrained SmolLM2-135M-Instruct.

The two commands of verl's quickstart: ``examples/data_preprocess/gsm8k.py --local_dataset_path ...`` on local
GSM8K files, then ``polyrl train`` (for ``python3 -m verl.trainer.main_ppo``) with the overrides of verl's
``examples/grpo_trainer/run_qwen2-7b.sh``, only the model path and the sizes changed for a CPU (and the hf
rollout for vLLM). The prompts go through the model's own ChatML template; the run trains, scores every sample
with verl's GSM8K reward and keeps the generations. GSM8K comes from the workspace's copy where there is one, else
from the subset the real-model quickstart ships.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from polyrl.rewards.functions import gsm8k_score
from polyrl.trainer.commands import train

ROOT = Path(__file__).resolve().parents[1]
ARR = "actor_rollout_ref"


def _gsm8k_folder(tmp_path: Path) -> Path:
    """A local GSM8K folder (``train.jsonl``, ``test.jsonl``), as a user downloads it."""
    full = ROOT.parent / "shared" / "data" / "gsm8k"
    if (full / "train.jsonl").exists():
        return full
    folder = tmp_path / "gsm8k"
    folder.mkdir()
    shipped = ROOT / "examples" / "quickstart-real" / "data"
    shutil.copy(shipped / "gsm8k_train_head600.jsonl", folder / "train.jsonl")
    shutil.copy(shipped / "gsm8k_test_head150.jsonl", folder / "test.jsonl")
    return folder


def verl_grpo_gsm8k(model: Path, data: Path) -> list[str]:
    """verl's run_qwen2-7b.sh overrides; a trailing comment gives verl's value where a size was changed."""
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}",
        "data.train_batch_size=2",  # 1024
        "data.max_prompt_length=512",
        "data.max_response_length=24",  # 1024
        "data.filter_overlong_prompts=True",
        "data.truncation=error",
        f"{ARR}.model.path={model}",  # Qwen/Qwen2-7B-Instruct
        f"{ARR}.actor.optim.lr=1e-6",
        f"{ARR}.model.use_remove_padding=True",
        f"{ARR}.actor.ppo_mini_batch_size=2",  # 256
        f"{ARR}.actor.ppo_micro_batch_size_per_gpu=4",  # 40
        f"{ARR}.actor.use_kl_loss=True",
        f"{ARR}.actor.kl_loss_coef=0.001",
        f"{ARR}.actor.kl_loss_type=low_var_kl",
        f"{ARR}.actor.entropy_coeff=0",
        f"{ARR}.model.enable_gradient_checkpointing=True",
        f"{ARR}.actor.fsdp_config.param_offload=False",
        f"{ARR}.actor.fsdp_config.optimizer_offload=False",
        f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu=4",  # 40
        f"{ARR}.rollout.tensor_model_parallel_size=1",  # 2
        f"{ARR}.rollout.name=hf",  # vllm
        f"{ARR}.rollout.gpu_memory_utilization=0.6",
        f"{ARR}.rollout.n=2",  # 5
        f"{ARR}.ref.log_prob_micro_batch_size_per_gpu=4",  # 40
        f"{ARR}.ref.fsdp_config.param_offload=True",
        "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0",
        "trainer.logger=[console,file]",  # console, wandb
        "trainer.project_name=verl_grpo_example_gsm8k",
        "trainer.experiment_name=smollm2_135m_function_rm",
        "trainer.n_gpus_per_node=1",  # 8
        "trainer.nnodes=1",
        "trainer.save_freq=-1",  # 20: a 1.6 GB checkpoint of weights and optimizer is no part of this test
        "trainer.test_freq=5",
        "trainer.total_epochs=15",
    ]


@pytest.mark.timeout(600)
def test_verl_gsm8k_grpo_example_trains_the_real_model(real_model_dir, tmp_path):
    # 1. verl's preprocessing command, with verl's flags, on the local files
    data = tmp_path / "data" / "gsm8k"
    subprocess.run([sys.executable, str(ROOT / "examples" / "data_preprocess" / "gsm8k.py"),
                    "--local_dataset_path", str(_gsm8k_folder(tmp_path)), "--local_save_dir", str(data)], check=True)
    assert (data / "train.parquet").exists() and (data / "test.parquet").exists()

    # 2. verl's GRPO overrides, cut to one step of 2 prompts x 2 samples and 2 validation prompts
    run = tmp_path / "run"
    train(ROOT / "examples" / "quickstart" / "polyrl.toml", [], verl_grpo_gsm8k(real_model_dir, data) + [
        "trainer.total_training_steps=1", "data.val_max_samples=2", "trainer.rollout_data_dir=rollouts",
        f"trainer.default_local_dir={run}", "+trainer.executor=local", "+trainer.progress_bar=false"])

    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step1 = next(m for m in metrics if m["step"] == 1)
    assert step1["actor/grad_norm"] > 0  # it trained: a gradient through the real model
    assert "actor/kl_loss" in step1  # verl's use_kl_loss: the reference model took part

    # rewards: each kept sample scored by verl's GSM8K rule (strict "#### N") on its own response text
    rows = [json.loads(line) for line in (run / "rollouts" / "1.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and len({r["uid"] for r in rows}) == 2
    for row in rows:
        assert row["prompt"].startswith("<|im_start|>system\n") and row["prompt"].endswith("<|im_start|>assistant\n")
        assert 'output the final answer after "####".<|im_end|>' in row["prompt"]
        assert row["response"] and row["data_source"] == "openai/gsm8k"
        text = row["response"].removesuffix("<|im_end|>")
        assert row["score"] == gsm8k_score("openai/gsm8k", text, row["ground_truth"])["score"]
    assert step1["critic/score/mean"] == pytest.approx(sum(r["score"] for r in rows) / len(rows))
    # validation before training (verl's val_before_train) and after the last step, generations kept
    val = [json.loads(line) for line in (run / "generations" / "validation" / "0.jsonl").read_text().splitlines()]
    assert len(val) == 2 and all(r["response"] for r in val)
    assert any("val/openai/gsm8k/mean@1" in m for m in metrics)
