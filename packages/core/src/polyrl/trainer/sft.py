"""``polyrl sft``: supervised fine-tuning with the same engines and worker groups as RL.

Rows are verl-format prompts (``prompt`` chat messages) with the target text under
``response`` (``SFTConfig.response_key``), or a ``messages`` list whose last
assistant message is the target. The loss is the token-mean negative
log-likelihood of the response tokens (EOS included).
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

from tensordict import TensorDict

from polyrl.config.loader import record_dict, to_yaml
from polyrl.errors import DataError
from polyrl.logs import progress_bar, setup_run_logging
from polyrl.manifest import Manifest
from polyrl.models.paths import check_model_paths


def sft_examples(rows: list[dict], tokenizer: Any, response_key: str, max_prompt: int, max_response: int,
                 source: str = "data", *, processor: Any = None,
                 image_key: str = "images") -> list[tuple[list[int], list[int], list[Any]]]:
    """Tokenize rows into ``(prompt_ids, response_ids, images)``; errors name the file and row.

    A row with images (``image_key``; a vision-language model's ``processor`` renders its prompt, see
    :func:`polyrl.data.multimodal.encode_image_prompt`) keeps its images, paths resolved against the data
    file's folder; its prompt is never cut (over ``max_prompt`` it is an error). Text rows get ``[]``.
    """
    from polyrl.data.multimodal import encode_image_prompt, row_images

    base_dir = Path(source).resolve().parent if Path(source).exists() else None
    out = []
    for i, row in enumerate(rows):
        if "messages" in row and response_key not in row:
            messages = list(row["messages"])
            if not messages or messages[-1].get("role") != "assistant":
                raise DataError(f"{source} row {i}: 'messages' must end with an assistant message to train on")
            prompt, response = messages[:-1], messages[-1]["content"]
        else:
            if "prompt" not in row or response_key not in row:
                raise DataError(
                    f"{source} row {i}: an SFT row needs 'prompt' (chat messages) and '{response_key}' "
                    f"(target text), or 'messages'; it has {sorted(row)}"
                )
            prompt, response = row["prompt"], row[response_key]
        response_ids = tokenizer(str(response), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        images = row_images(row, image_key)
        if images:
            if processor is None:
                raise DataError(f"{source} row {i} has images ('{image_key}') but the model is text-only (it has no "
                                "image processor): train a vision-language model, or drop the images column")
            try:
                prompt_ids, images, _ = encode_image_prompt(prompt, images, processor, base_dir=base_dir)
            except ValueError as exc:
                raise DataError(f"{source} row {i}: {exc}") from None
            if len(prompt_ids) > max_prompt:  # cutting would cut an image's tokens
                raise DataError(f"{source} row {i}: prompt is {len(prompt_ids)} tokens with its images, over "
                                f"data.max_prompt_length={max_prompt}; raise it")
            out.append((prompt_ids, response_ids[:max_response], images))
            continue
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        prompt_ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
        if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "input_ids"):
            prompt_ids = prompt_ids["input_ids"]
        out.append((list(prompt_ids)[-max_prompt:], response_ids[:max_response], []))
    return out


def sft_batch(examples: list[tuple[list[int], list[int], list[Any]]], pad_token_id: int, *,
              processor: Any = None) -> TensorDict:
    """A training batch (protocol field names) from tokenized SFT examples; with a vision-language model's
    ``processor``, the examples' images (each processed once per batch) and M-RoPE positions too."""
    from polyrl.agent_loops import collate
    from polyrl.protocols import AgentLoopOutput

    outputs = [AgentLoopOutput(prompt_ids=e[0], response_ids=e[1], response_mask=[1] * len(e[1])) for e in examples]
    p_len = max(len(e[0]) for e in examples)
    r_len = max(len(e[1]) for e in examples)
    batch = collate(outputs, pad_token_id=pad_token_id, max_prompt_length=p_len, max_response_length=r_len)
    if processor is not None:
        from polyrl.data.multimodal import ImageInputs, add_multimodal_fields, processor_token_ids

        images = ImageInputs(processor)
        add_multimodal_fields(batch, [images.inputs(e[2]) for e in examples], **processor_token_ids(processor))
    return batch


