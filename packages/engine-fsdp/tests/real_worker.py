"""One rank of the FSDP engine over the real SmolLM2-135M-Instruct (spawned by tests/test_real_model.py): log-probs
of chat-templated answers before a step, one policy-gradient step, the gradient norm and the log-probs after."""

from __future__ import annotations

import os
import sys

import torch
from dist_worker import loss_fn, make_engine

QA = [("What is 7+8? Answer with the number only.", "7 + 8 = 15"),
      ("Tom has 3 apples and buys 4 more. How many apples does he have now?", "Tom has 3 + 4 = 7 apples."),
      ("What is 12 times 3?", "12 times 3 is 36."),
      ("Name a primary colour.", "Red is a primary colour.")]


def real_batch(model_dir: str):
    """The four question/answer pairs as a batch: prompts through the model's chat template, answers ending with
    ``<|im_end|>``; advantages of alternating sign."""
    from transformers import AutoTokenizer

    from polyrl.agent_loops import collate
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
    b["advantages"] = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None].expand(4, 16).contiguous()
    b["old_log_probs"] = torch.zeros(4, 16)
    return b


def main() -> None:
    rank, world, port, model_dir, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    full = real_batch(model_dir)
    shard = full[rank * (4 // world) : (rank + 1) * (4 // world)]
    engine = make_engine(model_dir, lr=1e-5, micro_batch_size=2)
    before = engine.infer_batch(shard)["log_probs"]
    metrics = engine.train_batch(shard, loss_fn)
    after = engine.infer_batch(shard)["log_probs"]
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, (before, after))
    if rank == 0:
        torch.save({"before": torch.cat([g[0] for g in gathered]), "after": torch.cat([g[1] for g in gathered]),
                    "grad_norm": metrics["actor/grad_norm"]},
                   os.path.join(out, f"real_{world}.pt"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
