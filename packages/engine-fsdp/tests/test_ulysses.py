"""Ulysses sequence parallelism (``fsdp.ulysses_sequence_parallel_size``) on CPU with real gloo process groups, the
chunked log-probs, and activation offload."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from polyrl.errors import ConfigError

sys.path.insert(0, str(Path(__file__).parent))
from dist_worker import batch, loss_fn, make_engine, run_ranks  # noqa: E402

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """2 attention heads, 1 KV head: SP=2 splits the heads and repeats the KV head."""
    from polyrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", size="tiny", seed=0)


@pytest.fixture(scope="module")
def mini_dir(tmp_path_factory):
    """4 attention heads, 2 KV heads: SP=2 splits both without repeating."""
    from polyrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("m") / "mini", size="mini", seed=0, num_hidden_layers=2)


def _spawn(world: int, sp: int, model_dir: Path, out: Path, scenarios: str = "", **env_vars: str) -> dict:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env_vars.items():
            mp.setenv(key, value)
        return run_ranks("sp_worker.py", world, [str(model_dir), str(out), str(sp)] + ([scenarios] if scenarios else []),
                         out / f"sp_{world}_{sp}.pt")


def _assert_same_training(ref: dict, other: dict) -> None:
    for name, want in ref.items():
        got = other[name]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), name
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), name
        for key, value in want["infer"].items():
            assert torch.allclose(got["infer"][key], value, atol=1e-5), (name, key)
        assert set(got["weights"]) == set(want["weights"]), name
        for param, w in want["weights"].items():
            assert torch.allclose(got["weights"][param], w, atol=1e-6), (name, param)


def test_sp2_trains_exactly_like_one_rank(model_dir, tmp_path):
    """SP=2 on 2 ranks (one data-parallel group): the same losses, gradient norms, log-probs, entropies, values and
    updated weights as one rank without SP, for the actor and the critic with padded micro-batches, and the actor and
    a LoRA actor with packed, dynamic micro-batches. The KV head is repeated (1 KV head, SP=2)."""
    one = _spawn(1, 1, model_dir, tmp_path)
    two = _spawn(2, 2, model_dir, tmp_path)
    _assert_same_training(one, two)
    for name, found in two.items():
        assert found["layout"] == (0, 1, True), name  # rank 0: group 0 of 1, the collector
    assert two["critic_padded"]["infer"]["values"].abs().sum() == 0  # a new head starts at zero ...
    assert any(abs(a - b) > 1e-4 for a, b in zip(two["actor_padded"]["loss"], two["critic_padded"]["loss"]))
    # ... the trained weights differ from the start, so the comparison above compares training
    # dynamic micro-batches: the token budget is the group's (sp x max_token_len_per_gpu), not one rank's
    from sp_worker import BUDGET

    tokens = [t for step in two["actor_packed"]["micro_batch_tokens"] for t in step]
    assert max(tokens) > BUDGET and max(tokens) <= 2 * BUDGET
    assert len(two["actor_packed"]["micro_batch_tokens"][0]) < len(one["actor_packed"]["micro_batch_tokens"][0])
    assert any(".lora_" not in n for n in two["lora_packed"]["weights"])  # merged LoRA weights were compared
    # export_hf gives a plain transformers model with the engine's log-probs; a checkpoint resumes exactly
    padded = two["actor_padded"]
    assert padded["export_err"] < 1e-5 and padded["resume_err"] < 1e-6 and padded["export_attn"] == "sdpa"


def test_sp2_times_dp2_on_four_ranks(mini_dir, tmp_path):
    """4 ranks as 2 data-parallel groups of SP=2 (4 heads, 2 KV heads: no repeat) train like one rank on packed,
    dynamic micro-batches; each group's first rank collects its group's shard, which is what the controller
    dispatches by. (Padded micro-batches are the 2-rank test's: the layout does not change how they are split.)"""
    one = _spawn(1, 1, mini_dir, tmp_path, "actor_packed")
    four = _spawn(4, 2, mini_dir, tmp_path, "actor_packed")
    _assert_same_training(one, four)


def test_shard_inputs_cover_the_sequence_and_find_each_prediction():
    """Pure layout: the slices of every rank put together are the padded sequence, and each response token's
    predicting state is found on exactly one rank at the local index that holds it."""
    from polyrl_engine_fsdp.engine import _model_inputs, _trim
    from polyrl_engine_fsdp.ulysses import shard_inputs

    b = _trim(batch(seed=3))
    for packed in (False, True):
        inputs = _model_inputs(b, packed=packed)
        ids = inputs["input_ids"]
        rows, s = ids.shape
        flat_pos = torch.arange(rows * s).view(rows, s)  # what a "hidden state" at each position would be
        for size in (2, 3):
            parts = [shard_inputs(inputs, r, size) for r in range(size)]
            glued = torch.cat([p["input_ids"] for p in parts], dim=1)
            assert torch.equal(glued[:, :s], ids) and glued.shape[1] % size == 0
            total = parts[0]["owned_positions"]
            assert sorted(torch.cat(total).tolist()) == list(range(inputs["index"].numel()))
            for r, part in enumerate(parts):
                local = torch.cat([flat_pos, torch.full((rows, glued.shape[1] - s), -1)], dim=1)
                local = local[:, r * part["input_ids"].shape[1] : (r + 1) * part["input_ids"].shape[1]]
                found = local.reshape(-1)[part["index"]]
                assert torch.equal(found, inputs["index"][total[r]]), (packed, size, r)
                assert torch.equal(part["targets"], inputs["targets"][total[r]])


def test_masks_of_the_whole_sequence_match_transformers():
    """The 4-D mask built for the whole (padded) sequence allows exactly what transformers' own sdpa mask allows,
    on every real query (padded and packed rows), and narrowed to a sliding window what transformers' sliding-window
    mask allows."""
    from transformers import AutoConfig
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    from polyrl_engine_fsdp.engine import _model_inputs, _trim
    from polyrl_engine_fsdp.ulysses import _band, shard_inputs

    config = AutoConfig.for_model("qwen2", hidden_size=8, num_attention_heads=2, num_key_value_heads=1)
    config._attn_implementation = "sdpa"
    b = _trim(batch(seed=5))
    for packed in (False, True):
        inputs = _model_inputs(b, packed=packed)
        ids, s = inputs["input_ids"], inputs["input_ids"].shape[1]
        ours = shard_inputs(inputs, 0, 2)["attention_mask"]
        theirs = create_causal_mask(config=config, inputs_embeds=torch.zeros(*ids.shape, 8),
                                    attention_mask=inputs["attention_mask"], past_key_values=None,
                                    position_ids=inputs["position_ids"], allow_is_causal_skip=False)
        real = torch.ones_like(ids, dtype=torch.bool) if packed else inputs["attention_mask"].bool()
        # sliding-window layers: the wrapper narrows the whole-sequence mask to the window itself
        config.sliding_window = 3
        sliding = create_sliding_window_causal_mask(config=config, inputs_embeds=torch.zeros(*ids.shape, 8),
                                                    attention_mask=inputs["attention_mask"], past_key_values=None,
                                                    position_ids=inputs["position_ids"], allow_is_causal_skip=False)
        narrowed = _band(ours, ours.shape[-1], 3, ours.device)
        for row in range(ids.shape[0]):
            q = real[row].nonzero().squeeze(1)
            assert torch.equal(ours[row, 0, q, :s], theirs[row, 0, q, :s]), (packed, row)
            assert torch.equal(narrowed[row, 0, q, :s], sliding[row, 0, q, :s]), (packed, row)


def test_chunked_log_probs_equal_unchunked(model_dir):
    """The LM head in chunks of 1 or 3 tokens gives the log-probs, entropies, gradient norm and updated weights of
    one chunk over every token."""
    b = batch(seed=8)
    whole = make_engine(str(model_dir), logits_chunk_size=1 << 20, micro_batch_size=8)
    want = whole.infer_batch(b, compute_entropy=True)
    m_whole = whole.train_batch(b, loss_fn)
    w_whole = dict(p for bucket in whole.weights_for_rollout() for p in bucket)
    assert int(b["response_mask"].sum()) > 3
    for chunk in (1, 3):
        engine = make_engine(str(model_dir), logits_chunk_size=chunk, micro_batch_size=8)
        got = engine.infer_batch(b, compute_entropy=True)
        assert torch.allclose(got["log_probs"], want["log_probs"], atol=1e-6)
        assert torch.allclose(got["entropy"], want["entropy"], atol=1e-6)
        m = engine.train_batch(b, loss_fn)
        assert m["actor/grad_norm"] == pytest.approx(m_whole["actor/grad_norm"], rel=1e-6)
        weights = dict(p for bucket in engine.weights_for_rollout() for p in bucket)
        assert all(torch.allclose(weights[n], w, atol=1e-6) for n, w in w_whole.items())


def test_activation_offload_moves_saved_tensors_and_keeps_the_step(model_dir):
    """``fsdp.activation_offload``: the saved activations go through CPU copies (non-parameter tensors only), and the
    update is the same as without."""
    from polyrl_engine_fsdp import activation_offload
    from polyrl_engine_fsdp.config import FSDPConfig

    b = batch(seed=9)
    plain = make_engine(str(model_dir), micro_batch_size=8)
    moved = []
    original = activation_offload.offload_activations

    def counting(device, min_bytes=activation_offload.MIN_BYTES):
        hooks = original(device, min_bytes=0)
        pack = hooks.pack_hook

        def spy(tensor):
            packed = pack(tensor)
            if not isinstance(packed, torch.Tensor):
                moved.append(packed[1].numel())
            else:
                assert activation_offload._is_parameter(tensor)  # weights stay: FSDP gathers them again itself
            return packed

        hooks.pack_hook = spy
        return hooks

    import polyrl_engine_fsdp.engine as engine_module

    engine_module.offload_activations, saved = counting, engine_module.offload_activations
    try:
        offloaded = make_engine(str(model_dir), micro_batch_size=8, plugin_config=FSDPConfig(activation_offload=True))
        m2 = offloaded.train_batch(b, loss_fn)
    finally:
        engine_module.offload_activations = saved
    m1 = plain.train_batch(b, loss_fn)
    assert len(moved) > 10  # the decoder layers' saved activations went through the CPU copies
    assert m1["actor/grad_norm"] == pytest.approx(m2["actor/grad_norm"], rel=1e-6)
    w1 = dict(p for bucket in plain.weights_for_rollout() for p in bucket)
    w2 = dict(p for bucket in offloaded.weights_for_rollout() for p in bucket)
    assert all(torch.equal(w1[n], w2[n]) for n in w1)


# ---------------------------------------------------------------------------- bad input, before any process group


def _role(model_dir, sp: int, **kw):
    from polyrl.config.roles import EngineRoleConfig, ModelConfig
    from polyrl_engine_fsdp.config import FSDPConfig

    attn = kw.pop("attn_implementation", "sdpa")
    return EngineRoleConfig(model=ModelConfig(path=str(model_dir), attn_implementation=attn),
                            plugin_config=FSDPConfig(ulysses_sequence_parallel_size=sp), **kw)


@pytest.mark.parametrize(("sp", "world", "role", "kw", "message"), [
    (2, 3, "actor", {}, r"^actor\.fsdp\.ulysses_sequence_parallel_size=2 must divide the 3 ranks of the actor group"),
    (4, 4, "critic", {}, r"^critic\.fsdp\.ulysses_sequence_parallel_size=4 must divide the model's 2 attention heads"),
    (0, 2, "ref", {}, r"^ref\.fsdp\.ulysses_sequence_parallel_size=0 must be 1"),
    (2, 2, "actor", {"attn_implementation": "eager"}, r"needs actor\.model\.attn_implementation sdpa"),
    (2, 2, "actor", {"attn_implementation": "flash_attention_2"}, r"needs actor\.use_remove_padding=true"),
])
def test_bad_layouts_are_one_line_naming_the_key(model_dir, monkeypatch, sp, world, role, kw, message):
    from polyrl_engine_fsdp.engine import FSDPEngine

    def no_group(*args, **kwargs):
        raise AssertionError("the layout check started a process group")

    monkeypatch.setattr(torch.distributed, "init_process_group", no_group)
    monkeypatch.setattr(torch.distributed, "new_group", no_group)
    with pytest.raises(ConfigError, match=message) as err:
        FSDPEngine.data_parallel_size(_role(model_dir, sp, **kw), world, role=role)
    assert "\n" not in str(err.value)


def test_good_layouts_give_the_data_parallel_size(model_dir):
    from polyrl_engine_fsdp.engine import FSDPEngine

    assert FSDPEngine.data_parallel_size(_role(model_dir, 2), 4) == 2
    assert FSDPEngine.data_parallel_size(_role(model_dir, 1), 3) == 3
    packed_flash = _role(model_dir, 2, attn_implementation="flash_attention_2", use_remove_padding=True)
    assert FSDPEngine.data_parallel_size(packed_flash, 2) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_sp2_on_two_gpus_with_flash_attention(model_dir, tmp_path):
    """Not run yet (no multi-GPU machine): SP=2 over nccl with flash attention on packed sequences, against SP=1."""
    pytest.importorskip("flash_attn")
    on_gpu = {"SP_WORKER_DEVICE": "cuda", "SP_WORKER_ATTN": "flash_attention_2"}
    one = _spawn(1, 1, model_dir, tmp_path, **on_gpu)
    two = _spawn(2, 2, model_dir, tmp_path, **on_gpu)
    assert set(one) == set(two) == {"actor_packed", "lora_packed"}
    for name in one:  # flash attention computes in bf16: close, not equal
        assert two[name]["grad_norm"] == pytest.approx(one[name]["grad_norm"], rel=2e-2)
        assert torch.allclose(two[name]["infer"]["log_probs"], one[name]["infer"]["log_probs"], atol=5e-2)
