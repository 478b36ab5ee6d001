"""``polyrl plot RUN_DIR``: PNG curves of a run's reward, accuracy, response length and KL.

Drawing needs matplotlib, which is an extra: ``pip install 'polyrl[plot]'``. The metrics are read as the HTML
report reads them (:class:`polyrl.report.MetricsReader`): in bounded memory, at most a few thousand points a
curve, non-finite values left out.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from polyrl.errors import DataError, PolyrlError

#: What to run when matplotlib is missing.
PLOT_INSTALL = "pip install 'polyrl[plot]'"

#: Panels: title and the metric keys drawn in it (a key ending in '*' matches a prefix/suffix pattern).
PANELS = [
    ("reward", ["critic/score/mean"]),
    ("accuracy", ["acc/mean", "val/*mean@1"]),
    ("response length", ["response_length/mean"]),
    ("KL", ["actor/ppo_kl", "actor/kl_ref", "actor/kl_loss"]),
    ("policy loss", ["actor/pg_loss", "sft/loss"]),
    ("throughput (tokens/s)", ["throughput/tokens_per_s"]),
]


#: Values beyond this magnitude are drawn at it: matplotlib's tick locator fails on a span that overflows a float.
PLOT_LIMIT = 1e300


def _match(pattern: str, keys: list[str]) -> list[str]:
    if "*" not in pattern:
        return [pattern] if pattern in keys else []
    head, _, tail = pattern.partition("*")
    return sorted(k for k in keys if k.startswith(head) and k.endswith(tail))


def _pyplot() -> ModuleType:
    """matplotlib's pyplot on the file-only Agg backend, or a PolyrlError with the install line."""
    try:
        import matplotlib
    except ImportError:
        raise PolyrlError(f"drawing curves needs matplotlib, which is not installed: {PLOT_INSTALL}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the run's curves into one PNG (default ``RUN_DIR/curves.png``) and return its path.

    Raises :class:`~polyrl.errors.PolyrlError` naming ``polyrl[plot]`` when matplotlib is not installed
    and :class:`~polyrl.errors.DataError` when the run logged none of the plotted metrics.
    """
    from polyrl.report import MetricsReader

    plt = _pyplot()
    series = MetricsReader(run_dir).read()
    keys = sorted(series)
    panels = [(t, [k for p in pats for k in _match(p, keys)]) for t, pats in PANELS]
    panels = [(t, ks) for t, ks in panels if ks]
    if not panels:
        raise DataError(f"{run_dir}/metrics.jsonl holds none of the plotted metrics")
    cols = 2
    nrows = (len(panels) + 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(11, 3.2 * nrows), squeeze=False)
    for ax, (title, ks) in zip(axes.flat, panels):
        for k in ks:
            pts = [(x, min(max(y, -PLOT_LIMIT), PLOT_LIMIT)) for x, y in series[k].curve()]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if len(pts) < 30 else None, ms=3, label=k)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(str(Path(run_dir).name))
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
