"""Rendering a benchmark run: the markdown tables, the JSON file and the PNG plot.

[Note: two tables]
The headline table has one row per configuration: hyper_parallel's step against the
reference (FSDP2 on torch, the DP baseline on MindSpore) and DDP, in time and memory, the
decoder's tokens/s, and, where the interleaved floor ran, the library's cost beyond it
next to the floor itself. The detail table has one row per phase of each configuration.
Every figure is a median over alternated rounds with its interquartile range in brackets;
ratios > 1 mean hyper_parallel is slower / bigger.

[Note: the plot is optional]
matplotlib is imported only here and only when the PNG is written; without it the run
prints a note and still succeeds (it is the ``bench`` extra, not a dependency).
"""

from __future__ import annotations

import json
from pathlib import Path

import configs


def _ms(value) -> str:
    return "—" if value is None else f"{value * 1000:.0f}"


def _with_iqr(fig: dict | None, scale: float = 1000.0, digits: int = 0, suffix: str = "") -> str:
    """``median [q1–q3]`` of a ``spread`` dict."""
    if not fig:
        return "—"
    f = f"{{:.{digits}f}}"
    return (f"{f.format(fig['median'] * scale)}{suffix} "
            f"[{f.format(fig['q1'] * scale)}–{f.format(fig['q3'] * scale)}]")


def _ratio(fig: dict | None) -> str:
    return _with_iqr(fig, scale=1.0, digits=2)


def _num(value, digits: int = 0) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _tokens(figs: dict, impl: str) -> str:
    return _num(figs["phases"].get(impl, {}).get("tokens_per_s"))


