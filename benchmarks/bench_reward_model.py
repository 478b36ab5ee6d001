"""The reward model's cost (issue 28): seconds per GRPO step with the reward model colocated vs in its own pool,
and its scoring throughput against a plain ``transformers`` forward of the same batches, in the same run.

    OMP_NUM_THREADS=1 RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/bench_reward_model.py [--size small]
        [--samples 256] [--steps 3]

* **Throughput**: ``--samples`` arithmetic samples (prompt + a response) scored by the ``reward_model`` role (the
  FSDP engine in a local worker group, through :class:`polyrl.reward_models.scorer.RewardModelScorer`: input
  building, the dispatch, micro-batches of ``--micro`` rows) and by ``AutoModelForSequenceClassification`` on
  the same left-padded batches of ``--micro`` rows in this process (``torch.no_grad``). Samples/s of each, the
  ratio, and the largest score difference (they must agree).
* **Placement**: ``--steps`` GRPO steps on Ray with the reward model in the actor's pool (``colocated``: offloaded
  between calls) and in a pool of its own (``trainer.placement={actor: main, rollout: main, reward_model: rm}``);
  the median of ``timing/step`` after the first step. On a 2-core CPU machine the pools share the cores, so the
  own-pool number measures the extra process and transfers, not the overlap a GPU machine would get.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _batch(tokenizer, rows, rng):
    import torch

    from polyrl.batch import make_batch

    prompts = [r["prompt"] for r in rows]
    responses = [str(int(r["reward_model"]["ground_truth"]) + rng.choice([0, 0, 1, -1])) for r in rows]
    p_ids = []
    for p in prompts:
        ids = tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True)
        p_ids.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    r_ids = [tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for r in responses]
    pw, rw, pad = max(map(len, p_ids)), max(map(len, r_ids)), tokenizer.pad_token_id
    mask = torch.cat([torch.tensor([[0] * (pw - len(p)) + [1] * len(p) for p in p_ids]),
                      torch.tensor([[1] * len(r) + [0] * (rw - len(r)) for r in r_ids])], dim=1)
    return make_batch({"prompts": torch.tensor([[pad] * (pw - len(p)) + p for p in p_ids]),
                       "responses": torch.tensor([r + [pad] * (rw - len(r)) for r in r_ids]),
                       "attention_mask": mask, "response_mask": mask[:, pw:]},
                      {"raw_prompt": [json.dumps(p) for p in prompts], "data_source": ["arithmetic"] * len(rows),
                       "ground_truth": [r["reward_model"]["ground_truth"] for r in rows]})


def throughput(root: Path, model: Path, rm: Path, samples: int, micro: int) -> dict[str, float]:
    import random

    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from polyrl import plugins
    from polyrl.config.loader import load_config
    from polyrl.config.schema import PolyrlConfig
    from polyrl.data.synthetic import make_arithmetic_rows
    from polyrl.manifest import Manifest
    from polyrl.reward_models.scorer import RewardModelScorer, check_reward_model, reward_model_spec
    from polyrl.trainer.role_groups import build_role_groups

    manifest = Manifest.load(root / "polyrl.toml")
    pm = plugins.activate(manifest)
    config = load_config(PolyrlConfig, [], [
        f"model.path={model}", "trainer.executor=local", "reward_model.enable=true", f"reward_model.model.path={rm}",
        f"reward_model.micro_batch_size={micro}", "data.max_prompt_length=64", "data.max_response_length=8"],
        plugins=pm)
    tok = AutoTokenizer.from_pretrained(model)
    scorer = RewardModelScorer(config, policy_tokenizer=tok, rm_tokenizer=check_reward_model(config, pm, tok),
                               plugins=pm, group=lambda: groups.reward_model)
    batch = _batch(tok, make_arithmetic_rows(samples, seed=0, max_operand=99, ops="+"), random.Random(0))
    groups = build_role_groups(config, manifest=manifest, use_ref=False, use_critic=False, run_dir=root / "tp",
                               extra_roles=[reward_model_spec(config)])
    try:
        scorer(batch[:micro])  # warm-up
        start = time.perf_counter()
        got = scorer(batch).scores
        polyrl_s = time.perf_counter() - start
    finally:
        groups.shutdown()
    hf = AutoModelForSequenceClassification.from_pretrained(rm).eval()
    sequences = scorer.inputs.sequences(batch)
    want: list[float] = []
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(sequences), micro):
            chunk = sequences[i:i + micro]
            width = max(map(len, chunk))
            ids = torch.full((len(chunk), width), tok.pad_token_id)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for j, s in enumerate(chunk):
                ids[j, width - len(s):] = torch.tensor(s)
                mask[j, width - len(s):] = 1
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            want += hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, 0].tolist()
    hf_s = time.perf_counter() - start
    return {"polyrl_samples_per_s": samples / polyrl_s, "transformers_samples_per_s": samples / hf_s,
            "ratio": hf_s / polyrl_s, "max_abs_diff": max(abs(a - b) for a, b in zip(got, want))}


def step_seconds(root: Path, model: Path, rm: Path, steps: int, own_pool: bool) -> tuple[float, list[float]]:
    """The median step time after the first, and each step's ``reward/rm/mean``."""
    from polyrl.data.synthetic import make_arithmetic_rows, write_jsonl
    from polyrl.trainer.commands import train

    rows = make_arithmetic_rows(96, seed=0, max_operand=9, ops="+")
    write_jsonl(rows, root / "train.jsonl")
    run = root / ("own" if own_pool else "colocated")
    placement = ["trainer.placement={actor: main, rollout: main, reward_model: rm}", "trainer.pools={rm: 1}",
                 "trainer.ray_num_cpus=2"] \
        if own_pool else ["trainer.ray_num_cpus=1"]
    train(root / "polyrl.toml", [], [
        f"model.path={model}", f"data.train_files=[{root / 'train.jsonl'}]", "data.train_batch_size=8",
        "data.max_prompt_length=32", "data.max_response_length=6", "actor.ppo_mini_batch_size=8", "rollout.n=4",
        f"trainer.total_steps={steps}", "trainer.progress_bar=false", "trainer.logger=[jsonl]", "trainer.test_freq=0",
        "trainer.val_before_train=false", f"trainer.run_dir={run}", "trainer.executor=ray", "trainer.n_workers=1",
        "reward_model.enable=true", f"reward_model.model.path={rm}", *placement])
    rows_out = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    times = [r["timing/step"] for r in rows_out if "timing/step" in r][1:]
    scores = [r["reward/rm/mean"] for r in rows_out if "reward/rm/mean" in r]
    return (statistics.median(times) if times else float("nan")), scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    from polyrl.models.tiny import make_tiny_model, make_tiny_reward_model

    root = Path(tempfile.mkdtemp(prefix="polyrl-bench-rm-"))
    (root / "polyrl.toml").write_text('[plugins]\nrequire = ["polyrl-engine-fsdp"]\n')
    model = make_tiny_model(root / "model", size=args.size, seed=0)
    rm = make_tiny_reward_model(root / "rm", size=args.size, seed=1)
    tp = throughput(root, model, rm, args.samples, args.micro)
    print(f"reward model scoring, {args.samples} samples, micro-batch {args.micro}, size {args.size}:")
    print(f"  polyrl reward_model role (fsdp engine): {tp['polyrl_samples_per_s']:.1f} samples/s")
    print(f"  plain transformers forward:             {tp['transformers_samples_per_s']:.1f} samples/s")
    print(f"  ratio polyrl / transformers: {tp['ratio']:.2f}; largest score difference {tp['max_abs_diff']:.2e}")
    colocated, colocated_scores = step_seconds(root, model, rm, args.steps, own_pool=False)
    own, own_scores = step_seconds(root, model, rm, args.steps, own_pool=True)
    print(f"GRPO step (median after the first, {args.steps} steps): colocated {colocated:.2f} s, "
          f"own pool {own:.2f} s")
    diff = max((abs(a - b) for a, b in zip(colocated_scores, own_scores)), default=float("nan"))
    print(f"reward/rm/mean per step, colocated {colocated_scores} vs own pool {own_scores}: largest difference "
          f"{diff:.2e}")


if __name__ == "__main__":
    main()
