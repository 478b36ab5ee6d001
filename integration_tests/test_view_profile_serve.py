"""A user's first hour after training: look at the run (``polyrl view``), see where its time went
(``trainer.profile`` + ``polyrl profile``), talk to what it learned (``polyrl serve``).

One short GRPO run of the tiny model (local executor, 4 steps, validation every 2, step 2 profiled,
a checkpoint at the end) is shared by the tests of this module.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polyrl.cli import main

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"


@pytest.fixture(scope="module")
def run(tiny_model, arithmetic_files, tmp_path_factory) -> Path:
    from polyrl.trainer.commands import train

    run_dir = tmp_path_factory.mktemp("first-hour") / "grpo-tiny"
    manifest = run_dir.parent / "polyrl.toml"
    manifest.write_text('[plugins]\nrequire = ["polyrl-engine-fsdp>=0.1,<0.2"]\n')
    # the parity reward, which also notes what report.html says each time it is called (during the run)
    reward = run_dir.parent / "watching_reward.py"
    reward.write_text(
        "import pathlib, re\n"
        f"RUN = pathlib.Path({str(run_dir)!r})\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    page = RUN / 'report.html'\n"
        "    if page.exists():\n"
        "        text = page.read_text()\n"
        "        last = re.search(r'<b>(\\d+)</b><span>last step</span>', text).group(1)\n"
        "        with open(RUN.parent / 'seen.txt', 'a') as f:\n"
        "            f.write(f\"{last} {'refresh' in text}\\n\")\n"
        "    return {'score': float(sum(map(ord, solution_str)) % 2), 'acc': 0.0}\n")
    train(manifest, [], [
        f"reward.function={reward}:compute_score", f"model.path={tiny_model}",
        f"data.train_files=[{arithmetic_files['train']}]", f"data.val_files=[{arithmetic_files['val']}]",
        "data.train_batch_size=4", "data.max_prompt_length=32", "data.max_response_length=6", "data.val_max_samples=8",
        "actor.engine=fsdp", "actor.ppo_mini_batch_size=2", "actor.micro_batch_size=8", "actor.optim.lr=1e-3",
        "rollout.n=4", "trainer.total_steps=4", "trainer.test_freq=2", "trainer.save_freq=4",
        "trainer.progress_bar=false", "trainer.logger=[jsonl]", "trainer.executor=local", "trainer.report_freq=1",
        "trainer.profile.steps=[2]", "trainer.profile.memory=true", f"trainer.run_dir={run_dir}",
    ])
    return run_dir


def test_the_report_is_refreshed_during_the_run(run):
    seen = (run.parent / "seen.txt").read_text().split("\n")
    steps = [int(line.split()[0]) for line in seen if line and line.endswith("True")]
    # written after the first validation (step 0), then after each step (report_freq=1) while the run went on
    assert steps[0] == 0 and sorted(set(steps)) == [0, 1, 2, 3], steps


def test_the_trainer_writes_a_report_that_chromium_shows(run):
    from PIL import Image

    from polyrl.testing.browser import chromium_or_skip, render

    chromium = chromium_or_skip()
    page = run / "report.html"
    assert page.exists(), "the trainer wrote no report"
    text = page.read_text()
    assert 'http-equiv="refresh"' not in text, "the final report still reloads itself"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last_score = next(m["critic/score/mean"] for m in reversed(metrics) if "critic/score/mean" in m)
    ARTIFACTS.mkdir(exist_ok=True)
    shown = render(page, ARTIFACTS / "report_run.png", height=2400, chromium=chromium)
    dom = shown.dom
    for panel in ("reward", "validation", "response length", "KL", "policy loss", "time per phase (s)"):
        assert f"<h3>{panel}</h3>" in dom, panel
    assert re.search(r"critic/score/mean <span class=\"muted\">\(([-\d.e]+)\)", dom).group(1) == \
        _short(last_score)
    assert len(re.findall(r"<polyline ", dom)) >= 8
    assert "val/arithmetic/mean@1" in dom and "last checkpoint" in dom and "step_4" in dom
    assert "report_freq: 1" in dom and "- 2" in dom  # the run's config, as YAML (profile.steps: [2])
    assert str(run.parent / "polyrl.toml") not in dom and "polyrl-engine-fsdp==" in dom  # the lock manifest
    img = Image.open(ARTIFACTS / "report_run.png").convert("RGB")
    assert img.size == (1280, 2400) and len(img.getcolors(1 << 16) or range(1 << 16)) > 50  # not a blank page


def _short(value: float) -> str:
    from polyrl.report import _fmt

    return _fmt(value)


def test_profile_traces_hold_the_profiled_step_only(run):
    folders = sorted(p.name for p in (run / "profile").iterdir())
    assert folders == ["step_2"]
    traces = sorted((run / "profile" / "step_2").glob("*.pt.trace.json"))
    assert [t.name for t in traces] == ["actor-rollout_rank0.pt.trace.json"]
    events = json.loads(traces[0].read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("polyrl step")}
    assert steps == {"polyrl step 2"}
    calls = {e["name"] for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("polyrl/")}
    assert {"polyrl/rollout/generate", "polyrl/actor/update_actor"} <= calls
    assert any(e.get("cat") == "cpu_op" and e["name"] == "aten::mm" for e in events)
    assert any(e.get("name") == "[memory]" for e in events), "trainer.profile.memory=true recorded no allocations"
    step = next(e for e in events if e.get("name") == "polyrl step 2")
    inside = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    assert all(step["ts"] <= e["ts"] <= step["ts"] + step["dur"] for e in inside), "ops outside the profiled step"


def test_polyrl_profile_prints_phases_and_top_ops(run, capsys):
    assert main(["profile", str(run), "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert "driver phases, mean of 4 steps" in out and "step 2:" in out
    for phase in ("gen", "update_actor", "reward"):
        assert re.search(rf"^\s+{phase}\s+\d+\.\d+\s+\d+\.\d%$", out, re.M), phase
    assert "process actor-rollout_rank0" in out and "actor/update_actor" in out
    assert "top 5 CPU operators by self time" in out and "peak allocated on" in out
    assert main(["profile", str(run), "--step", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [f"polyrl profile: error: step 3 of {run} was not profiled (profiled steps: 2); record "
                                "it with trainer.profile.steps=[3]"]


def test_profile_steps_past_the_end_is_one_line(base_overrides, manifest_file, tmp_path, capsys):
    code = main(["train", "--manifest", str(manifest_file), *base_overrides, "trainer.executor=local",
                 "trainer.profile.steps=[1,9]"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "trainer.profile.steps=[1, 9]: step 9 is outside this run's steps 1..2" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_a_checkpoint_answers_the_openai_client(run):
    openai = pytest.importorskip("openai")
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, "-m", "polyrl", "serve", str(run), "--backend", "hf", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        deadline = time.time() + 180
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                assert time.time() < deadline, "polyrl serve did not come up"
                time.sleep(0.3)
        name = models.data[0].id
        assert name == "grpo-tiny-step_4"  # the run's newest checkpoint, exported on the fly
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "What is 2+2?"}],
                                              max_tokens=6, temperature=0)
        assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens >= 1
        pieces = list(client.completions.create(model=name, prompt="2+2=", max_tokens=6, temperature=0, stream=True))
        whole = client.completions.create(model=name, prompt="2+2=", max_tokens=6, temperature=0).choices[0].text
        assert "".join(p.choices[0].text for p in pieces) == whole
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert "exporting" in err and err.strip().endswith("polyrl serve: stopped")
    exported = re.search(r"to (\S+/model) \(polyrl export\)", err).group(1)
    assert not Path(exported).exists(), "the temporary export was left behind"


def test_profile_with_ray_workers_writes_one_trace_per_rank(base_overrides, manifest_file, tmp_path, capsys):
    """Ray executor, two colocated ranks: each worker process records the step through the worker group."""
    from polyrl.trainer.commands import train

    train(manifest_file, [], base_overrides + ["trainer.n_workers=2", "trainer.ray_num_cpus=2", "trainer.save_freq=0",
                                               "trainer.val_before_train=false", "trainer.profile.steps=[2]"])
    run = tmp_path / "run"
    traces = sorted((run / "profile" / "step_2").glob("*.pt.trace.json"))
    assert [t.name for t in traces] == ["actor-rollout_rank0.pt.trace.json", "actor-rollout_rank1.pt.trace.json"]
    pids = set()
    for trace in traces:
        events = json.loads(trace.read_text())["traceEvents"]
        assert {e["name"] for e in events if str(e.get("name", "")).startswith("polyrl step")} == {"polyrl step 2"}
        assert any(e.get("name") == "polyrl/actor/update_actor" for e in events)
        pids |= {e["pid"] for e in events if e.get("cat") == "cpu_op"}
    assert len(pids) == 2, "the two ranks' traces come from one process"
    assert sorted(p.name for p in (run / "profile").iterdir()) == ["step_2"]
    assert main(["profile", str(run), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "process actor-rollout_rank0" in out and "process actor-rollout_rank1" in out