def headline_table(doc: dict) -> str:
    head = ("| configuration | hp step ms | reference | ref step ms | **hp / ref time** | "
            "hp / DDP time | hp / ref peak memory | tokens/s hp / ref | "
            "interleaved floor ms | **hp library cost beyond the floor** |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in doc["configurations"]:
        cfg = row["config"]
        ref = configs.REFERENCE[cfg["backend"]]
        if "error" in row:
            lines.append(f"| {cfg['name']} | FAILED |" + " |" * (head.count("|") - 3))
            continue
        figs = row["figures"]
        phases, ratios = figs["phases"], figs["ratios"]
        cost = figs.get("library_cost_pct")
        tokens = (f"{_tokens(figs, 'hp')} / {_tokens(figs, ref)}" if cfg.get("tokens_per_step")
                  else "—")
        lines.append("| " + " | ".join([
            cfg["name"], _with_iqr(phases["hp"]["step"]), configs.IMPL_LABELS[ref],
            _with_iqr(phases[ref]["step"]), _ratio(ratios.get(f"hp_vs_{ref}")),
            _ratio(ratios.get("hp_vs_ddp")), _num(figs.get("peak_hp_vs_ref"), 2), tokens,
            _with_iqr(phases.get("floor", {}).get("step")),
            _with_iqr(cost, scale=1.0, digits=1, suffix="%") if cost else "—",
        ]) + " |")
    return "\n".join(lines)


def _bytes_ratios(figs: dict, impl: str) -> str:
    """``AG / RS / AR`` bytes against the minimum (several mesh dims joined by ``+``)."""
    per_op = figs.get("bytes_vs_min", {}).get(impl)
    if not per_op:
        return "—"
    parts = []
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        dims = per_op.get(op, {})
        parts.append("+".join(_num(v, 2) for _, v in sorted(dims.items())) if dims else "—")
    return " / ".join(parts)


def _display_order(phases: dict) -> list:
    """hyper_parallel, then the others in IMPL_LABELS order (whatever order they ran in)."""
    return [name for name in configs.IMPL_LABELS if name in phases]


def detail_table(doc: dict) -> str:
    head = ("| configuration | phase | step ms | step CPU ms | peak MB | tokens/s | "
            "bytes / minimum (AG / RS / AR) | loss Δ vs ref | setup s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in doc["configurations"]:
        if "error" in row:
            continue
        cfg, figs = row["config"], row["figures"]
        for impl in _display_order(figs["phases"]):
            fig = figs["phases"][impl]
            loss = figs["loss_rel_diff_vs_ref"].get(impl)
            lines.append("| " + " | ".join([
                cfg["name"], configs.IMPL_LABELS[impl], _with_iqr(fig["step"]), _ms(fig["cpu_s"]),
                _num(fig["peak_mb"]), _num(fig.get("tokens_per_s")), _bytes_ratios(figs, impl),
                "—" if loss is None else f"{loss:.1e}", _num(figs["setup_s"][impl], 1),
            ]) + " |")
    return "\n".join(lines)


def notes(doc: dict) -> str:
    """The lines printed under the tables: machine, method, failures."""
    env = doc["environment"]
    lines = [f"- {doc['date'][:10]}, {env['cpu_count']} cores (os.cpu_count()), "
             f"{env['platform']}; torch {env['versions'].get('torch')}, mindspore "
             f"{env['versions'].get('mindspore')}; {doc['grid']} grid, wall time "
             f"{doc['wall_s']:.0f} s; ranks "
             f"{'bound to cores' if env.get('bind_cores') else 'not bound to cores'}; MindSpore "
             f"pipeline {env.get('mindspore_pipeline')}",
             "- one launch per configuration, every implementation in the same processes, "
             "steps alternated round by round (A B C, C B A, ...); each figure the median over "
             "rounds of the max over ranks, [the interquartile range over rounds]; ratios are "
             "per-round ratios, then their median [IQR]",
             "- library cost = hp step / interleaved floor − 1, the floor being the plain model "
             "with the minimal collectives issued from hooks where the step needs them (no "
             "library code)"]
    for row in doc["configurations"]:
        figs = row.get("figures", {})
        if "interleave_cost_pct" in figs:
            lines.append(f"- {row['config']['name']}: the floor itself costs "
                         f"{_with_iqr(figs['interleave_cost_pct'], 1.0, 1, '%')} beyond compute-only "
                         f"+ raw collectives back to back (a platform cost)")
    failed = [row["config"]["name"] for row in doc["configurations"] if "error" in row]
    if failed:
        lines.append(f"- FAILED launches (details in the JSON): {', '.join(failed)}")
    return "\n".join(lines)


def markdown(doc: dict) -> str:
    return "\n\n".join([headline_table(doc), detail_table(doc), notes(doc)])


def write_json(doc: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(doc, indent=1, sort_keys=True))
    partial.replace(path)


def publish(doc: dict, table: str, path: Path) -> None:
    """A standalone benchmark's ending: its table on the console, its JSON at ``path``."""
    print(f"\n{table}")
    write_json(doc, path)
    print(f"\nwritten: {path}")


def write_png(doc: dict, path: Path) -> str:
    """Bars of median step time (with the IQR as error bars) and peak memory per
    configuration and phase; returns a note for the console (written, or why not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"PNG skipped: matplotlib is not installed (pip install matplotlib) — {path.name} not written"
    rows = [row for row in doc["configurations"] if "figures" in row]
    colors = {impl: f"C{i}" for i, impl in enumerate(configs.IMPL_LABELS)}
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 1.4 * len(rows) + 3), 8.5), sharex=True)
    labelled = set()
    for i, row in enumerate(rows):
        phases = row["figures"]["phases"]
        width = 0.8 / max(1, len(phases))
        for k, impl in enumerate(_display_order(phases)):
            phase = phases[impl]
            x = i + (k - (len(phases) - 1) / 2) * width
            name = configs.IMPL_LABELS[impl]
            label = None if name in labelled else name
            labelled.add(name)
            step = phase["step"]
            axes[0].bar(x, step["median"] * 1000, width, color=colors[impl], label=label,
                        yerr=[[(step["median"] - step["q1"]) * 1000],
                              [(step["q3"] - step["median"]) * 1000]], capsize=2)
            if phase["peak_mb"] is not None and impl != "raw":
                axes[1].bar(x, phase["peak_mb"], width, color=colors[impl])
    axes[0].set_yscale("log")
    axes[0].set_ylabel("median step time, ms (log; bars: IQR)")
    axes[1].set_ylabel("peak memory per rank, MB")
    for axis in axes:
        axis.grid(axis="y", alpha=0.3)
    axes[0].legend(ncol=4, fontsize="small")
    axes[0].set_title(f"hyper_parallel benchmark ({doc['environment']['cpu_count']} cores, "
                      f"{doc['date'][:10]})")
    axes[1].set_xticks(range(len(rows)))
    axes[1].set_xticklabels([row["config"]["name"] for row in rows], rotation=30, ha="right",
                            fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"
