"""Generation rows: decoded token for token, multi-turn pieces marked, padding rows left out."""

from __future__ import annotations

import torch

from polyrl.agent_loops import collate
from polyrl.batch import set_non_tensor
from polyrl.protocols import AgentLoopOutput
from polyrl.trainer.generations import generation_rows, resolve_dir, reward_extras, sample_ids, table


def test_rows_decode_the_batch_and_mark_tool_turns(tiny_tokenizer, tmp_path):
    tok = tiny_tokenizer
    said, tool, more = (tok("12+", add_special_tokens=False)["input_ids"], tok("=5", add_special_tokens=False)["input_ids"],
                        tok("ok", add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
    outs = [AgentLoopOutput(prompt_ids=[5, 6, 7], response_ids=said + tool + more,
                            response_mask=[1] * len(said) + [0] * len(tool) + [1] * len(more)),
            AgentLoopOutput(prompt_ids=[8], response_ids=more, response_mask=[1] * len(more))]
    batch = collate(outs, pad_token_id=tok.pad_token_id, max_prompt_length=4, max_response_length=16)
    batch["token_level_scores"] = torch.zeros(batch["responses"].shape)
    batch["token_level_scores"][0, 3] = 1.5
    batch["advantages"] = torch.full(batch["responses"].shape, 0.25)
    for key, values in {"uid": ["0-1-ab", "0-2-cd"], "sample_id": sample_ids([{"uid": "0-1-ab"}, {"uid": "0-2-cd"}], 1),
                        "data_source": ["arithmetic", "arithmetic"], "ground_truth": ["5", "7"],
                        "reward_extra": reward_extras({"acc": [1.0, 0.0], "score": [1.5, 0.0]}, 2)}.items():
        set_non_tensor(batch, key, values)
    rows = generation_rows(batch, tok, step=3, kind="train")
    first, second = rows
    assert first["response"] == tok.decode(said + tool + more, skip_special_tokens=False)
    assert first["prompt"] == tok.decode([5, 6, 7], skip_special_tokens=False)
    assert first["response_length"] == len(said + tool + more) and second["response_length"] == len(more)
    assert [t["role"] for t in first["turns"]] == ["assistant", "tool", "assistant"]
    assert first["turns"][1]["text"] == tok.decode(tool, skip_special_tokens=False)
    assert "turns" not in second  # single turn
    assert first["score"] == 1.5 and first["advantage"] == 0.25 and first["reward_extra"] == {"acc": 1.0}
    assert (first["sample_id"], second["sample_id"]) == ("0-1/0", "0-2/0")
    assert generation_rows(batch, tok, step=3, kind="validation", keep=[False, True])[0]["uid"] == "0-2-cd"
    columns, data = table(rows)
    assert columns == ["step", "sample_id", "data_source", "prompt", "response", "ground_truth", "score", "acc"]
    assert data[0][-1] == 1.0


def test_resolve_dir(tmp_path):
    assert resolve_dir("", tmp_path, "g") is None
    assert resolve_dir("auto", tmp_path, "g/v") == tmp_path / "g" / "v"
    assert resolve_dir("dumps", tmp_path, "g") == tmp_path / "dumps"
    assert resolve_dir(str(tmp_path / "abs"), tmp_path / "run", "g") == tmp_path / "abs"
