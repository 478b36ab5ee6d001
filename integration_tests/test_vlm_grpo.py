"""Vision-language GRPO end to end: a tiny Qwen2-VL (built in code) learns a visual task with `polyrl sft` and
`polyrl train`, against a control run whose images are shuffled across rows (so the test fails when the
images are ignored); and a run on two Ray workers with text and image rows mixed."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from polyrl.errors import DataError
from polyrl.trainer.commands import sft, train

COMMON = ["data.max_prompt_length=40", "data.max_response_length=6", "trainer.logger=[jsonl]",
          "trainer.progress_bar=false"]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def colour_task(tmp_path_factory):
    """Red or blue squares: the training rows, the same rows with their images shuffled across rows, and a tiny
    Qwen2-VL warmed up by SFT on the *shuffled* rows (it learns to answer 'red' or 'blue', not which)."""
    from polyrl.data.synthetic import make_shape_rows, write_jsonl
    from polyrl.models.tiny_vlm import make_tiny_vlm

    root = tmp_path_factory.mktemp("colours")
    make_tiny_vlm(root / "base", max_pixels=56 * 56, seed=0)
    rows = make_shape_rows(256, root / "images", seed=0, questions=("colour",), colours=("red", "blue"),
                           shapes=("square",))
    order = list(range(len(rows)))
    random.Random(1).shuffle(order)
    shuffled = [dict(row, images=rows[j]["images"]) for row, j in zip(rows, order)]
    files = {"train": write_jsonl(rows, root / "train.jsonl"),
             "shuffled": write_jsonl(shuffled, root / "shuffled.jsonl"),
             "sft": write_jsonl([dict(r, response=r["reward_model"]["ground_truth"]) for r in shuffled],
                                root / "sft.jsonl")}
    manifest = root / "polyrl.toml"
    manifest.write_text('[plugins]\nrequire = ["polyrl-engine-fsdp>=0.1,<0.2"]\n')
    sft(manifest, [], [f"model.path={root / 'base'}", f"data.train_files=[{files['sft']}]",
                       f"trainer.run_dir={root / 'sft'}", "data.train_batch_size=32", "actor.micro_batch_size=32",
                       "actor.optim.lr=3e-3", "actor.optim.weight_decay=0.0", "trainer.total_steps=60",
                       "trainer.executor=local", *COMMON])
    return {"model": root / "sft" / "hf", "manifest": manifest, **files}


def test_grpo_learns_the_visual_task_and_not_without_the_images(colour_task, tmp_path):
    """30 GRPO steps on the real rows lift held-out-style accuracy (sampled, 2 per prompt) well above where the
    same steps on shuffled images leave it: the gain comes from the images."""
    runs = {}
    for name in ("train", "shuffled"):
        run = tmp_path / name
        train(colour_task["manifest"], [], [
            f"model.path={colour_task['model']}", f"data.train_files=[{colour_task[name]}]",
            f"data.val_files=[{colour_task['train']}]", "data.val_max_samples=64", f"trainer.run_dir={run}",
            "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=64",
            "actor.optim.lr=1e-3", "actor.optim.weight_decay=0.0", "rollout.n=8", "rollout.val_temperature=1.0",
            "rollout.val_n=2", "trainer.total_steps=30", "trainer.test_freq=30", "trainer.save_freq=0",
            f"trainer.val_before_train={str(name == 'train').lower()}", "trainer.executor=local", *COMMON])
        rows = _metrics(run)
        runs[name] = {"val": [r["val/shapes/mean@2"] for r in rows if "val/shapes/mean@2" in r],
                      "score": [r["critic/score/mean"] for r in rows if "critic/score/mean" in r]}
    real, control = runs["train"], runs["shuffled"]
    before, after = real["val"][0], real["val"][-1]
    late = lambda scores: sum(scores[-6:]) / 6  # noqa: E731
    assert after >= before + 0.1, runs
    assert after >= control["val"][-1] + 0.1, runs
    assert late(real["score"]) >= late(control["score"]) + 0.15, runs


def test_two_ray_workers_with_text_and_image_rows(colour_task, tmp_path):
    """Two Ray workers, the model sharded over them (FSDP2), rows with and without images in each batch, the
    old log-probs recomputed by the engine: they equal the rollout's on every row."""
    from polyrl.data.synthetic import make_arithmetic_rows, write_jsonl

    image_rows = [json.loads(line) for line in Path(colour_task["train"]).read_text().splitlines()][:24]
    text_rows = make_arithmetic_rows(8, seed=3, max_operand=9)
    mixed = write_jsonl(image_rows + text_rows, tmp_path / "mixed.jsonl")
    run = tmp_path / "run"
    train(colour_task["manifest"], [], [
        f"model.path={colour_task['model']}", f"data.train_files=[{mixed}]", f"trainer.run_dir={run}",
        "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4", "rollout.n=2",
        "actor.recompute_old_log_prob=always", "trainer.total_steps=2", "trainer.save_freq=0",
        "trainer.val_before_train=false", "trainer.executor=ray", "trainer.n_workers=2", "trainer.ray_num_cpus=2",
        *COMMON])
    rows = [r for r in _metrics(run) if "critic/score/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_diff_mean"] < 1e-5, r
        assert r["actor/grad_norm"] > 0


def test_a_text_only_model_given_image_rows_is_refused_before_workers_start(colour_task, tiny_model, tmp_path):
    with pytest.raises(DataError, match="has images .'images'. but the model is text-only"):
        train(colour_task["manifest"], [], [f"model.path={tiny_model}", f"data.train_files=[{colour_task['train']}]",
                                            f"trainer.run_dir={tmp_path / 'run'}", "trainer.executor=ray", *COMMON])
    assert not (tmp_path / "run" / "ray").exists()
