"""The FSDP engine training vision-language models (tiny Qwen2-VL and Qwen2.5-VL built in code), on CPU with
real gloo process groups: log-probs equal the hf rollout's on image rows in every batching form, two ranks
(one without images) train like one, the vision tower frozen or trained, LoRA on the language model, export."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from polyrl.errors import ConfigError

sys.path.insert(0, str(Path(__file__).parent))
from dist_worker import loss_fn, make_engine, run_ranks  # noqa: E402
from vlm_batches import IMAGES_THEN_TEXT, MIXED, image_batch  # noqa: E402

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory, tiny_vlm_dir):
    from polyrl.models.tiny_vlm import make_tiny_vlm

    return {"qwen2_vl": tiny_vlm_dir,
            "qwen2_5_vl": make_tiny_vlm(tmp_path_factory.mktemp("vlm25") / "model", arch="qwen2_5_vl", seed=1)}


@pytest.fixture(scope="module")
def generated(vlm_dirs):
    """Per architecture: a batch whose responses the hf rollout sampled from the images (rows with two images,
    one image, none)."""
    return {arch: image_batch(str(path), specs=MIXED) for arch, path in vlm_dirs.items()}


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("form", [
    {},  # padded rows, each distinct prompt (with its images) run once: the shared-prompt form
    {"use_remove_padding": True},  # one packed row, positions [4, 1, T]
    {"use_dynamic_bsz": True, "max_token_len_per_gpu": 70},  # micro-batches by token budget
    {"plugin_config": "no_shared_prompt"},
], ids=["shared", "packed", "dynamic", "padded"])
def test_log_probs_equal_the_rollouts_on_image_rows(vlm_dirs, generated, arch, form):
    from polyrl_engine_fsdp.config import FSDPConfig

    kw = dict(form)
    if kw.get("plugin_config") == "no_shared_prompt":
        kw["plugin_config"] = FSDPConfig(shared_prompt=False)
    batch = generated[arch]
    engine = make_engine(str(vlm_dirs[arch]), micro_batch_size=3, **kw)
    log_probs = engine.infer_batch(batch)["log_probs"]
    mask = batch["response_mask"].bool()
    assert mask.sum() > 20
    err = (log_probs - batch["rollout_log_probs"])[mask].abs().max()
    assert err < 1e-5, f"{arch} {form}: max |engine - rollout| = {err}"


def test_images_change_the_log_probs(vlm_dirs, generated):
    """The engine reads the images: the same batch with one row's image changed scores that row differently
    and the others as before."""
    from polyrl.batch import non_tensor, set_non_tensor
    from polyrl.data.multimodal import MULTI_MODAL_INPUTS

    batch = generated["qwen2_vl"].clone()
    engine = make_engine(str(vlm_dirs["qwen2_vl"]), micro_batch_size=8)
    before = engine.infer_batch(batch)["log_probs"]
    rows = non_tensor(batch, MULTI_MODAL_INPUTS)
    rows[2] = dict(rows[2], pixel_values=rows[2]["pixel_values"] + 1.0)  # the same size, other pixels
    set_non_tensor(batch, MULTI_MODAL_INPUTS, rows)
    after = engine.infer_batch(batch)["log_probs"]
    mask = batch["response_mask"].bool()
    assert (after - before)[2][mask[2]].abs().max() > 1e-4
    assert torch.allclose(after[3], before[3], atol=1e-6) and torch.allclose(after[0], before[0], atol=1e-6)


def _run_two(world: int, model_dir: Path, out: Path) -> dict:
    return run_ranks("vlm_batches.py", world, [str(model_dir), str(out)], out / f"vlm_result_{world}.pt",
                     hang_hint=": a rank without images left FSDP's gathers out of step?")


def test_two_sharded_ranks_one_without_images_train_like_one(vlm_dirs, tmp_path):
    """FSDP2 over two gloo ranks, rank 1's shard holding text rows only (it runs a blank image through the
    vision tower to keep the all-gathers in step): the step equals one rank's step over the whole batch."""
    engine = make_engine(str(vlm_dirs["qwen2_vl"]), micro_batch_size=2)  # one rank, in this process
    metrics = engine.train_batch(image_batch(str(vlm_dirs["qwen2_vl"]), specs=IMAGES_THEN_TEXT, generate=False), loss_fn)
    one = {"metrics": metrics, "weights": {n: t.clone() for bucket in engine.weights_for_rollout() for n, t in bucket}}
    two = _run_two(2, vlm_dirs["qwen2_vl"], tmp_path)
    assert one["metrics"]["actor/grad_norm"] == pytest.approx(two["metrics"]["actor/grad_norm"], rel=1e-5)
    assert set(one["weights"]) == set(two["weights"])
    for name, w in one["weights"].items():
        assert torch.allclose(w, two["weights"][name], atol=1e-6), name
    assert any("visual" in n for n in one["weights"])


