"""What examples/train_lm.py shows while it trains and leaves behind: the progress line, the
loss curve as a PNG, and the per-step record both come from."""

from __future__ import annotations

import resource


def peak_resident_mb() -> float:
    """This process's peak resident set in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def progress_line(record: dict, steps: int) -> str:
    return (f"step {record['step']:>5}/{steps} | loss {record['loss']:.4f} | "
            f"grad norm {record['grad_norm']:6.3f} | {record['tokens_per_s']:>9,.0f} tok/s | "
            f"mem {record['memory_mb']:,.0f} MB | {record['backend']} | {record['elapsed_s']:.0f} s")


def plot_losses(history: list, validation: list, path: str, title: str) -> bool:
    """Training loss per step, one colour per framework that ran the steps (a run resumed on
    the other framework shows where it crossed), validation losses as points. False when
    matplotlib is not installed (``pip install matplotlib``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(figsize=(7, 4))
    for backend, colour in (("torch", "tab:red"), ("mindspore", "tab:blue")):
        points = [(r["step"], r["loss"]) for r in history if r["backend"] == backend]
        if points:
            axes.plot(*zip(*points), color=colour, linewidth=1, label=f"train ({backend})")
    if validation:
        axes.plot([v["step"] for v in validation], [v["loss"] for v in validation], "ko",
                  markersize=4, label="validation")
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy (nats per byte)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
