"""The megatron engine on the real pretrained SmolLM2-135M-Instruct (polyrl.testing's ``real_model_dir``: Llama, tied
embeddings, GQA with 9 query and 3 KV heads, hidden 576, 30 layers, RoPE theta 100000), in two pipeline stages of
15 layers (the tied embedding then lives on both the first and the last stage): HF -> Megatron conversion of the
real weights, log-probs equal to transformers', the round trip back to HF bit for bit, and one GRPO step whose
weights, loaded into transformers, compute what the engine computes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polyrl.distributed import free_port
from polyrl.testing import real_model_dir  # noqa: F401  (the session fixture; this package has no conftest)

pytest.importorskip("megatron.core")

HERE = Path(__file__).parent
LAYOUT = "pp2"


@pytest.fixture(scope="module")
def ranks(real_model_dir, tmp_path_factory) -> list[dict]:  # noqa: F811
    out = tmp_path_factory.mktemp("real_mcore")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p))
    for _attempt in range(3):  # the free port can be taken before rank 0 binds it
        port = str(free_port())
        procs = [subprocess.Popen([sys.executable, str(HERE / "real_mcore_worker.py"), str(r), "2", port,
                                   str(real_model_dir), str(out), LAYOUT], env=env, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        errs = []
        for p in procs:
            try:
                errs.append(p.communicate(timeout=280)[1])
            except subprocess.TimeoutExpired:
                p.kill()
                errs.append(p.communicate()[1] + "\n(timed out)")
        if all(p.returncode == 0 for p in procs):
            return [torch.load(out / f"real_{LAYOUT}_rank{r}.pt", weights_only=False) for r in range(2)]
        if not any("address already in use" in e.lower() for e in errs):
            break
    raise AssertionError("\n".join(f"rank {r} exited {p.returncode}:\n{e[-4000:]}"
                                   for r, (p, e) in enumerate(zip(procs, errs)) if p.returncode))


#: float32 over 30 layers, megatron-core's local layers against transformers' eager Llama
TOL = 1e-4


@pytest.mark.timeout(300)  # 36 s of CPU time for both ranks (55 s wall on the shared, loaded 2 cores)
def test_real_llama_converts_and_takes_a_grpo_step(ranks):
    last = [r for r in ranks if r["collects"]]
    assert len(last) == 1  # the last pipeline stage returns the log-probs
    last, hf = last[0], ranks[0]
    mask = hf["response_mask"].bool()
    assert mask.sum() > 20
    # 1. the converted real weights compute transformers' log-probs; the way back gives the folder's tensors
    err = (last["before"]["log_probs"][mask] - hf["hf_before"][mask]).abs().max()
    assert err < TOL, float(err)
    assert hf["round_trip_names"] and hf["round_trip_exact"]
    assert "lm_head.weight" not in hf["trained_names"]  # tied: the embedding is the head, sent once
    # 2. one GRPO step: finite, and it moved the model (the tied embedding too: its gradient from both stages)
    metrics = last["metrics"]
    assert torch.isfinite(torch.tensor(metrics["actor/grad_norm"])) and metrics["actor/grad_norm"] > 0
    assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))
    moved = (last["after"]["log_probs"] - last["before"]["log_probs"])[mask]
    assert moved.abs().max() > 1e-4
    assert hf["embedding_moved"] > 0
    # rows with reward 1 (advantage > 0) became more likely on average, the others less
    delta = last["after"]["log_probs"] - last["before"]["log_probs"]
    up = torch.cat([delta[r][mask[r]] for r in (0, 2)]).mean()
    down = torch.cat([delta[r][mask[r]] for r in (1, 3)]).mean()
    assert up > 0 > down, (float(up), float(down))
    # 3. the trained weights, as a rollout or an export gets them, are the model the engine trained
    assert set(hf["load_missing"]) <= {"lm_head.weight"} and not hf["load_unexpected"] and hf["tied_after"]
    err_after = (last["after"]["log_probs"][mask] - hf["hf_after"][mask]).abs().max()
    assert err_after < TOL, float(err_after)
    print(f"megatron pp2 vs transformers: {float(err):.1e} before, {float(err_after):.1e} after the step; "
          f"grad norm {metrics['actor/grad_norm']:.3f}")
