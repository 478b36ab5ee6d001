"""Forward products (``polyrl.protocols.ForwardProducts``) of the FSDP engine against a plain transformers forward
over the whole vocabulary: ``sum_pi_squared``, the top-k log-probs and ids, and log-probs gathered at given ids,
in every input layout (padded, packed, shared prompt), at a temperature, in ``infer_batch`` and (with gradients)
in ``train_batch``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from polyrl.protocols import ForwardProducts

sys.path.insert(0, str(Path(__file__).parent))
from dist_worker import batch, make_engine  # noqa: E402

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from polyrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", size="tiny", seed=0)


def _reference(model, b, row: int, temperature: float) -> torch.Tensor:
    """The full-vocabulary log-softmax ``[n, V]`` at each of the row's response tokens, from transformers."""
    ids = b["input_ids"][row][b["attention_mask"][row].bool()][None]
    n = int(b["response_mask"][row].sum())
    with torch.no_grad():
        logits = model(ids).logits[0, -n - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1)


@pytest.mark.parametrize("layout", ["padded", "packed", "shared_prompt"])
def test_products_equal_a_full_vocabulary_forward(model_dir, layout):
    from transformers import AutoModelForCausalLM

    from polyrl_engine_fsdp.config import FSDPConfig

    b = batch(seed=7, rows=6, group=3 if layout == "shared_prompt" else 1)
    ids = torch.randint(0, 200, (6, 10, 3), generator=torch.Generator().manual_seed(0))
    b["other_ids"] = ids
    engine = make_engine(str(model_dir), micro_batch_size=4, use_remove_padding=layout == "packed",
                         plugin_config=FSDPConfig(shared_prompt=layout == "shared_prompt", shared_prompt_min_tokens=0))
    products = ForwardProducts(sum_pi_squared=True, top_k=4, gather_ids="other_ids")
    out = engine.infer_batch(b, temperature=TEMPERATURE, products=products)
    assert set(out.keys()) == {"log_probs", "sum_pi_squared", "top_k_log_probs", "top_k_ids", "gathered_log_probs"}
    assert out["top_k_ids"].dtype == torch.int64 and out["top_k_log_probs"].shape == (6, 10, 4)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    for row in range(6):
        ref = _reference(model, b, row, TEMPERATURE)
        n = ref.shape[0]
        assert torch.allclose(out["sum_pi_squared"][row, :n], ref.exp().square().sum(-1), atol=1e-5)
        values, top = ref.topk(4, -1)
        assert torch.equal(out["top_k_ids"][row, :n], top)
        assert torch.allclose(out["top_k_log_probs"][row, :n], values, atol=1e-5)
        assert torch.allclose(out["gathered_log_probs"][row, :n], ref.gather(-1, ids[row, :n]), atol=1e-5)
        # zero past the response, like log_probs
        for key in ("sum_pi_squared", "top_k_log_probs", "top_k_ids", "gathered_log_probs"):
            assert not out[key][row, n:].any(), key


def test_products_asked_for_nothing_change_nothing(model_dir):
    b = batch(seed=3, rows=4)
    engine = make_engine(str(model_dir))
    plain = engine.infer_batch(b, temperature=TEMPERATURE)
    with_products = engine.infer_batch(b, temperature=TEMPERATURE, products=ForwardProducts(sum_pi_squared=True))
    assert torch.equal(plain["log_probs"], with_products["log_probs"])
    assert set(engine.infer_batch(b, products=ForwardProducts()).keys()) == {"log_probs"}


def test_gathered_log_probs_reach_the_loss_with_gradients(model_dir):
    """A loss on ``gathered_log_probs`` (the student side of a top-k forward KL) trains: the same step as a loss
    computed from the full log-softmax of an identical engine."""
    b = batch(seed=5, rows=4)
    b["other_ids"] = torch.randint(0, 200, (4, 10, 5), generator=torch.Generator().manual_seed(1))
    weights = torch.rand(4, 10, 5, generator=torch.Generator().manual_seed(2))

    def products_loss(out, mb, scale):
        g = out["gathered_log_probs"]
        assert g.requires_grad
        loss = -(g * mb["w"]).sum(-1).mul(mb["response_mask"]).sum() / scale.batch_num_tokens
        return loss, {"loss": float(loss.detach())}

    b["w"] = weights
    trained = make_engine(str(model_dir), micro_batch_size=2)
    metrics = trained.train_batch(b, products_loss, products=ForwardProducts(gather_ids="other_ids"))
    assert metrics["actor/grad_norm"] > 0
    after = trained.infer_batch(b, products=ForwardProducts(gather_ids="other_ids"))["gathered_log_probs"]
    before = make_engine(str(model_dir)).infer_batch(b, products=ForwardProducts(gather_ids="other_ids"))
    gain = ((after - before["gathered_log_probs"]) * weights).sum(-1).mul(b["response_mask"]).sum()
    assert gain > 0  # the step raised the weighted log-probs it was asked to raise


def test_value_models_and_unknown_fields_are_refused(model_dir):
    b = batch(seed=1, rows=2)
    critic = make_engine(str(model_dir), "critic", "value")
    with pytest.raises(ValueError, match="forward products"):
        critic.infer_batch(b, products=ForwardProducts(sum_pi_squared=True))
    actor = make_engine(str(model_dir))
    with pytest.raises(KeyError, match="no_such_field"):
        actor.infer_batch(b, products=ForwardProducts(gather_ids="no_such_field"))


def test_a_subclass_with_its_own_forward_lists_no_products():
    """A subclass whose ``forward_micro_batch`` takes no ``products`` (polyrl-diffusion's engine) computes none;
    the trainer reads that before any worker starts."""
    from polyrl_engine_fsdp.engine import FSDPEngine

    class OwnForward(FSDPEngine):
        def forward_micro_batch(self, mb, temperature, compute_entropy):
            raise NotImplementedError

    class Declared(OwnForward):
        forward_products = frozenset({"sum_pi_squared"})

    assert FSDPEngine.forward_products == {"sum_pi_squared", "top_k", "gather_ids"}
    assert OwnForward.forward_products == frozenset()
    assert Declared.forward_products == {"sum_pi_squared"}
