"""The FSDP engine's vision-language path (Qwen2-VL, Qwen2.5-VL), beside the text one.

A batch of a vision-language run carries each row's image tensors (``multi_modal_inputs``, a non-tensor
field) and Qwen-VL's rotary positions ``mrope_position_ids`` ``[B, 3, S]`` (see
:mod:`polyrl.data.multimodal`). :func:`multimodal_model_inputs` turns a micro-batch into the model's
inputs in the same three forms as the text path: padded rows, one packed row (``use_remove_padding``:
positions ``[4, 1, T]``, the text positions first so transformers masks each sequence), or the shared-prompt
form (each distinct prompt *with its images* runs once, its KV cache copied to its samples' responses).

The image features replace the prompts' image tokens in the input embeddings (:func:`embed_with_images`),
not every image token of the sequence: a response that sampled the image token (a small random model does)
keeps it as a token, as the rollout did. When the model is sharded, every rank runs the vision tower in
every pass (FSDP all-gathers its blocks, a collective): a micro-batch without images runs a one-patch blank
image through it (:func:`blank_image_inputs`) and adds nothing from it to the result.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict
from torch import nn

from polyrl.batch import non_tensor
from polyrl.data.multimodal import MROPE_POSITION_IDS, MULTI_MODAL_INPUTS, concat_model_inputs


def is_vision_language(hf_config: Any) -> bool:
    """Whether an HF config is a vision-language model's (it has a ``vision_config``)."""
    return getattr(hf_config, "vision_config", None) is not None


def vision_tower_names(model: nn.Module) -> list[str]:
    """Qualified names of the model's vision tower modules (Qwen-VL's ``visual``, under whatever prefix)."""
    return [name for name, _ in model.named_modules() if name == "visual" or name.endswith(".visual")]


def freeze_vision_tower(model: nn.Module) -> int:
    """Stop training the vision tower (patch embedding, blocks and the merger into the language model);
    returns how many parameters were frozen."""
    frozen = 0
    for name in vision_tower_names(model):
        for p in model.get_submodule(name).parameters():
            if p.requires_grad:
                p.requires_grad_(False)
                frozen += p.numel()
    return frozen


def is_vision_parameter(hf_name: str) -> bool:
    """Whether an HF parameter name belongs to the vision tower (``visual.*`` or ``model.visual.*``)."""
    return hf_name.startswith("visual.") or ".visual." in hf_name


def lora_exclude_pattern() -> str:
    """peft's ``exclude_modules`` for LoRA on the language model only: every module inside the vision tower."""
    return r"(.*\.)?visual(\..*)?"


def blank_image_inputs(vision_config: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """A single merged patch of zeros in the vision tower's input layout (``pixel_values`` ``[merge**2, D]``,
    ``image_grid_thw`` ``[[1, merge, merge]]``): what a rank without images runs to keep FSDP's gathers in step."""
    merge = int(vision_config.spatial_merge_size)
    dim = int(vision_config.in_channels) * int(vision_config.temporal_patch_size) * int(vision_config.patch_size) ** 2
    return {"pixel_values": torch.zeros(merge * merge, dim, device=device),
            "image_grid_thw": torch.tensor([[1, merge, merge]], device=device)}


def embed_with_images(backbone: nn.Module, input_ids: torch.Tensor, images: dict[str, torch.Tensor],
                      image_mask: torch.Tensor | None) -> torch.Tensor:
    """The input embeddings of ``input_ids`` with the vision tower's features of ``images`` in place of the
    image tokens ``image_mask`` marks (the prompts' own; a sampled image token in a response stays a token,
    as it was when sampled). Without ``image_mask`` the images are a blank run: their features join the graph
    with weight 0 (the vision tower ran, as on the ranks with images)."""
    embeds = backbone.get_input_embeddings()(input_ids)
    out = backbone.get_image_features(images["pixel_values"], images["image_grid_thw"])
    features = out.pooler_output if hasattr(out, "pooler_output") else out  # transformers 5 / 4.x
    features = torch.cat(list(features)) if isinstance(features, (tuple, list)) else features
    if image_mask is None:
        return embeds + 0.0 * features.sum()
    if int(image_mask.sum()) != features.shape[0]:
        raise ValueError(f"the micro-batch's prompts hold {int(image_mask.sum())} image tokens, its images make "
                         f"{features.shape[0]} features (grids {images['image_grid_thw'].tolist()})")
    return embeds.masked_scatter(image_mask.unsqueeze(-1), features.to(embeds.dtype))


def _same_images(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor] | None) -> bool:
    if a is None or b is None:
        return a is b
    return all(a[k] is b[k] or (a[k].shape == b[k].shape and torch.equal(a[k], b[k])) for k in a)


