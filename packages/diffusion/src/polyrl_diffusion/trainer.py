"""Trainer ``flow_grpo``: polyrl's PPO/GRPO loop (:class:`polyrl.trainer.ppo.PPOTrainer`) on images.

Not a second loop: the step (generate -> reward -> old log-probs -> advantages -> actor update -> weight
sync) is the core's. This subclass changes only what an image model needs: no text tokenizer, prompt
rows sent as text (agent loop ``diffusion``), the ``image`` reward manager, image metrics, validation by
ODE sampling with ``eval_steps``, and the ``trainer.flow_grpo`` block checked (and copied to the rollout)
before any worker starts.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from polyrl.errors import ConfigError
from polyrl.trainer.ppo import PPOTrainer
from polyrl_diffusion.agent_loop import prompt_text
from polyrl_diffusion.config import DiffusersRolloutConfig, FlowGRPOConfig, check_numbers
from polyrl_diffusion.worker import FlowGRPOWorker

log = logging.getLogger("polyrl")

#: The rollouts the flow_grpo trainer samples with (polyrl's diffusers sampler; vllm-omni's engine running polyrl's
#: sampler, GPU only; docs/diffusion.md, "Rollouts").
ROLLOUTS = ("diffusers", "vllm_omni")


class FlowGRPOTrainer(PPOTrainer):
    """Flow-GRPO (and Flow-GRPO-Fast, MixGRPO, DanceGRPO through ``trainer.flow_grpo``) on the PPO loop."""

    worker_cls = FlowGRPOWorker

    def __init__(self, config: Any, *, manifest: Any = None, plugins: Any = None) -> None:
        from polyrl_diffusion.sampler import check_sampler_config

        fg = config.trainer.plugin_config
        if not isinstance(fg, FlowGRPOConfig):
            fg = FlowGRPOConfig()
            config.trainer.plugin_config = fg
        self.flow = fg
        check_sampler_config(fg)
        if fg.algorithm not in ("flow_grpo", "diffusion_nft"):  # D2: DiffusionNFT selection
            raise ConfigError(f"trainer.flow_grpo.algorithm={fg.algorithm!r}: choose 'flow_grpo' or 'diffusion_nft'")
        if fg.algorithm == "diffusion_nft":
            from polyrl_diffusion.nft import check_nft_config

            check_nft_config(fg.nft)
        if config.actor.engine != "diffusers":
            raise ConfigError(f"trainer.name=flow_grpo trains with actor.engine=diffusers, not {config.actor.engine!r}")
        if config.rollout.name not in ROLLOUTS:
            raise ConfigError(f"trainer.name=flow_grpo samples with rollout.name={' or '.join(ROLLOUTS)}, not "
                              f"{config.rollout.name!r}")
        if config.rollout.name == "vllm_omni":  # the package, the model family, engine_kwargs: before any worker
            from polyrl_diffusion.vllm_omni import check_vllm_omni

            check_vllm_omni(config.actor.model.path, config.rollout.plugin_config)
        if config.algorithm.adv_estimator == "gae":
            raise ConfigError("algorithm.adv_estimator=gae needs a critic; flow_grpo has none: use flow_grpo or grpo")
        from polyrl_diffusion.models import pipeline_family

        self.family, self.tiny = pipeline_family(config.actor.model.path, "actor.model.path")
        check_image_size(fg, config.actor.model.path)
        rollout_opts = config.rollout.plugin_config
        if not isinstance(rollout_opts, DiffusersRolloutConfig):
            rollout_opts = DiffusersRolloutConfig()
        check_numbers(rollout_opts, f"rollout.{config.rollout.name}", skip=("sampler", "engine_kwargs"))
        self.rollout_opts = rollout_opts
        engine_opts = config.actor.plugin_config
        if engine_opts is not None and getattr(engine_opts, "fsdp_size", -1) not in (-1,) and engine_opts.fsdp_size < 1:
            raise ConfigError(f"actor.diffusers.fsdp_size={engine_opts.fsdp_size}: give -1 (every rank) or a divisor "
                              "of the number of workers")
        for key, value in advantage_defaults(fg).items():  # the variant's reference; a user's setting wins
            config.algorithm.extra.setdefault(key, value)
        rollout_opts.sampler = fg  # the workers' rollout samples with the trainer's block
        config.rollout.plugin_config = rollout_opts
        if getattr(config.agent, "default_loop", "single_turn") == "single_turn":
            config.agent.default_loop = "diffusion"
        super().__init__(config, manifest=manifest, plugins=plugins)
        if fg.algorithm == "diffusion_nft":  # D2: NFT trains on clean samples, no per-step log-probs
            self.skip_old_log_prob = True
        kl = fg.nft.kl_coef if fg.algorithm == "diffusion_nft" else fg.kl_coef
        if kl > 0 and not self.use_ref:  # the KL's reference: the adapter-disabled LoRA actor, else a ref engine
            if str(config.ref.enable).lower() == "false" and config.actor.model.lora.rank == 0:
                key = "nft.kl_coef" if fg.algorithm == "diffusion_nft" else "kl_coef"
                raise ConfigError(f"trainer.flow_grpo.{key}={kl} needs a reference model: train with LoRA "
                                  "(actor.model.lora.rank > 0; the reference is the adapter-disabled model) or "
                                  f"leave ref.enable on, or set trainer.flow_grpo.{key}=0")
            self.use_ref = True
        self.ema_validation = fg.ema_settings()[0]
        if self.ema_validation and config.trainer.async_mode != "sync":
            log.warning("trainer.flow_grpo.ema: with trainer.async_mode=%s validation samples with the trained "
                        "weights, not the EMA (the rollout keeps generating meanwhile)", config.trainer.async_mode)
            self.ema_validation = False

    # ------------------------------------------------------------------ what differs from text RL
    def build_tokenizer(self) -> Any:
        """The pipeline's tokenizer (tiny pipelines) for the prompt-length check; ``None`` for real pipelines."""
        if not self.tiny:
            return None
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(f"{self.config.actor.model.path}/tokenizer")

    def _max_text_length(self) -> int | None:
        if self.family == "qwenimage" and not self.tiny:
            from polyrl_diffusion.models import QWENIMAGE_MAX_TEXT_LENGTH

            return QWENIMAGE_MAX_TEXT_LENGTH
        if not self.tiny:
            return None
        import json
        from pathlib import Path

        cfg = json.loads((Path(self.config.actor.model.path) / "text_encoder" / "config.json").read_text())
        return int(cfg["max_position_embeddings"])

    def build_datasets(self) -> tuple[Any, Any]:
        """Rows of ``data.train_files`` / ``data.val_files`` (verl's format; ``prompt`` as text or chat, optional
        ``negative_prompt``), checked: a prompt longer than the text encoder takes, or CFG on a FLUX model
        without a negative prompt, is a ConfigError naming the file and row. QwenImage: the longest prompt (in text
        tokens after its template's prefix) becomes ``rollout.<name>.text_length`` unless the run sets it."""
        from polyrl.data.dataset import load_rows, validate_row
        from polyrl_diffusion.agent_loop import prompt_text
        from polyrl_diffusion.data import from_flow_grpo

        data = self.config.data
        limit = self._max_text_length()
        count = self._text_token_count()
        longest = [count(self.flow.negative_prompt) if count is not None else 0]  # QwenImage's text tokens

        def load(files: Any) -> list[dict]:
            rows: list[dict] = []
            for f in files:
                for i, row in enumerate(from_flow_grpo(load_rows(f, self.pm), f)):  # Flow-GRPO's files as they are
                    validate_row(row, str(f), i)
                    for key in ("prompt", "negative_prompt"):
                        text = prompt_text(row.get(key)) if row.get(key) is not None else None
                        if count is not None and text is not None:  # QwenImage: "" is a prompt too
                            longest[0] = max(longest[0], count(text))
                        if text and limit is not None:
                            n = count(text) if count is not None else len(self.tokenizer(text)["input_ids"])
                            if n > limit:
                                raise ConfigError(f"{f} row {i}: '{key}' is {n} tokens; the text encoder of "
                                                  f"actor.model.path={self.config.actor.model.path} takes {limit}. "
                                                  "Shorten it")
                    if (self.flow.cfg_scale > 1 and self.family == "flux" and not row.get("negative_prompt")
                            and not self.flow.negative_prompt):
                        raise ConfigError(f"{f} row {i}: trainer.flow_grpo.cfg_scale={self.flow.cfg_scale} on a FLUX "
                                          "model needs a negative prompt (set trainer.flow_grpo.negative_prompt or "
                                          "the rows' negative_prompt)")
                    rows.append(row)
            return rows

        if self.flow.negative_prompt and limit is not None:
            n = (count(self.flow.negative_prompt) if count is not None
                 else len(self.tokenizer(self.flow.negative_prompt)["input_ids"]))
            if n > limit:
                raise ConfigError(f"trainer.flow_grpo.negative_prompt is {n} tokens; the text encoder takes {limit}")
        train_rows, val_rows = load(data.train_files), (load(data.val_files) if data.val_files else None)
        if count is not None and not self.rollout_opts.text_length:
            self.rollout_opts.text_length = longest[0]  # workers start after this: every rank pads to it
        return train_rows, val_rows

    def _text_token_count(self) -> Any:
        """QwenImage: :class:`~polyrl_diffusion.models.QwenPromptLengths` of the model folder (its tokenizer alone;
        a tiny pipeline's: its tokens); ``None`` for the other families (fixed-length text)."""
        if self.family != "qwenimage":
            return None
        if self.tiny:
            return lambda text: len(self.tokenizer(text)["input_ids"])
        from polyrl_diffusion.models import QwenPromptLengths

        return QwenPromptLengths.from_folder(self.config.actor.model.path)

    def build_reward_fn(self) -> Any:
        """The reward manager for images: ``reward.manager`` when set to something else than the text default
        ``naive``, else ``trainer.flow_grpo.reward_manager`` (``image``)."""
        from polyrl.rewards import load_compute_score

        cfg = self.config
        name = cfg.reward.manager if cfg.reward.manager != "naive" else self.flow.reward_manager
        manager = self.pm.get("reward_manager", name)
        return manager(tokenizer=None, compute_score=load_compute_score(cfg.reward), config=cfg.reward)

    def next_rows(self) -> list[dict]:
        """The core's rows, each with the training step (MixGRPO's window moves with it) and a key that names
        the row in this step without the uid's random suffix (the rollout's noise follows it: reproducible
        runs)."""
        # ``draw`` counts the draws of one step (a group filter may draw again)
        rows = super().next_rows()
        last_step, last_round = getattr(self, "_rows_draw", (None, -1))
        draw = last_round + 1 if last_step == self.global_step else 0
        self._rows_draw = (self.global_step, draw)
        return [dict(row, _train_step=self.global_step, _sample_key=f"{self.global_step}.{draw}.{i}")
                for i, row in enumerate(rows)]

    def balance_lengths(self, batch: TensorDict) -> list[int] | None:
        """Every image costs the same: no balancing needed."""
        return None

    def batch_metrics(self, batch: TensorDict) -> dict[str, float]:
        """Reward, advantage, trained-step and image statistics of a trained batch."""
        mask = batch["response_mask"].float()
        scores = batch["token_level_scores"].sum(-1)
        adv = batch["advantages"][mask.bool()]
        out = {
            "critic/score/mean": float(scores.mean()),
            "critic/score/max": float(scores.max()),
            "critic/score/min": float(scores.min()),
            "critic/rewards/mean": float(batch["token_level_rewards"].sum(-1).mean()),
            "critic/advantages/mean": float(adv.mean()) if adv.numel() else 0.0,
            "critic/advantages/max": float(adv.max()) if adv.numel() else 0.0,
            "critic/advantages/min": float(adv.min()) if adv.numel() else 0.0,
            "diffusion/trained_steps": float(mask.sum(-1).mean()),
            "diffusion/image_mean": float(batch["images"].float().mean() / 255.0),
            "diffusion/rollout_log_prob_mean": float((batch["rollout_log_probs"] * mask).sum() / mask.sum().clamp(min=1)),
        }
        if "old_log_probs" in batch.keys():
            diff = (batch["old_log_probs"] - batch["rollout_log_probs"]).abs()
            out["rollout/logprob_diff_max"] = float((diff * mask).max())
        return out

    def throughput_metrics(self, batch: TensorDict, timing: dict[str, float]) -> dict[str, float]:
        """Images per second of the whole step and of generation."""
        n = float(batch.batch_size[0])
        return {"throughput/images_per_s": n / max(timing["step"], 1e-9),
                "throughput/gen_images_per_s": n / max(timing["gen"], 1e-9)}

    def validate(self) -> dict[str, float]:
        """Mean reward per data source (``val/<data source>/mean@1``) of ODE samples with ``trainer.flow_grpo.eval_steps`` steps (one image per
        validation prompt, seeded: the same noise every time, so the curve shows the model, not the draw). With an
        EMA (``trainer.flow_grpo.ema``) the rollout samples with the EMA's weights, then gets the run's back."""
        if not self.ema_validation:
            return self._validate()
        self.groups.actor.call_all("serve_rollout_weights", "ema")
        self.groups.sync_weights()
        try:
            return self._validate()
        finally:
            self.groups.actor.call_all("serve_rollout_weights", None)
            self.groups.sync_weights()

    def _validate(self) -> dict[str, float]:
        from polyrl import batch as batch_ops

        cfg = self.config
        rows = list(self.val_set)
        if cfg.data.val_max_samples:
            rows = rows[: cfg.data.val_max_samples]
        per_source: dict[str, list[float]] = defaultdict(list)
        self._val_images: list[torch.Tensor] = []
        size = cfg.data.val_batch_size or len(rows)
        for start in range(0, len(rows), size):
            part = [dict(r, uid=f"val-{start + i}", _validate=True) for i, r in enumerate(rows[start : start + size])]
            padded = self.pad_rows(part)
            batch = self.generate_batch(padded, 1, validate=True)
            out = self.reward_fn(batch)
            batch["token_level_scores"] = out.token_level_scores.float()
            scores = batch["token_level_scores"].sum(-1)
            batch_ops.set_non_tensor(batch, "prompt_text", [prompt_text(s.get("prompt")) for s in padded])
            self.record_validation(batch, keep=[not s.get("_pad") for s in padded])
            sources = batch_ops.non_tensor(batch, "data_source")
            for i, s in enumerate(padded):
                if not s.get("_pad"):
                    per_source[sources[i] or "images"].append(float(scores[i]))
            self.last_val_images = batch["images"][: len(part)]
        # the text trainer's name (verl's mean@N of the reward): the console's step line and the end-of-run summary
        return {f"val/{src}/mean@1": float(np.mean(v)) for src, v in per_source.items()}

    # ------------------------------------------------------------------ what a validation generated
    def check_rewards(self) -> None:
        """Refuse (one ConfigError, before the pipeline loads) a data file whose first rows name a ``data_source`` no
        image reward scores, when the rewards are picked by data source (the ``image`` manager and no
        ``reward.function``): the core's seam (:meth:`PPOTrainer.check_rewards`) with image rewards."""
        from polyrl.data.dataset import head_rows
        from polyrl.rewards.reachability import SAMPLE_ROWS
        from polyrl.rewards.scoring import reward_function_spec
        from polyrl_diffusion.data import from_flow_grpo
        from polyrl_diffusion.rewards import image_data_sources, image_reward_entry

        cfg = self.config
        manager = cfg.reward.manager if cfg.reward.manager != "naive" else self.flow.reward_manager
        if manager != "image" or reward_function_spec(cfg.reward):
            return  # a reward manager of its own, or one reward for every row
        for key in ("val_files", "train_files"):
            for file in getattr(cfg.data, key):
                rows = from_flow_grpo(head_rows(file, SAMPLE_ROWS, self.pm), file)
                for source in dict.fromkeys(str(r.get("data_source") or "") for r in rows if isinstance(r, dict)):
                    if image_reward_entry(source, self.pm) is None:
                        what = f"data_source '{source}'" if source else "rows without a data_source"
                        raise ConfigError(
                            f"data.{key} ({file}): no image reward scores {what} (image rewards by data_source: "
                            f"{', '.join(image_data_sources(self.pm))}); set reward.function to an image reward "
                            "(reward.function=ocr, or weights: reward.function=ocr=1,brightness=0.2) or give the "
                            "rows a data_source one scores (docs/diffusion.md, Rewards)")

    def generation_rows(self, batch: TensorDict, *, step: int, kind: str, keep: list[bool] | None = None) -> list[dict]:
        """Prompt, reward and sample id of each image (the images themselves go to the PNG grid)."""
        from polyrl import batch as batch_ops

        prompts = batch_ops.non_tensor(batch, "prompt_text", "")
        uids = batch_ops.non_tensor(batch, "uid", "")
        sources = batch_ops.non_tensor(batch, "data_source", "")
        scores = batch["token_level_scores"].sum(-1).tolist()
        rows = []
        for i, score in enumerate(scores):
            if keep is None or keep[i]:
                rows.append({"step": step, "kind": kind, "sample_id": uids[i], "data_source": sources[i] or "images",
                             "prompt": prompts[i], "score": score})
        return rows

    def record_validation(self, batch: TensorDict, keep: list[bool] | None = None) -> None:
        """The core's rows, and the batch's images for :meth:`write_validation_media`."""
        super().record_validation(batch, keep)
        images = batch["images"] if keep is None else batch["images"][torch.tensor(keep, dtype=torch.bool)]
        self._val_images = [*getattr(self, "_val_images", []), images]

    def write_validation_media(self, rows: list[dict], directory: Any, step: int) -> None:
        """``<step>.png`` beside the validation's JSONL: every image with its prompt and reward under it."""
        images = getattr(self, "_val_images", [])
        self._val_images = []
        if not images:
            return
        captions = [f"{row['score']:.3f}  {row['prompt']}" for row in rows]
        write_captioned_grid(torch.cat(images), captions, directory / f"{step}.png")



