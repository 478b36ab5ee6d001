"""What engine-backed rollouts share: weight checks against a real tiny model, bucket packing, request seeds."""

from __future__ import annotations

import pytest
import torch

from polyrl.rollout.weights import check_named_tensors, hf_param_shapes, pack_bucket, request_seed, unpack_bucket


def test_shapes_and_checks_on_a_real_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    shapes = hf_param_shapes(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert shapes == {n: tuple(p.shape) for n, p in model.named_parameters()}
    good = [(n, p.detach()) for n, p in list(model.named_parameters())[:3]]
    check_named_tensors(good, shapes, rollout="x", model_path="/m")
    with pytest.raises(KeyError, match="x rollout: weight 'model.nope' matches no parameter of the model at /m"):
        check_named_tensors(good + [("model.nope", torch.zeros(1))], shapes, rollout="x", model_path="/m")
    with pytest.raises(ValueError, match=r"'lm_head.weight' has shape \(2, 2\), the model's is"):
        check_named_tensors([("lm_head.weight", torch.zeros(2, 2))], shapes, rollout="x", model_path="/m")
    lora = [("model.layers.0.self_attn.q_proj.lora_A.weight", torch.zeros(2, 2))]
    with pytest.raises(KeyError, match=r"set model\.lora\.sync=merged\.[\"']$"):
        check_named_tensors(lora, shapes, rollout="x", model_path="/m")
    with pytest.raises(KeyError, match="or rollout.x.lora_adapter=true to serve the adapter"):
        check_named_tensors(lora, shapes, rollout="x", model_path="/m", adapter_option="rollout.x.lora_adapter=true")


def test_pack_and_unpack_a_mixed_dtype_bucket():
    bucket = [("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b", torch.tensor([1, 2], dtype=torch.int64)),
              ("c", torch.randn(3, 1, dtype=torch.bfloat16)), ("d", torch.randn(4, 4).t())]  # d: not contiguous
    buffer, entries = pack_bucket(bucket)
    assert buffer.dtype == torch.uint8 and buffer.numel() >= sum(t.numel() * t.element_size() for _, t in bucket)
    assert all(e.offset % 16 == 0 for e in entries)
    back = list(unpack_bucket(buffer.clone(), entries))
    assert [n for n, _ in back] == ["a", "b", "c", "d"]
    for (_, want), (_, got) in zip(bucket, back):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert pack_bucket([])[1] == []


def test_request_seeds_differ_per_offset_and_none_stays_none():
    assert request_seed(None, 3) is None
    assert len({request_seed(5, i) for i in range(8)}) == 8
    assert request_seed(5, 0) == 5


def test_shapes_of_a_mixture_of_experts_include_its_checkpoint_names(tmp_path):
    """Engine-backed rollouts check buckets against both transformers' fused experts and the per-expert names of
    the checkpoint (what vLLM loads and the megatron engine streams)."""
    from safetensors import safe_open

    from polyrl.models.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "moe", arch="qwen3_moe")
    shapes = hf_param_shapes(str(path))
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        disk = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    assert all(shapes[n] == s for n, s in disk.items())
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (4, 128, 64)  # 4 experts, 2 x 64, hidden 64
    assert shapes["model.layers.1.mlp.experts.3.up_proj.weight"] == (64, 64)