def multimodal_model_inputs(mb: TensorDict, *, image_token_id: int, packed: bool, shared_prompt: bool = False,
                            uniform: bool = False) -> dict[str, Any]:
    """The model's inputs for a vision-language micro-batch: the text path's ``_model_inputs`` plus ``images``
    (the image tensors of the rows that run, concatenated in order; ``{}`` when none has images) and
    ``image_mask`` (the prompts' image tokens in the ids the images go with).

    Positions are Qwen-VL's M-RoPE ``[3, b, S]`` (``[4, 1, T]`` packed, the text positions first). A batch
    without ``mrope_position_ids`` (text rows only) uses its text positions on all three axes.
    """
    from polyrl_engine_fsdp.engine import _packs_cleanly

    ids, attn, pos = mb["input_ids"], mb["attention_mask"], mb["position_ids"]
    mrope = mb[MROPE_POSITION_IDS] if MROPE_POSITION_IDS in mb.keys() else pos[:, None, :].expand(-1, 3, -1)
    images = non_tensor(mb, MULTI_MODAL_INPUTS, None)
    b, s = ids.shape
    r = mb["responses"].shape[1]
    valid = attn.bool()
    prev = torch.cat([torch.zeros(b, 1, dtype=torch.bool), valid[:, :-1]], dim=1)
    rows, cols = (valid[:, s - r :] & prev[:, s - r :]).nonzero(as_tuple=True)
    pred_col = s - r - 1 + cols
    targets = mb["responses"][rows, cols]
    found = {"targets": targets, "rows": rows, "cols": cols}
    in_prompt = torch.arange(s) < s - r
    image_mask = (ids == image_token_id) & in_prompt & valid
    if shared_prompt and not packed and s > r:
        # distinct prompts: the same ids, mask *and* images (two rows may ask the same question of two images)
        key = torch.cat([ids[:, : s - r], attn[:, : s - r]], dim=1)
        _, text_of_row = torch.unique(key, dim=0, return_inverse=True)
        leads: list[int] = []
        by_text: dict[int, list[int]] = {}
        prompt_of_row = []
        for i in range(b):
            candidates = by_text.setdefault(int(text_of_row[i]), [])
            match = next((u for u in candidates if _same_images(images[leads[u]], images[i])), None)
            if match is None:
                match = len(leads)
                leads.append(i)
                candidates.append(match)
            prompt_of_row.append(match)
        if (len(leads) < b or uniform) and bool(valid[:, s - r - 1].all()):
            lead = torch.tensor(leads)
            return {"input_ids": ids[:, s - r :], "attention_mask": attn,
                    "position_ids": mrope[:, :, s - r :].permute(1, 0, 2),
                    "prompt_ids": ids[lead, : s - r], "prompt_mask": attn[lead, : s - r],
                    "prompt_positions": mrope[lead, :, : s - r].permute(1, 0, 2),
                    "prompt_of_row": torch.tensor(prompt_of_row), "index": rows * r + cols,
                    "images": concat_model_inputs(images[i] for i in leads),
                    "image_mask": image_mask[lead, : s - r], **found}
    if packed and _packs_cleanly(pos, valid):
        place = (valid.flatten().cumsum(0) - 1).view(b, s)
        positions = torch.cat([pos[valid][None], mrope.permute(1, 0, 2)[:, valid]])[:, None, :]  # [4, 1, T]
        return {"input_ids": ids[valid][None], "attention_mask": None, "position_ids": positions,
                "index": place[rows, pred_col], "images": concat_model_inputs(images),
                "image_mask": image_mask[valid][None], **found}
    return {"input_ids": ids, "attention_mask": attn, "position_ids": mrope.permute(1, 0, 2),
            "index": rows * s + pred_col, "images": concat_model_inputs(images), "image_mask": image_mask, **found}
