"""A report that cannot be written never stops a run (issue 47): one warning, every step trained.

The reward function makes the report's temporary file a folder on its first call (during the validation before
training), so that every write of ``report.html`` after it fails, as a full disk or a read-only run folder would.
"""

from __future__ import annotations

import json

import pytest


@pytest.mark.timeout(300)
def test_a_report_that_cannot_be_written_is_one_warning_and_the_run_goes_on(base_overrides, manifest_file, tmp_path,
                                                                             tiny_model, arithmetic_files):
    from polyrl.trainer.commands import train

    run_dir = tmp_path / "run"
    reward = tmp_path / "blocking_reward.py"
    reward.write_text(
        "import pathlib\n"
        f"RUN = pathlib.Path({str(run_dir)!r})\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if (RUN.parent / 'block').exists():  # report.html's temporary file a folder: writing it fails\n"
        "        (RUN / '.report.html.tmp').mkdir(exist_ok=True)\n"
        "    return {'score': float(sum(map(ord, solution_str)) % 2), 'acc': 0.0}\n")
    (tmp_path / "block").touch()
    overrides = [o for o in base_overrides if not o.startswith(("reward.function=", "trainer.total_steps="))]
    overrides += [f"reward.function={reward}:compute_score", "trainer.report_freq=1", "trainer.test_freq=1",
                  "data.val_max_samples=4", "trainer.executor=local", "trainer.save_freq=1"]
    train(manifest_file, [], [*overrides, "trainer.total_steps=3"])
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 3, steps
    log = (run_dir / "train.log").read_text()
    warned = [line for line in log.splitlines() if "could not write" in line]
    # 5 writes were due (before training, after each of 3 steps' validation, at the end): one warning for all
    assert len(warned) == 1 and "report.html" in warned[0] and "goes on without it" in warned[0], warned
    assert not (run_dir / "report.html").exists()

    # the finished run, given more steps: it resumes, and its report is written (the constant learning rate may be
    # logged one ulp apart after a resume, which used to hang the report; test_report.py covers that case)
    (tmp_path / "block").unlink()
    (run_dir / ".report.html.tmp").rmdir()
    train(manifest_file, [], [*overrides, "trainer.total_steps=4"])
    lrs = {json.loads(line).get("actor/lr") for line in (run_dir / "metrics.jsonl").read_text().splitlines()}
    page = (run_dir / "report.html").read_text()
    assert "<b>4</b><span>last step</span>" in page and "actor/lr" in page, sorted(lrs - {None})
