"""Images/s of Flow-GRPO rollout and training: polyrl's `diffusers` rollout + engine vs a plain diffusers loop.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_diffusion.py            # tiny SD3, 32 images x 10 steps
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_diffusion.py --small    # 8 images, a few seconds

The reference is what the flow_grpo reference scripts do in one process: the transformer called on the
latents at each step, the SDE step and its log-prob written inline, then for training one forward per
trained step with the PPO-clipped loss and AdamW. polyrl runs the same sampling through
`DiffusersRollout.generate` and the same update through `DiffusersEngine.train_batch` (FSDP machinery,
world size 1, in this process). Same model, same sizes, same run; the ratio is polyrl / reference.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402


def reference(model_dir: str, images: int, steps: int, repeats: int) -> tuple[float, float]:
    """(rollout images/s, training images/s) of a straightforward single-process loop."""
    from polyrl_diffusion.models import load_flow_model

    model = load_flow_model(model_dir)
    tr = model.transformer
    emb = model.encode(["a red house"] * images)
    sig = torch.linspace(1, 0, steps + 1)
    a = 0.7
    gen_t, train_t = 0.0, 0.0
    opt = torch.optim.AdamW(tr.parameters(), lr=1e-4)
    for _ in range(repeats):
        t0 = time.perf_counter()
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
        gen_t += time.perf_counter() - t0
        t0 = time.perf_counter()
        tr.requires_grad_(True).train()
        adv = torch.randn(images)
        opt.zero_grad()
        for x, nxt, s, s2, std_t, std, lp_old in traj:
            v = model.velocity(x, s.expand(images), emb)
            dt = float(s2 - s)
            mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
            lp = (-((nxt - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)).flatten(1).mean(1)
            ratio = torch.exp(lp - lp_old)
            loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - 1e-4, 1 + 1e-4)).mean() / steps
            loss.backward()
        torch.nn.utils.clip_grad_norm_(tr.parameters(), 1.0)
        opt.step()
        tr.requires_grad_(False).eval()
        train_t += time.perf_counter() - t0
    return images * repeats / gen_t, images * repeats / train_t


def polyrl(model_dir: str, images: int, steps: int, repeats: int) -> tuple[float, float]:
    """(rollout images/s, training images/s) of the diffusers rollout and engine."""
    from polyrl_diffusion.algorithms import compute_policy_loss_flow_grpo
    from polyrl_diffusion.config import DiffusersRolloutConfig, FlowGRPOConfig
    from polyrl_diffusion.engine import DiffusersEngine
    from polyrl_diffusion.rollout import DiffusersRollout
    from polyrl_diffusion.worker import collate_images

    from polyrl.config.roles import EngineRoleConfig, ModelConfig, OptimConfig, RolloutConfig
    from polyrl.platforms import CPUPlatform
    from polyrl.protocols import GenerationRequest, SamplingParams

    cfg = FlowGRPOConfig(train_steps=steps)
    rollout = DiffusersRollout(RolloutConfig(name="diffusers", plugin_config=DiffusersRolloutConfig(sampler=cfg,
                               max_batch_size=images)), model_path=model_dir)
    engine = DiffusersEngine(EngineRoleConfig(engine="diffusers", model=ModelConfig(path=model_dir),
                                              optim=OptimConfig(lr=1e-4, grad_clip=1.0), micro_batch_size=images),
                             role="actor", model_type="diffusion", platform=CPUPlatform())

    def loss(out, mb, scale):
        return compute_policy_loss_flow_grpo(mb["rollout_log_probs"], out["log_probs"], mb["advantages"],
                                             mb["response_mask"], "token-mean", None)

    gen_t, train_t = 0.0, 0.0
    for r in range(repeats):
        t0 = time.perf_counter()
        reqs = [GenerationRequest([], SamplingParams(n=1, seed=r), request_id=f"u{i}",
                                  multi_modal={"prompt": "a red house"}) for i in range(images)]
        batch = collate_images([type("O", (), {"extra": x.extra})() for x in rollout.generate(reqs)])
        gen_t += time.perf_counter() - t0
        batch["advantages"] = torch.randn(images)[:, None].expand(images, steps).contiguous()
        t0 = time.perf_counter()
        engine.train_batch(batch, loss)
        train_t += time.perf_counter() - t0
    return images * repeats / gen_t, images * repeats / train_t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    images, steps = (8, 6) if args.small else (32, 10)
    from polyrl_diffusion.models import make_tiny_pipeline

    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_pipeline(f"{tmp}/m", family="sd3", seed=0))
        reference(model, images, steps, 1)  # warm-up
        ref = reference(model, images, steps, args.repeats)
        ours = polyrl(model, images, steps, args.repeats)
    print(f"tiny SD3, {images} images x {steps} SDE steps, {args.repeats} repeats, {torch.get_num_threads()} thread(s)")
    print(f"{'':10s} {'rollout img/s':>14s} {'train img/s':>12s}")
    print(f"{'reference':10s} {ref[0]:14.1f} {ref[1]:12.1f}")
    print(f"{'polyrl':10s} {ours[0]:14.1f} {ours[1]:12.1f}")
    print(f"{'ratio':10s} {ours[0] / ref[0]:14.2f} {ours[1] / ref[1]:12.2f}")


if __name__ == "__main__":
    main()
