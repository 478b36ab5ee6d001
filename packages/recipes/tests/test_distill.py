"""On-policy distillation: its losses against their formulas, the teacher's log-probs against a plain forward of the
teacher (also through a teacher whose tokenizer numbers the same tokens differently), and a teacher with another
vocabulary refused at start-up."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from polyrl_recipes.config import DistillConfig
from polyrl_recipes.distill import VocabularyMap, distillation_loss, forward_kl_topk, make_distill_loss, reverse_kl

from polyrl.errors import ConfigError
from polyrl.protocols import LossScale

sys.path.insert(0, str(Path(__file__).parent))
from recipes_testkit import permuted_copy  # noqa: E402


def _tensors():
    g = torch.Generator().manual_seed(0)
    student = -torch.rand(3, 4, generator=g) * 3
    teacher = -torch.rand(3, 4, generator=g) * 3
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    return student, teacher, mask


def test_reverse_kl_estimators_follow_their_formulas():
    s, t, _ = _tensors()
    for i in range(3):
        for j in range(4):
            d = float(s[i, j] - t[i, j])
            assert float(reverse_kl(s, t, "k1")[i, j]) == pytest.approx(d, abs=1e-6)
            assert float(reverse_kl(s, t, "k2")[i, j]) == pytest.approx(d * d / 2, abs=1e-6)
            assert float(reverse_kl(s, t, "k3")[i, j]) == pytest.approx(math.exp(-d) + d - 1, abs=1e-5)
            assert float(reverse_kl(s, t, "abs")[i, j]) == pytest.approx(abs(d), abs=1e-6)


def test_supervised_reverse_kl_loss_is_the_token_mean_of_the_estimator():
    s, t, mask = _tensors()
    student = s.clone().requires_grad_(True)
    cfg = _actor_config()
    loss, metrics = distillation_loss({"log_probs": student}, _micro_batch(t, mask), LossScale(), DistillConfig(
        loss_mode="k3"), cfg, on_policy=True)
    d = (s - t)[mask.bool()]
    assert float(loss.detach()) == pytest.approx(float(((-d).exp() + d - 1).mean()), rel=1e-5)
    loss.backward()
    # d/dlog s of exp(t - s) - (t - s) - 1 is 1 - exp(t - s), over the token count
    expected = (1 - (t - s).exp()) * mask / mask.sum()
    assert torch.allclose(student.grad, expected, atol=1e-6)
    assert metrics["distill/kl_k1"] == pytest.approx(float(d.mean()), abs=1e-6)


def test_policy_gradient_reverse_kl_is_the_ppo_loss_with_the_negative_kl_as_advantage():
    """Thinking Machines' on-policy distillation: advantage ``-(log s - log t)`` per token; on-policy the gradient
    is ``-A grad log s`` (token mean)."""
    s, t, mask = _tensors()
    student = s.clone().requires_grad_(True)
    loss, _ = distillation_loss({"log_probs": student}, _micro_batch(t, mask), LossScale(), DistillConfig(
        loss_mode="k1", use_policy_gradient=True), _actor_config(), on_policy=True)
    loss.backward()
    adv = -(s - t)
    assert float(loss.detach()) == pytest.approx(float(-(adv * mask).sum() / mask.sum()), rel=1e-5)
    assert torch.allclose(student.grad, -adv * mask / mask.sum(), atol=1e-6)


def test_forward_kl_on_the_teachers_top_k():
    g = torch.Generator().manual_seed(1)
    t = torch.log_softmax(torch.randn(2, 3, 5, generator=g), -1)[..., :3]  # the teacher's top-3 of 5
    s = torch.log_softmax(torch.randn(2, 3, 5, generator=g), -1)[..., :3]
    t[1, 2, 2] = float("-inf")  # a teacher token the student does not have
    loss, mass = forward_kl_topk(s, t)
    for i in range(2):
        for j in range(3):
            terms = [math.exp(t[i, j, k]) * (t[i, j, k] - s[i, j, k]) for k in range(3) if math.isfinite(t[i, j, k])]
            assert float(loss[i, j]) == pytest.approx(max(0.0, float(sum(terms))), abs=1e-6)
            assert float(mass["teacher_mass"][i, j]) == pytest.approx(
                sum(math.exp(t[i, j, k]) for k in range(3) if math.isfinite(t[i, j, k])), abs=1e-6)
    assert torch.isfinite(loss).all()


def test_the_mixture_adds_the_task_loss_times_coef():
    s, t, mask = _tensors()
    mb = _micro_batch(t, mask)
    mb["advantages"] = torch.tensor([[1.0], [-0.5], [2.0]]).expand(3, 4).contiguous()
    out = {"log_probs": s.clone().requires_grad_(True)}
    cfg = _actor_config()
    only = make_distill_loss(cfg, DistillConfig(loss_mode="k3", use_task_rewards=False), on_policy=True)(
        out, mb, LossScale())[0]
    mixed = make_distill_loss(cfg, DistillConfig(loss_mode="k3", use_task_rewards=True, coef=0.3), on_policy=True)(
        out, mb, LossScale())[0]
    task = -(mb["advantages"] * mask).sum() / mask.sum()  # vanilla PPO at ratio 1, token mean
    assert float(mixed.detach()) == pytest.approx(float(task) + 0.3 * float(only.detach()), rel=1e-5)


def test_vocabulary_map_is_exact_or_refused():
    student = {"a": 0, "b": 1, "<e>": 2}
    same = VocabularyMap(student, dict(student))
    assert same.identity and torch.equal(same.teacher_ids(torch.tensor([2, 0])), torch.tensor([2, 0]))
    swapped = VocabularyMap(student, {"a": 2, "b": 0, "<e>": 1})
    assert not swapped.identity
    assert swapped.teacher_ids(torch.tensor([0, 1, 2])).tolist() == [2, 0, 1]
    assert swapped.student_ids(torch.tensor([2, 0, 1, 7])).tolist() == [0, 1, 2, -1]  # 7: a padding row
    with pytest.raises(ValueError, match="1 of the student's 3 tokens are not in the teacher's"):
        VocabularyMap(student, {"a": 0, "b": 1})
    with pytest.raises(ValueError, match="the teacher's vocabulary has 1 tokens the student's lacks"):
        VocabularyMap(student, {**student, "ab": 3})


def _actor_config():
    from polyrl.config.schema import ActorConfig

    return ActorConfig()


def _micro_batch(teacher, mask):
    from tensordict import TensorDict

    return TensorDict({"teacher_log_probs": teacher, "response_mask": mask}, batch_size=[teacher.shape[0]])


# ---------------------------------------------------------------------------- the teacher role, for real


@pytest.fixture(scope="module")
def teacher_dirs(tmp_path_factory, tiny_model):
    """A teacher (another random init of the tiny model) and the same teacher with its vocabulary renumbered."""
    from polyrl.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("teachers")
    teacher = make_tiny_model(root / "teacher", size="tiny", seed=7)
    return {"teacher": teacher, "permuted": permuted_copy(teacher, root / "permuted", seed=3)}


def _local_groups(config, trainer):
    from polyrl.trainer.role_groups import build_role_groups

    return build_role_groups(config, manifest=None, use_ref=trainer.use_ref, use_critic=trainer.use_critic,
                             run_dir=Path(config.trainer.run_dir), worker_cls=trainer.worker_cls,
                             extra_roles=trainer.role_specs)


@pytest.mark.parametrize("which", ["teacher", "permuted"])
def test_teacher_log_probs_equal_a_plain_forward_of_the_teacher(base_overrides, teacher_dirs, which):
    """The teacher role's log-probs of the student's samples (and its top-k, mapped to the student's ids) equal a
    transformers forward of the teacher on the same tokens; a teacher whose tokenizer numbers the tokens
    differently gives the same numbers through the id map."""
    from polyrl_recipes.distill import DistillTrainer
    from transformers import AutoModelForCausalLM

    from polyrl.config.loader import load_config
    from polyrl.config.schema import PolyrlConfig
    from polyrl.plugins import activate

    pm = activate(None)
    config = load_config(PolyrlConfig, [], base_overrides + [
        "trainer.name=distill", f"trainer.distill.teacher.model.path={teacher_dirs[which]}",
        "trainer.distill.loss_mode=forward_kl_topk", "trainer.distill.topk=5", "rollout.temperature=0.8"], plugins=pm)
    trainer = DistillTrainer(config, plugins=pm)
    trainer.groups = _local_groups(config, trainer)
    try:
        batch = trainer.generate_batch(trainer.next_rows(), 2, validate=False)
        out = trainer.groups.group_of("teacher").dispatch("compute_teacher_log_prob", batch.select(
            "input_ids", "attention_mask", "position_ids", "responses", "response_mask"))
    finally:
        trainer.groups.shutdown()
    model = AutoModelForCausalLM.from_pretrained(teacher_dirs["teacher"])  # the original numbering
    for row in range(batch.batch_size[0]):
        ids = batch["input_ids"][row][batch["attention_mask"][row].bool()][None]
        n = int(batch["response_mask"][row].sum())
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, -n - 1 : -1] / 0.8, -1)
        assert torch.allclose(out["teacher_log_probs"][row, :n], logp.gather(-1, ids[0, -n:, None]).squeeze(-1),
                              atol=1e-5)
        values, top = logp.topk(5, -1)
        assert torch.equal(out["teacher_top_k_ids"][row, :n], top)
        assert torch.allclose(out["teacher_top_k_log_probs"][row, :n], values, atol=1e-5)


def test_a_teacher_with_another_vocabulary_is_refused_at_start_up(base_overrides, manifest, tmp_path):
    from polyrl.models.tiny import build_bpe_tokenizer, make_tiny_model
    from polyrl.trainer.commands import train

    texts = [f"{a}+{b}={a + b}" for a in range(30) for b in range(30)]
    other = make_tiny_model(tmp_path / "bpe_teacher", size="tiny", tokenizer=build_bpe_tokenizer(texts, 300))
    with pytest.raises(ConfigError, match=r"trainer.distill.teacher.model.path: the teacher's tokenizer does not match "
                                          r"the student's: the teacher's vocabulary has \d+ tokens the student's lacks"):
        train(manifest, [], base_overrides + ["trainer.name=distill", f"trainer.distill.teacher.model.path={other}"])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    with pytest.raises(ConfigError, match="trainer.distill.teacher.model.path is not set"):
        train(manifest, [], base_overrides + ["trainer.name=distill"])


def test_the_teacher_in_a_pool_of_its_own_under_ray(base_overrides, manifest, teacher_dirs, tmp_path):
    """``trainer.placement`` puts the teacher role in its own pool of Ray workers (the same start-up helper as
    every role); a two-step run distils through it."""
    from recipes_testkit import train_rows

    from polyrl.trainer.commands import train

    overrides = [o for o in base_overrides if o != "trainer.executor=local"]
    train(manifest, [], overrides + [
        "trainer.executor=ray", "trainer.ray_num_cpus=2", "trainer.n_workers=1",
        "trainer.placement={actor: train, rollout: train, teacher: teach}", "trainer.pools={teach: 1}",
        "trainer.name=distill", f"trainer.distill.teacher.model.path={teacher_dirs['permuted']}",
        "trainer.distill.loss_mode=forward_kl_topk", "trainer.distill.topk=4"])
    rows = train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["distill/teacher_log_prob"]) and r["distill/teacher_log_prob"] < 0
        assert 0 < r["distill/teacher_mass"] <= 1.0 + 1e-6 and r["actor/grad_norm"] > 0
    assert "placement (mapping): train (1): actor, rollout; teach (1): teacher" in (tmp_path / "run" / "train.log").read_text()