def advantage_defaults(flow: FlowGRPOConfig) -> dict[str, Any]:
    """The ``flow_grpo`` advantage estimator's options of the run's variant, as its reference computes them:
    Flow-GRPO (and -Fast, DiffusionNFT): the population std of the whole batch plus 1e-4 (``PerPromptStatTracker``
    with ``global_std: True``); DanceGRPO and MixGRPO: each group's unbiased std plus 1e-8."""
    if flow.algorithm == "flow_grpo" and (flow.dance_grpo.enable or flow.mix_grpo.enable):
        return {"global_std": False, "std_unbiased": True, "epsilon": 1e-8}
    return {"global_std": True, "std_unbiased": False, "epsilon": 1e-4}


def check_image_size(flow: FlowGRPOConfig, model_path: str) -> None:
    """A ConfigError naming ``trainer.flow_grpo.height`` / ``width`` when the size is not a multiple of what the
    pipeline at ``model_path`` needs (its latent size must be even)."""
    from polyrl_diffusion.models import pixels_per_latent

    multiple = 2 * pixels_per_latent(model_path)
    for key in ("height", "width"):
        value = int(getattr(flow, key))
        if value and value % multiple:
            raise ConfigError(f"trainer.flow_grpo.{key}={value}: give a multiple of {multiple} pixels for this "
                              "model (or 0 for its default size)")


