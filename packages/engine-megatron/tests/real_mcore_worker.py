"""One rank of the megatron engine over the real SmolLM2-135M-Instruct (spawned by tests/test_real_model.py).

``python real_mcore_worker.py RANK WORLD PORT MODEL_DIR OUT LAYOUT``: converts the HF folder into ``LAYOUT`` (see
engine_dist.parse_layout), takes the log-probs of chat-templated answers, the weights it would send a rollout before
any step (the HF -> Megatron -> HF round trip), one GRPO step, and the log-probs and weights after it; writes
``OUT/real_<LAYOUT>_rank<RANK>.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

QA = [("What is 7+8? Answer with the number only.", "7 + 8 = 15"),
      ("What is 7+8? Answer with the number only.", "The answer is 16."),
      ("Name a primary colour.", "Red is a primary colour."),
      ("Name a primary colour.", "Green, I think.")]
REWARDS = [1.0, 0.0, 1.0, 0.0]


def real_batch(model_dir: str):
    """Two GRPO groups of two chat-templated answers (ending with ``<|im_end|>``), with their GRPO advantages."""
    from transformers import AutoTokenizer

    from polyrl.agent_loops import collate
    from polyrl.algorithms.advantages import compute_grpo_outcome_advantage
    from polyrl.protocols import AgentLoopOutput

    tok = AutoTokenizer.from_pretrained(model_dir)
    outs = []
    for question, answer in QA:
        prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        response = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        outs.append(AgentLoopOutput(prompt_ids=prompt, response_ids=response, response_mask=[1] * len(response)))
    b = collate(outs, pad_token_id=tok.pad_token_id, max_prompt_length=64, max_response_length=16)
    rewards = torch.zeros(4, 16)
    rewards[torch.arange(4), b["response_mask"].sum(-1) - 1] = torch.tensor(REWARDS)
    b["advantages"] = compute_grpo_outcome_advantage(rewards, b["response_mask"], index=[0, 0, 1, 1])[0]
    return b


def response_log_probs(model, b) -> torch.Tensor:
    """``[rows, response length]`` log-probs of each row's response under a transformers ``model`` (0 on padding)."""
    out = torch.zeros(b["response_mask"].shape)
    for row in range(b["input_ids"].shape[0]):
        ids = b["input_ids"][row][b["attention_mask"][row].bool()][None]
        n = int(b["response_mask"][row].sum())
        with torch.no_grad():
            logits = model(ids).logits[0, -n - 1 : -1]
        out[row, :n] = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, -n:, None])[:, 0]
    return out


def hf_side(model_dir: str, b, exported: dict, trained: dict) -> dict:
    """transformers' view: the log-probs of the folder's model; whether the round trip gave back every tensor of the
    folder bit for bit; and the log-probs of the folder's model with the trained weights loaded into it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder = {n: t for f in sorted(Path(model_dir).glob("*.safetensors")) for n, t in load_file(str(f)).items()}
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    hf_before = response_log_probs(model, b)
    missing, unexpected = model.load_state_dict(trained, strict=False)
    return {"response_mask": b["response_mask"], "hf_before": hf_before, "hf_after": response_log_probs(model, b),
            "round_trip_names": sorted(exported) == sorted(folder),
            "round_trip_exact": all(torch.equal(exported[n], folder[n]) for n in folder if n in exported),
            "trained_names": sorted(trained), "load_missing": list(missing), "load_unexpected": list(unexpected),
            "tied_after": bool(model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()),
            "embedding_moved": float((trained["model.embed_tokens.weight"] - folder["model.embed_tokens.weight"])
                                     .abs().max())}


def main() -> None:
    rank, world, port, model_dir, out, layout = sys.argv[1:7]
    import warnings

    warnings.filterwarnings("ignore")
    from engine_dist import _full_weights, make_engine, parse_layout

    from polyrl.config.schema import ActorConfig
    from polyrl.distributed import init_distributed
    from polyrl.trainer.losses import make_actor_loss

    init_distributed("gloo", int(rank), int(world), "127.0.0.1", int(port))
    engine = make_engine(model_dir, lr=1e-5, **parse_layout(layout))
    b = real_batch(model_dir)
    shard = b  # no data parallelism in the layouts this runs (tp1, pp2)
    exported = _full_weights(engine)  # before any step: what the conversion holds, back in HF names
    before = engine.infer_batch(shard)
    metrics = engine.train_batch(shard, make_actor_loss(ActorConfig(), on_policy=True))
    after = engine.infer_batch(shard)
    trained = _full_weights(engine)
    result = {"collects": engine.collects_output, "before": before.to_dict(), "after": after.to_dict(),
              "metrics": metrics}
    if int(rank) == 0:  # every rank got every tensor; one compares them with transformers
        result.update(hf_side(model_dir, b, exported, trained))
    torch.save(result, Path(out) / f"real_{layout}_rank{rank}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(Path(__file__).parent))
    main()
    from polyrl.distributed import exit_process

    exit_process(0)