def _vision(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters() if ".visual." in n}


def _language(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()
            if ".visual." not in n and "lora_" not in n}


@pytest.mark.parametrize("freeze", [False, True])
def test_vision_tower_trained_or_frozen(vlm_dirs, generated, freeze):
    from polyrl.config.roles import EngineRoleConfig, ModelConfig, OptimConfig
    from polyrl.platforms import CPUPlatform
    from polyrl_engine_fsdp.engine import FSDPEngine

    cfg = EngineRoleConfig(model=ModelConfig(path=str(vlm_dirs["qwen2_vl"]), freeze_vision_tower=freeze),
                           optim=OptimConfig(lr=1e-2), micro_batch_size=8)
    engine = FSDPEngine(cfg, role="actor", platform=CPUPlatform())
    vision, language = _vision(engine), _language(engine)
    engine.train_batch(generated["qwen2_vl"], loss_fn)
    moved = {n for n, p in _vision(engine).items() if not torch.equal(p, vision[n])}
    assert (not moved) if freeze else len(moved) == len(vision)
    assert any(not torch.equal(p, language[n]) for n, p in _language(engine).items())
    names = [n for bucket in engine.weights_for_rollout() for n, _ in bucket]
    sent_vision = [n for n in names if n.startswith("model.visual.")]
    assert (not sent_vision) if freeze else len(sent_vision) == len(vision)
    assert "lm_head.weight" in names and any(n.startswith("model.language_model.layers.") for n in names)


def test_lora_on_the_language_model_only(vlm_dirs, generated):
    from polyrl.config.roles import EngineRoleConfig, LoRAConfig, ModelConfig, OptimConfig
    from polyrl.platforms import CPUPlatform
    from polyrl_engine_fsdp.engine import FSDPEngine

    cfg = EngineRoleConfig(model=ModelConfig(path=str(vlm_dirs["qwen2_vl"]), lora=LoRAConfig(rank=4)),
                           optim=OptimConfig(lr=1e-2), micro_batch_size=8)
    engine = FSDPEngine(cfg, role="actor", platform=CPUPlatform())
    lora = [n for n, _ in engine.module.named_parameters() if "lora_" in n]
    assert lora and not any(".visual." in n for n in lora)
    before = engine.infer_batch(generated["qwen2_vl"])["log_probs"]
    engine.train_batch(generated["qwen2_vl"], loss_fn)
    assert not torch.equal(engine.infer_batch(generated["qwen2_vl"])["log_probs"], before)
    names = [n for bucket in engine.weights_for_rollout() for n, _ in bucket]
    assert not any("visual" in n for n in names)  # frozen by LoRA: the rollout keeps its own
    assert all("lora" not in n and "base_layer" not in n for n in names)


def test_export_loads_as_the_same_model(vlm_dirs, generated, tmp_path):
    from transformers import AutoModelForImageTextToText

    from polyrl.data.multimodal import load_processor

    engine = make_engine(str(vlm_dirs["qwen2_5_vl"]), micro_batch_size=8, lr=1e-2)
    engine.train_batch(generated["qwen2_5_vl"], loss_fn)
    engine.export_hf(str(tmp_path / "hf"))
    for name in ("preprocessor_config.json", "chat_template.jinja", "tokenizer.json", "model.safetensors"):
        assert (tmp_path / "hf" / name).is_file(), name
    assert load_processor(str(tmp_path / "hf")) is not None
    reloaded = make_engine(str(tmp_path / "hf"), micro_batch_size=8)
    assert torch.allclose(reloaded.infer_batch(generated["qwen2_5_vl"])["log_probs"],
                          engine.infer_batch(generated["qwen2_5_vl"])["log_probs"], atol=1e-5)
    assert type(AutoModelForImageTextToText.from_pretrained(tmp_path / "hf")).__name__ == \
        "Qwen2_5_VLForConditionalGeneration"


def test_a_critic_on_a_vision_language_model_is_refused(vlm_dirs):
    with pytest.raises(ConfigError, match="value model .critic. on a vision-language model"):
        make_engine(str(vlm_dirs["qwen2_vl"]), role="critic", model_type="value")
