"""ReMax end to end: each step's baselines are the rewards of the greedy responses of the step's prompts,
generated on the weights being trained (checked against transformers' own greedy decoding), and they reach the
core's ``remax`` estimator; ``adv_estimator=remax`` without the recipe is refused at start-up."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from polyrl_recipes.remax import greedy_baselines

from polyrl.errors import ConfigError
from polyrl.trainer.commands import train

sys.path.insert(0, str(Path(__file__).parent))
from recipes_testkit import train_rows  # noqa: E402

#: also run on polyrl-recipes installed alone from its wheel (make test-packages)
pytestmark = pytest.mark.smoke

RECORDING_REWARD = '''
import json
LOG = {log!r}
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    text = solution_str[:6]
    frac = sum(c.isdigit() for c in text) / max(1, len(text)) if text else 0.0
    with open(LOG, "a") as f:
        f.write(json.dumps({{"index": extra_info["index"], "text": solution_str, "score": frac}}) + "\\n")
    return {{"score": frac, "acc": frac}}
'''


def test_baselines_are_the_rewards_of_greedy_responses(base_overrides, manifest, tiny_model, arithmetic_files,
                                                        tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log = tmp_path / "calls.jsonl"
    reward = tmp_path / "recording_reward.py"
    reward.write_text(RECORDING_REWARD.format(log=str(log)))
    train(manifest, [], base_overrides + ["trainer.name=remax", "trainer.total_steps=1",
                                          f"reward.function={reward}:compute_score"])
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 4 * 4 + 4  # the step's 16 samples, then one greedy response per prompt
    samples, greedy = calls[:16], calls[16:]
    assert sorted(c["index"] for c in greedy) == sorted({c["index"] for c in samples})
    rows = {r["extra_info"]["index"]: r for r in map(json.loads, arithmetic_files["train"].read_text().splitlines())}
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    for call in greedy:  # the weights of step 1 are the starting model's
        ids = tok.apply_chat_template(rows[call["index"]]["prompt"], add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=6, pad_token_id=tok.pad_token_id)
        assert tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True) == call["text"]
    (step,) = train_rows(tmp_path / "run")
    assert step["remax/baseline_score_mean"] == pytest.approx(sum(c["score"] for c in greedy) / 4, abs=1e-6)
    # advantages are each sample's score minus its prompt's greedy score (outcome reward on the last token)
    by_prompt = {c["index"]: c["score"] for c in greedy}
    gaps = [c["score"] - by_prompt[c["index"]] for c in samples]
    assert step["critic/advantages/max"] == pytest.approx(max(gaps), abs=1e-6)
    assert step["critic/advantages/min"] == pytest.approx(min(gaps), abs=1e-6)


def test_greedy_baselines_follow_the_samples_uids():
    got = greedy_baselines(["b", "a", "b", "c"], {"a": 0.5, "b": 1.0, "c": 0.0})
    assert got.tolist() == [1.0, 0.5, 1.0, 0.0]
    with pytest.raises(RuntimeError, match="no greedy baseline"):
        greedy_baselines(["x"], {})


def test_remax_estimator_without_its_baselines_is_refused_at_start_up(base_overrides, manifest, tmp_path):
    """The bug this recipe fixes: ``adv_estimator=remax`` used to pass start-up and fail at step 1."""
    with pytest.raises(ConfigError, match=r"algorithm.adv_estimator=remax needs the batch field 'reward_baselines'.*"
                                          r"trainer.name=ppo does not produce: use trainer.name=remax"):
        train(manifest, [], base_overrides + ["algorithm.adv_estimator=remax"])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_remax_refuses_asynchronous_modes(base_overrides, manifest):
    with pytest.raises(ConfigError, match="trainer.async_mode=one_step_off_policy: trainer.name=remax"):
        train(manifest, [], base_overrides + ["trainer.name=remax", "trainer.async_mode=one_step_off_policy"])
