"""Images/s of Flow-GRPO rollout and training: polyrl's `diffusers` rollout + engine vs a plain diffusers loop.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_diffusion.py            # tiny SD3, 32 images x 10 steps
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_diffusion.py --small    # 8 images, a few seconds

The reference is what the flow_grpo reference scripts do in one process: the batch's prompts encoded, the
transformer called on the latents at each step, the SDE step and its log-prob written inline, then for
training one forward per trained step with the PPO-clipped loss and AdamW. polyrl runs the same sampling
through `DiffusersRollout.generate` (+ `collate_images`, the worker's batch building) and the same update
through `DiffusersEngine.train_batch` (FSDP machinery, world size 1, in this process). Same work on both
sides: GRPO groups (8 prompts x 4 images), new prompts every repeat, each distinct prompt encoded once and
the encoding timed on both sides; the two sides alternate each repeat after a warm-up. Same model, same
sizes, same run; the ratio is polyrl / reference.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from types import SimpleNamespace

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402


def prompt_groups(repeat: int, groups: int) -> list[str]:
    """``groups`` distinct prompts for repeat ``repeat`` (new ones every repeat: no text-cache hits across repeats)."""
    from polyrl_diffusion.models import TINY_VOCAB

    words = [w for w in TINY_VOCAB if len(w) > 3]
    return [f"a {words[(repeat * groups + g) % len(words)]} {words[(7 * (repeat * groups + g) + 3) % len(words)]}"
            for g in range(groups)]


class Reference:
    """A straightforward single-process loop: encode the batch's distinct prompts, sample with the SDE step and
    its log-prob written inline, then one forward per trained step with the PPO-clipped loss and AdamW."""

    def __init__(self, model_dir: str, images: int, steps: int, n: int) -> None:
        from polyrl_diffusion.models import load_flow_model

        self.model = load_flow_model(model_dir)
        self.images, self.steps, self.n = images, steps, n
        self.opt = torch.optim.AdamW(self.model.transformer.parameters(), lr=1e-4)
        self.traj: list = []
        self.emb = None

    def rollout(self, repeat: int) -> None:
        model, images, steps = self.model, self.images, self.steps
        a, sig = 0.7, torch.linspace(1, 0, steps + 1)
        emb = model.encode(prompt_groups(repeat, images // self.n))  # each distinct prompt once, like polyrl
        emb = type(emb)(emb.prompt_embeds.repeat_interleave(self.n, 0), emb.pooled.repeat_interleave(self.n, 0))
        x = torch.randn(images, *model.latent_shape())
        traj = []
        with torch.no_grad():
            for i in range(steps):
                s, s2 = sig[i], sig[i + 1]
                v = model.velocity(x, s.expand(images), emb)
                std_t = a * math.sqrt(float(s) / (1 - float(s if s < 1 else s2)))
                dt = float(s2 - s)
                mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
                std = std_t * math.sqrt(-dt)
                nxt = mean + std * torch.randn_like(x)
                lp = (-((nxt - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)).flatten(1).mean(1)
                traj.append((x, nxt, s, s2, std_t, std, lp))
                x = nxt
            model.decode(x)
        self.traj, self.emb = traj, emb

    def train(self) -> None:
        model, images, tr = self.model, self.images, self.model.transformer
        tr.requires_grad_(True).train()
        adv = torch.randn(images)
        self.opt.zero_grad()
        for x, nxt, s, s2, std_t, std, lp_old in self.traj:
            v = model.velocity(x, s.expand(images), self.emb)
            dt = float(s2 - s)
            mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
            lp = (-((nxt - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)).flatten(1).mean(1)
            ratio = torch.exp(lp - lp_old)
            loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - 1e-4, 1 + 1e-4)).mean() / self.steps
            loss.backward()
        torch.nn.utils.clip_grad_norm_(tr.parameters(), 1.0)
        self.opt.step()
        tr.requires_grad_(False).eval()


class Polyrl:
    """The same work through `DiffusersRollout.generate` (one request per image, a group's requests sharing
    their id, as the `diffusion` agent loop sends them), `collate_images` and `DiffusersEngine.train_batch`."""

    def __init__(self, model_dir: str, images: int, steps: int, n: int) -> None:
        from polyrl_diffusion.config import DiffusersRolloutConfig, FlowGRPOConfig
        from polyrl_diffusion.engine import DiffusersEngine
        from polyrl_diffusion.rollout import DiffusersRollout

        from polyrl.config.roles import EngineRoleConfig, ModelConfig, OptimConfig, RolloutConfig
        from polyrl.platforms import CPUPlatform

        cfg = FlowGRPOConfig(train_steps=steps, train_last_step=True)  # the loop trains every step too
        self.images, self.steps, self.n = images, steps, n
        self.ro = DiffusersRollout(RolloutConfig(name="diffusers", plugin_config=DiffusersRolloutConfig(
            sampler=cfg, max_batch_size=images)), model_path=model_dir)
        self.engine = DiffusersEngine(EngineRoleConfig(engine="diffusers", model=ModelConfig(path=model_dir),
                                                       optim=OptimConfig(lr=1e-4, grad_clip=1.0), micro_batch_size=images),
                                      role="actor", model_type="diffusion", platform=CPUPlatform())
        self.batch = None

    def rollout(self, repeat: int) -> None:
        from polyrl_diffusion.worker import collate_images

        from polyrl.protocols import GenerationRequest, SamplingParams

        prompts = prompt_groups(repeat, self.images // self.n)
        reqs = [GenerationRequest([], SamplingParams(n=1, seed=repeat), request_id=f"r{repeat}-g{i // self.n}",
                                  multi_modal={"prompt": prompts[i // self.n]}) for i in range(self.images)]
        self.batch = collate_images([SimpleNamespace(extra=x.extra) for x in self.ro.generate(reqs)])

    def train(self) -> None:
        from polyrl_diffusion.algorithms import compute_policy_loss_flow_grpo

        def loss(out, mb, scale):
            return compute_policy_loss_flow_grpo(mb["rollout_log_probs"], out["log_probs"], mb["advantages"],
                                                 mb["response_mask"], "token-mean", None)

        self.batch["advantages"] = torch.randn(self.images)[:, None].expand(self.images, self.steps).contiguous()
        self.engine.train_batch(self.batch, loss)


def run(model_dir: str, images: int, steps: int, n: int, repeats: int) -> dict[str, tuple[float, float]]:
    """Images/s ``(rollout, train)`` of both sides, timed in turn each repeat (after one warm-up each; the side
    that goes first alternates) so a busy machine slows both alike; both time the text encoding of their
    batch's prompts."""
    sides = {"reference": Reference(model_dir, images, steps, n), "polyrl": Polyrl(model_dir, images, steps, n)}
    spent = {name: [0.0, 0.0] for name in sides}
    for r in range(-1, repeats):
        order = list(sides.items()) if r % 2 else list(sides.items())[::-1]  # neither side always goes first
        for name, side in order:
            t0 = time.perf_counter()
            side.rollout(r + 1)
            t1 = time.perf_counter()
            side.train()
            t2 = time.perf_counter()
            if r >= 0:
                spent[name][0] += t1 - t0
                spent[name][1] += t2 - t1
    return {name: (images * repeats / g, images * repeats / t) for name, (g, t) in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    images, steps, n = (8, 6, 4) if args.small else (32, 10, 4)
    from polyrl_diffusion.models import make_tiny_pipeline

    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_pipeline(f"{tmp}/m", family="sd3", seed=0))
        res = run(model, images, steps, n, args.repeats)
    ref, ours = res["reference"], res["polyrl"]
    print(f"tiny SD3, {images} images ({images // n} prompts x {n}) x {steps} SDE steps, {args.repeats} repeats, "
          f"{torch.get_num_threads()} thread(s); rollout times include text encoding on both sides")
    print(f"{'':10s} {'rollout img/s':>14s} {'train img/s':>12s}")
    print(f"{'reference':10s} {ref[0]:14.1f} {ref[1]:12.1f}")
    print(f"{'polyrl':10s} {ours[0]:14.1f} {ours[1]:12.1f}")
    print(f"{'ratio':10s} {ours[0] / ref[0]:14.2f} {ours[1] / ref[1]:12.2f}")


if __name__ == "__main__":
    main()
