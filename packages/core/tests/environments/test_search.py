"""The ``search`` environment: a real BM25 index (rank_bm25) over a corpus made here, Search-R1's observation and
reward, and an episode through the stepwise loop (a scripted model: it searches, then answers)."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("rank_bm25")

from polyrl.agent_loops.stepwise import StepwiseAgentLoop  # noqa: E402
from polyrl.config.schema import AgentConfig  # noqa: E402
from polyrl.environments.search import corpus_index, make_search, passages_text, read_corpus  # noqa: E402
from polyrl.protocols import GenerationResult, SamplingParams  # noqa: E402
from polyrl.testing import EnvironmentConformance  # noqa: E402

DOCS = [
    {"id": "0", "contents": '"Paris"\nParis is the capital and largest city of France, on the Seine.'},
    {"id": "1", "contents": '"Berlin"\nBerlin is the capital of Germany and its largest city.'},
    {"id": "2", "contents": '"Mount Everest"\nMount Everest is the highest mountain above sea level, in the Himalayas.'},
    {"id": "3", "contents": '"Seine"\nThe Seine is a river in northern France that flows through Paris.'},
    {"id": "4", "contents": '"Danube"\nThe Danube is the second-longest river in Europe, flowing through Vienna.'},
]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    return path


def row(question="What is the highest mountain above sea level?", targets=("Mount Everest", "Everest")):
    return {"uid": "q0", "prompt": [{"role": "user", "content": question}], "data_source": "env/search",
            "agent_name": "stepwise", "reward_model": {"ground_truth": {"target": list(targets)}},
            "extra_info": {"question": question}}


class TestSearchConformance(EnvironmentConformance):
    actions = ["<search>capital of France</search>", "<search>river</search>", "<answer>Paris</answer>"]
    invalid_action = "I think it is Paris"

    @pytest.fixture
    def environment_factory(self, corpus):
        return lambda config: make_search({"corpus": str(corpus), **config})


def test_the_index_answers_from_the_corpus(corpus):
    index = corpus_index(corpus)
    assert corpus_index(corpus) is index  # built once per file version
    assert [p.title for p in index.search("highest mountain", 1)] == ["Mount Everest"]
    assert [p.title for p in index.search("capital of Germany", 2)][0] == "Berlin"
    assert {p.title for p in index.search("river France Paris", 2)} == {"Seine", "Paris"}
    text = passages_text(index.search("Danube Vienna", 1), 20)
    assert text == "<information>Doc 1(Title: Danube) The Danube is the se</information>"  # 20 characters


def test_search_then_answer_scores_like_search_r1(corpus):
    env = make_search({"corpus": str(corpus), "topk": 2})
    assert env.reset(0, row()) == "Question: What is the highest mountain above sea level?"
    observation, reward, done, _ = env.step("Let me look. <search>highest mountain</search>")
    assert observation.startswith("<information>Doc 1(Title: Mount Everest)") and (reward, done) == (0.0, False)
    assert observation.count("Doc ") == 2
    _, reward, done, info = env.step("<answer>mount everest</answer>")  # normalised: case and articles
    assert (reward, done, info["success"]) == (1.0, True, True)
    env.reset(0, row())
    _, reward, done, info = env.step("<answer>K2</answer>")
    assert (reward, done, info["success"]) == (0.0, True, False)


def test_bad_corpora_and_kwargs_are_named(tmp_path, corpus):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "0", "contents": "x"}\n{"id": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl line 2"):
        read_corpus(bad)
    with pytest.raises(ValueError, match="corpus"):
        make_search({"topk": 2})
    with pytest.raises(ValueError, match="not a file"):
        make_search({"corpus": str(tmp_path / "missing.jsonl")})


def test_an_episode_through_the_stepwise_loop(corpus):
    from polyrl.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    texts = ["<search>highest mountain</search>", "<answer>Mount Everest</answer>"]

    class Scripted:
        def __init__(self):
            self.prompts = []

        async def agenerate(self, request):
            self.prompts.append(tok.decode(request.prompt_ids))
            ids = tok.encode(texts[len(self.prompts) - 1], add_special_tokens=False) + [tok.eos_token_id]
            return [GenerationResult(list(request.prompt_ids), ids, [-1.0] * len(ids))]

    client = Scripted()
    sample = row()
    sample["extra_info"].update(env="search", env_kwargs={"corpus": str(corpus), "topk": 1}, action_pattern="")
    agent_loop = StepwiseAgentLoop(tokenizer=tok, config=AgentConfig(max_turns=4), max_prompt_length=4096)
    outs = asyncio.run(agent_loop.run(sample, SamplingParams(max_new_tokens=64), client))
    assert len(outs) == 2 and [o.extra["step_rewards"] for o in outs] == [0.0, 1.0]
    assert outs[-1].extra["episode_success"] == 1.0 and outs[0].metrics["tool_reward"] == 1.0
    # the second step's prompt shows the retrieved passage as the current observation
    assert "<information>Doc 1(Title: Mount Everest)" in client.prompts[1]
