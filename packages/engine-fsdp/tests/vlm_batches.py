"""Vision-language batches for the engine tests, and a 2-process gloo scenario (run as a script by the tests).

    python vlm_batches.py RANK WORLD PORT MODEL_DIR OUT_DIR

Each rank trains one step on its shard of the same batch (sharded FSDP2 over the ranks) and rank 0 writes the
metrics and updated weights to ``OUT_DIR/vlm_result_<WORLD>.pt``. With two ranks, rank 1's shard holds no
image at all, so its passes run the blank image through the vision tower (FSDP's gathers in step).
"""

from __future__ import annotations

import os
import sys

import torch

#: Prompts of :func:`image_batch` (two samples each): two images in one row, one image, one of another size,
#: no image.
MIXED = (("Both? <image> <image>", ("red", "blue")), ("Colour: <image>", ("red",)), ("Colour: <image>", ("blue",)),
         ("plain text prompt", ()))
#: Image rows first, then only text rows: split over two ranks, rank 1 has no image.
IMAGES_THEN_TEXT = (("Both? <image> <image>", ("red", "blue")), ("Colour: <image>", ("blue",)),
                    ("plain text prompt", ()), ("another text prompt", ()))


def image_batch(model_dir: str, *, specs=MIXED, generate: bool = True, seed: int = 0):
    """A batch of 8 rows (each prompt of ``specs`` twice, GRPO-style) of the tiny VLM at ``model_dir``. With
    ``generate`` the responses come from the hf rollout (its log-probs as ``rollout_log_probs``); otherwise they
    are random tokens."""
    from PIL import Image

    from polyrl.agent_loops import collate
    from polyrl.data.multimodal import (
        ImageInputs,
        add_multimodal_fields,
        attach_image_inputs,
        encode_image_prompt,
        load_processor,
        processor_token_ids,
    )
    from polyrl.protocols import AgentLoopOutput, GenerationRequest, SamplingParams

    processor = load_processor(model_dir)
    pictures = {"red": Image.new("RGB", (56, 56), (250, 0, 0)), "blue": Image.new("RGB", (84, 56), (0, 0, 250))}
    rows = []
    for text, names in specs:
        images = [pictures[n] for n in names]
        if images:
            ids, _, _ = encode_image_prompt(text, images, processor)
            rows.append({"prompt_ids": ids, "images": images})
        else:
            rows.append({"prompt_ids": processor.tokenizer(text)["input_ids"]})
    samples = attach_image_inputs([r for r in rows for _ in range(2)], ImageInputs(processor))
    g = torch.Generator().manual_seed(seed)
    if generate:
        import types

        from polyrl.rollout.hf import HFRollout

        rollout = HFRollout(types.SimpleNamespace(max_model_len=0, max_batch_size=64, dtype="float32"),
                            model_path=model_dir, tokenizer=processor.tokenizer)
        params = SamplingParams(max_new_tokens=6, n=1, seed=seed, temperature=1.0)
        results = rollout.generate([GenerationRequest(prompt_ids=s["prompt_ids"], sampling_params=params,
                                                      multi_modal=s.get("multi_modal_data")) for s in samples])
        outputs = [AgentLoopOutput(prompt_ids=r.prompt_ids, response_ids=r.response_ids,
                                   response_mask=[1] * len(r.response_ids), log_probs=r.log_probs) for r in results]
    else:
        outputs = []
        for s in samples:
            n = int(torch.randint(2, 7, (1,), generator=g))
            outputs.append(AgentLoopOutput(prompt_ids=s["prompt_ids"], response_mask=[1] * n,
                                           response_ids=torch.randint(20, 200, (n,), generator=g).tolist()))
    batch = collate(outputs, pad_token_id=processor.tokenizer.pad_token_id, max_prompt_length=64,
                    max_response_length=8)
    add_multimodal_fields(batch, [s.get("multi_modal_data") for s in samples], **processor_token_ids(processor))
    batch["advantages"] = torch.randn(len(samples), 1, generator=g).expand(len(samples), 8).contiguous()
    batch["old_log_probs"] = torch.zeros(len(samples), 8)
    return batch


def main() -> None:
    rank, world, port, model_dir, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from dist_worker import loss_fn, make_engine

    batch = image_batch(model_dir, specs=IMAGES_THEN_TEXT, generate=False)
    shard = batch[rank * (8 // world) : (rank + 1) * (8 // world)]  # two ranks: rank 1 has only text rows
    engine = make_engine(model_dir, micro_batch_size=2)
    assert not engine.replicated or world == 1
    metrics = engine.train_batch(shard, loss_fn)
    weights = {n: t.clone() for bucket in engine.weights_for_rollout() for n, t in bucket}
    if rank == 0:
        torch.save({"metrics": metrics, "weights": weights}, os.path.join(out, f"vlm_result_{world}.pt"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    from polyrl.distributed import exit_process

    exit_process(0)  # no interpreter teardown: a rare gloo abort at exit after the work is done