class SFTTrainer:
    """Runs ``polyrl sft`` for an :class:`polyrl.config.schema.SFTConfig`."""

    def __init__(self, config: Any, *, manifest: Manifest | None = None) -> None:
        from transformers import AutoTokenizer

        from polyrl.data import load_rows
        from polyrl.tracking import check_loggers
        from polyrl.trainer.executor import resolve_executor

        resolve_executor(config)  # auto -> local or ray, before anything loads
        check_loggers(config.trainer.logger)  # every logger's package, before the model and data load
        self.config = config
        self.manifest = manifest
        self.run_dir = Path(config.trainer.run_dir).expanduser().resolve()  # created (and locked) by fit()
        model = config.actor.model
        check_model_paths(model, "actor.model")  # before transformers retries an unreachable Hub
        self.tokenizer = AutoTokenizer.from_pretrained(model.tokenizer_path or model.path)
        from polyrl.data.multimodal import load_processor

        #: A vision-language model's processor (rows with images), else None.
        self.processor = load_processor(model.tokenizer_path or model.path, trust_remote_code=model.trust_remote_code)
        rows: list[dict] = []
        examples = []
        for file in config.data.train_files:
            file_rows = load_rows(file)
            rows += file_rows
            examples += sft_examples(file_rows, self.tokenizer, config.response_key, config.data.max_prompt_length,
                                     config.data.max_response_length, source=str(file), processor=self.processor,
                                     image_key=config.data.image_key)
        if not examples:
            raise DataError("data.train_files holds no rows to train on")
        self.examples = examples
        bs = config.data.train_batch_size
        self.steps_per_epoch = len(examples) // bs
        if self.steps_per_epoch == 0:
            raise DataError(f"data.train_batch_size={bs} is larger than the {len(examples)} SFT examples")
        self.total_steps = config.trainer.total_steps or self.steps_per_epoch * config.trainer.total_epochs
        config.actor.optim.total_steps = self.total_steps
        from polyrl.profiling import check_profile_steps

        self.profile_steps = check_profile_steps(config.trainer.profile.steps, self.total_steps)

    def fit(self) -> dict[str, float]:
        """Train, then export the model as an HF folder to ``RUN_DIR/hf`` (holding the run directory's lock)."""
        from polyrl.trainer.run_dir import RunDirLock, prepare_run_dir

        with RunDirLock(prepare_run_dir(self.config.trainer.run_dir)):
            return self._fit()

    def _fit(self) -> dict[str, float]:
        from polyrl.tracking import Tracker
        from polyrl.trainer.role_groups import open_role_group

        cfg = self.config
        began = time.perf_counter()
        setup_run_logging(self.run_dir)  # RUN_DIR/train.log
        (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        started = open_role_group(cfg, roles=["actor"], manifest=self.manifest, name="sft", run_dir=self.run_dir,
                                  role_kind="sft")
        group = started.group
        tracker = Tracker(cfg.trainer.logger, self.run_dir, project=cfg.trainer.project_name,
                          experiment=cfg.trainer.experiment_name, config=record_dict(cfg))
        bs = cfg.data.train_batch_size
        rng = random.Random(cfg.data.seed)
        order: list[int] = []
        metrics: dict[str, float] = {}
        bar = progress_bar(cfg.trainer.progress_bar, self.total_steps, desc="polyrl sft")
        from polyrl.profiling import StepProfiler

        profiler = StepProfiler([group], self.run_dir, self.profile_steps, memory=cfg.trainer.profile.memory,
                                with_stack=cfg.trainer.profile.with_stack)
        try:
            for step in range(1, self.total_steps + 1):
                if len(order) < bs:
                    fresh = list(range(len(self.examples)))
                    if cfg.data.shuffle:
                        rng.shuffle(fresh)
                    order += fresh
                idx, order = order[:bs], order[bs:]
                batch = sft_batch([self.examples[i] for i in idx], self.tokenizer.pad_token_id, processor=self.processor)
                start = time.perf_counter()
                if step in self.profile_steps:
                    profiler.start(step)
                try:
                    result = group.dispatch("sft_step", batch)
                finally:
                    if step in self.profile_steps:
                        profiler.stop()
                metrics = result if isinstance(result, dict) else {
                    k: sum(r[k] for r in result) / len(result) for k in result[0]}
                metrics["timing/step"] = time.perf_counter() - start
                metrics["throughput/tokens_per_s"] = float(batch["attention_mask"].sum()) / metrics["timing/step"]
                tracker.log(metrics, step)
                if bar is not None:
                    bar.update(1)
            group.call_all("export_hf", str(self.run_dir / "hf"))
        finally:
            if bar is not None:
                bar.close()
            tracker.close()
            started.shutdown()
        if cfg.trainer.report_freq and "jsonl" in cfg.trainer.logger:
            from polyrl.report import ReportWriter

            ReportWriter(self.run_dir).write(live=False)  # a view of the run: a failure is one warning
        logging.getLogger(__name__).info(
            "polyrl sft: finished %d steps in %.0fs; the model is in %s (train on it with model.path=%s)",
            self.total_steps, time.perf_counter() - began, self.run_dir / "hf", self.run_dir / "hf")
        return metrics


