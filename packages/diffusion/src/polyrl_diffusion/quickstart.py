"""``python -m polyrl_diffusion.quickstart [OUT_DIR]`` (``make quickstart-diffusion``): the whole story on a CPU.

1. Build a tiny SD3-family pipeline in code and pre-train it with plain flow matching on synthetic 8x8
   images (soft colour blobs on grey), so it draws something before RL.
2. Run ``polyrl train`` with ``trainer.name=flow_grpo`` on the offline ``brightness`` reward (local executor).
3. Print the mean reward before and after (ODE samples, same noise) and write ``samples_before_after.png``
   (top row before, bottom row after) next to the run's curves.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch

from polyrl.errors import PolyrlError

log = logging.getLogger("polyrl_diffusion.quickstart")

PROMPTS = ["a photo of a cat", "a red house", "a dark sky", "a green tree", "a blue sea", "a yellow flower"]


def synthetic_images(n: int, generator: torch.Generator) -> torch.Tensor:
    """``[n, 3, 8, 8]`` in [-1, 1]: one soft colour blob per image on a grey background."""
    yy, xx = torch.meshgrid(torch.arange(8.0), torch.arange(8.0), indexing="ij")
    centre = torch.rand(n, 2, generator=generator) * 6 + 1
    colour = torch.rand(n, 3, generator=generator) * 1.6 - 0.8
    d2 = (yy[None] - centre[:, 0, None, None]) ** 2 + (xx[None] - centre[:, 1, None, None]) ** 2
    blob = torch.exp(-d2 / 4.0)[:, None]
    return (blob * colour[:, :, None, None] + (1 - blob) * -0.2).clamp(-1, 1)


def pretrain(model_dir: Path, steps: int = 300, batch: int = 32) -> None:
    """Flow matching ``|| v_theta(x_s, s) - (eps - x0) ||^2`` on synthetic images; weights saved in place."""
    from polyrl_diffusion.models import load_flow_model

    model = load_flow_model(model_dir)
    tr = model.transformer
    tr.requires_grad_(True).train()
    opt = torch.optim.AdamW(tr.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(0)
    embeds = model.encode(PROMPTS)
    for step in range(steps):
        x0 = synthetic_images(batch, g)
        eps = torch.randn(x0.shape, generator=g)
        s = torch.rand(batch, generator=g)
        xs = (1 - s[:, None, None, None]) * x0 + s[:, None, None, None] * eps
        idx = torch.randint(len(PROMPTS), (batch,), generator=g)
        from polyrl_diffusion.models import TextEmbeddings

        v = model.velocity(xs, s, TextEmbeddings(embeds.prompt_embeds[idx], embeds.pooled[idx]))
        loss = ((v - (eps - x0)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log.info("pre-training step %d: flow-matching loss %.4f", step, float(loss))
    tr.save_pretrained(str(model_dir / "transformer"))


@torch.no_grad()
def sample_images(model_dir: Path, steps: int = 12) -> torch.Tensor:
    """ODE samples (fixed noise) for the quickstart prompts, ``uint8 [N, 3, 8, 8]``."""
    from polyrl_diffusion.models import load_flow_model
    from polyrl_diffusion.sampler import sde_step, sigma_schedule

    model = load_flow_model(model_dir)
    emb = model.encode(PROMPTS)
    x = torch.randn(len(PROMPTS), *model.latent_shape(), generator=torch.Generator().manual_seed(123))
    sig = sigma_schedule(steps)
    for i in range(steps):
        x = sde_step(x, model.velocity(x, sig[i].expand(len(PROMPTS)), emb), sig[i], sig[i + 1], 0.0).prev_sample
    return model.decode(x)


def flow_grpo_overrides(model: str | Path, train_file: str | Path, run_dir: str | Path, *, batch: int, n: int,
                        lr: float, steps: int, micro_batch: int = 16, sampler_steps: int = 6,
                        reward: str = "brightness", executor: str = "local") -> list[str]:
    """The ``key=value`` overrides of a ``flow_grpo`` run of ``steps`` steps on ``model`` (a pipeline folder):
    ``batch`` prompts x ``n`` images a step, one mini-batch, ``sampler_steps`` sampler steps while training,
    the JSON-lines logger, no progress bar. Add the algorithm's own keys (docs/diffusion.md) after them."""
    return [
        f"model.path={model}", f"data.train_files=[{train_file}]", f"data.train_batch_size={batch}",
        "actor.engine=diffusers", "rollout.name=diffusers", "trainer.name=flow_grpo",
        "algorithm.adv_estimator=flow_grpo", "actor.policy_loss.loss_mode=flow_grpo", f"reward.function={reward}",
        f"actor.ppo_mini_batch_size={batch}", f"actor.micro_batch_size={micro_batch}", f"actor.optim.lr={lr}",
        f"rollout.n={n}", f"trainer.total_steps={steps}", "trainer.progress_bar=false", "trainer.logger=[jsonl]",
        f"trainer.run_dir={run_dir}", f"trainer.executor={executor}", f"trainer.flow_grpo.train_steps={sampler_steps}",
    ]


def main(out: str = "runs/quickstart-diffusion") -> dict[str, float]:
    """Pre-train, measure, train with Flow-GRPO, measure again; returns the rewards before and after."""
    from PIL import Image

    from polyrl.trainer.commands import export, train
    from polyrl_diffusion.models import make_tiny_pipeline
    from polyrl_diffusion.rewards import brightness
    from polyrl_diffusion.trainer import images_grid

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root = Path(out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    model = make_tiny_pipeline(root / "model", family="sd3", seed=0)
    pretrain(model)
    before = sample_images(model)
    rows = [{"prompt": p, "data_source": "images"} for p in PROMPTS[:4]]
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows * 4))
    (root / "polyrl.toml").write_text('[plugins]\nrequire = ["polyrl-engine-fsdp", "polyrl-diffusion"]\n')
    run = root / "run"
    train(root / "polyrl.toml", [], [
        *flow_grpo_overrides(model, root / "train.jsonl", run, batch=4, n=4, lr=2e-3, steps=25, sampler_steps=8),
        "trainer.save_freq=25", "trainer.flow_grpo.sde_window_size=4", "trainer.resume=disable",
    ])
    exported = run / "export"  # what `polyrl export RUN/checkpoints/step_25 --to RUN/export` writes
    latest = (run / "checkpoints" / "latest").read_text().strip()
    export(run / "checkpoints" / latest, exported, manifest=root / "polyrl.toml")
    after = sample_images(exported)
    r0, r1 = float(brightness(before, PROMPTS).mean()), float(brightness(after, PROMPTS).mean())
    grid = images_grid(torch.cat([before, after]), columns=len(PROMPTS))
    Image.fromarray(grid).resize((grid.shape[1] * 8, grid.shape[0] * 8), Image.NEAREST).save(run / "samples_before_after.png")
    try:  # the reward / loss curves beside the samples (needs matplotlib: polyrl[plot])
        from polyrl.plotting import plot_run

        plot_run(run)
    except PolyrlError as exc:  # matplotlib missing
        log.info("no curves written (%s): pip install 'polyrl[plot]'", exc)
    log.info("brightness reward before Flow-GRPO: %.3f  after: %.3f  (samples: %s)", r0, r1,
             run / "samples_before_after.png")
    return {"reward_before": r0, "reward_after": r1}


if __name__ == "__main__":
    main(*sys.argv[1:2])