def write_captioned_grid(images: torch.Tensor, captions: list[str], path: Any, columns: int = 8,
                         caption_height: int = 24) -> Any:
    """A PNG of ``images`` (uint8 ``[N, 3, H, W]``) in rows of ``columns``, each with its caption (cut to fit)
    in a white strip under it; returns ``path``."""
    from pathlib import Path

    from PIL import Image, ImageDraw

    n, _, h, w = images.shape
    cols = min(columns, n)
    rows = -(-n // cols)
    sheet = Image.new("RGB", (cols * w, rows * (h + caption_height)), "white")
    chars = max(1, (w - 2) // 6)  # PIL's default bitmap font is about 6 pixels a character
    for i in range(n):
        r, c = divmod(i, cols)
        x, y = c * w, r * (h + caption_height)
        sheet.paste(Image.fromarray(images[i].permute(1, 2, 0).numpy()), (x, y))
        text = captions[i] if i < len(captions) else ""
        lines = [text[j:j + chars] for j in range(0, len(text), chars)][: max(1, caption_height // 11)]
        strip = Image.new("RGB", (w, caption_height), "white")  # drawn apart, so text never runs into a neighbour
        ImageDraw.Draw(strip).multiline_text((2, 1), "\n".join(lines), fill="black", spacing=1)
        sheet.paste(strip, (x, y + h))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(out)
    return out


def images_grid(images: torch.Tensor, columns: int = 8) -> np.ndarray:
    """``uint8 [N, 3, H, W]`` -> one ``[rows * H, columns * W, 3]`` array (blank cells padded)."""
    n, c, h, w = images.shape
    rows = -(-n // columns)
    grid = np.full((rows * h, columns * w, 3), 255, dtype=np.uint8)
    for i in range(n):
        r, col = divmod(i, columns)
        grid[r * h : (r + 1) * h, col * w : (col + 1) * w] = images[i].permute(1, 2, 0).numpy()
    return grid
