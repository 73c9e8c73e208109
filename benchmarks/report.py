"""Rendering a benchmark run: the markdown tables, the JSON file and the PNG plot.

[Note: two tables]
The summary table has one row per configuration: hyper_parallel against the reference
(FSDP2 on torch, the DP baseline on MindSpore) in time and memory, DDP and the compute-only
step beside them, hyper_parallel's bytes per collective against the minimum, its raw
collectives, overhead (and how much of it is the library's own, against the interleaved
floor) and exposed communication. The detail table has one row per
implementation of each configuration, so FSDP2's and DDP's overhead and bytes can be read
the same way. Ratios > 1 mean hyper_parallel is slower / bigger / sends more.

[Note: the plot is optional]
matplotlib is imported only here and only when the PNG is written; without it the run
prints a note and still succeeds (it is the ``bench`` extra, not a dependency).
"""

from __future__ import annotations

import json
from pathlib import Path

import configs


def _ms(seconds) -> str:
    return "—" if seconds is None else f"{seconds * 1000:.0f}"


def _ratio(value) -> str:
    return "—" if value is None else f"{value:.2f}"


def _mb(value) -> str:
    return "—" if value is None else f"{value:.0f}"


def _bytes_ratios(fig: dict) -> dict:
    """``{"AG": "1.00", "RS": ..., "AR": ...}`` for the table (several dims joined by /)."""
    out = {}
    for op, short in (("all_gather", "AG"), ("reduce_scatter", "RS"), ("all_reduce", "AR")):
        per_dim = fig.get("bytes_vs_min", {}).get(op, {})
        out[short] = "/".join(_ratio(v) for _, v in sorted(per_dim.items())) if per_dim else "—"
    return out


def _overhead(fig: dict, kind: str = "") -> str:
    if fig.get(f"{kind}overhead_s") is None:
        return "—"
    return f"{fig[f'{kind}overhead_s'] * 1000:.0f} ({fig[f'{kind}overhead_pct']:+.0f}%)"


def _alternated_times(fig: dict) -> str:
    if fig.get("alternated_step_s") is None:
        return "—"
    return " / ".join(_ms(fig[k]) for k in ("alternated_step_s", "alternated_compute_s",
                                            "alternated_raw_s", "interleaved_s"))


def _interleave_cost(fig: dict) -> str:
    if fig.get("interleave_cost_s") is None:
        return "—"
    return f"{fig['interleave_cost_s'] * 1000:.0f} ({fig['interleave_cost_pct']:+.0f}%)"


def _overhead_with_rounds(fig: dict, kind: str = "") -> str:
    """The pooled overhead and, after several launches, each launch's own (its noise)."""
    per_round = fig.get(f"{kind}overhead_pct_per_round")
    if not per_round or len(per_round) < 2:
        return _overhead(fig, kind)
    return f"{_overhead(fig, kind)}; rounds {' / '.join(f'{v:+.0f}%' for v in per_round)}"


def _spread(fig: dict) -> str:
    return "—" if fig.get("round_spread_pct") is None else f"{fig['round_spread_pct']:.0f}%"


def _cpu_split(fig: dict) -> str:
    if fig.get("cpu_overhead_main_s") is None:
        return "—"
    return f"{_ms(fig['cpu_overhead_main_s'])} / {_ms(fig['cpu_overhead_threads_s'])}"


def _share(fig: dict) -> str:
    return "—" if fig.get("raw_cpu_per_wall") is None else f"{fig['raw_cpu_per_wall']:.2f}"


def summary_table(doc: dict) -> str:
    head = ("| configuration | ranks | hp step ms | ref | ref step ms | **hp/ref time** | DDP ms | "
            "compute ms | hp peak MB | ref peak MB | **hp/ref mem** | hp AG/min | hp RS/min | "
            "hp AR/min | raw coll ms | hp overhead ms (% step) | "
            "hp overhead, same-launch compute ms (% step) | hp overhead, alternated ms (% step) | "
            "hp interleave cost ms (% step) | **hp library overhead ms (% step)** | "
            "hp CPU overhead ms (% step CPU) | "
            "hp exposed ms | hp round spread |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in doc["configurations"]:
        cfg, figs = row["config"], row["figures"]
        ref_name = configs.REFERENCE[cfg["backend"]]
        hp, ref = figs.get("hp", {}), figs.get(ref_name, {})
        ratios = _bytes_ratios(hp)
        lines.append("| " + " | ".join([
            cfg["name"], str(cfg["world_size"]),
            _err_or(hp, _ms(hp.get("step_s"))), configs.IMPL_LABELS[ref_name],
            _err_or(ref, _ms(ref.get("step_s"))), _ratio(hp.get("step_vs_ref")),
            _ms(figs.get("ddp", {}).get("step_s")), _ms(figs.get("compute", {}).get("step_s")),
            _mb(hp.get("peak_mb")), _mb(ref.get("peak_mb")), _ratio(hp.get("peak_vs_ref")),
            ratios["AG"], ratios["RS"], ratios["AR"], _ms(hp.get("raw_collectives_s")),
            _overhead_with_rounds(hp), _overhead_with_rounds(hp, "paired_"),
            _overhead_with_rounds(hp, "alternated_"), _interleave_cost(hp),
            _overhead_with_rounds(hp, "library_"), _overhead(hp, "cpu_"),
            _ms(hp.get("exposed_comm_s")), _spread(hp),
        ]) + " |")
    return "\n".join(lines)


def detail_table(doc: dict) -> str:
    head = ("| configuration | implementation | step ms | vs ref | peak MB | vs ref | compute ms | "
            "raw coll ms | overhead ms (% step) | same-launch compute ms | "
            "overhead, same-launch compute ms (% step) | alternated: step / compute / raw / "
            "interleaved floor ms | overhead, alternated ms (% step) | interleave cost ms (% step) | "
            "library overhead ms (% step) | step CPU ms | "
            "CPU overhead ms (% step CPU) | "
            "CPU overhead: stepping thread / other threads ms | raw CPU/wall | exposed ms | "
            "AG/min | RS/min | AR/min | loss Δ vs ref |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in doc["configurations"]:
        cfg, figs = row["config"], row["figures"]
        for impl in cfg["impls"]:
            fig = figs.get(impl, {})
            ratios = _bytes_ratios(fig)
            loss = fig.get("loss_rel_diff_vs_ref")
            lines.append("| " + " | ".join([
                cfg["name"], configs.IMPL_LABELS[impl], _err_or(fig, _ms(fig.get("step_s"))),
                _ratio(fig.get("step_vs_ref")), _mb(fig.get("peak_mb")), _ratio(fig.get("peak_vs_ref")),
                _ms(fig.get("compute_s")), _ms(fig.get("raw_collectives_s")), _overhead(fig),
                _ms(fig.get("compute_paired_s")), _overhead(fig, "paired_"),
                _alternated_times(fig), _overhead(fig, "alternated_"), _interleave_cost(fig),
                _overhead(fig, "library_"),
                _ms(fig.get("step_cpu_s")), _overhead(fig, "cpu_"), _cpu_split(fig), _share(fig),
                _ms(fig.get("exposed_comm_s")), ratios["AG"], ratios["RS"], ratios["AR"],
                "—" if loss is None else f"{loss:.1e}",
            ]) + " |")
    return "\n".join(lines)


def _err_or(fig: dict, text: str) -> str:
    return "FAILED" if "error" in fig else text


def notes(doc: dict) -> str:
    """The lines printed under the tables: machine, grid, MindSpore's composed reduce-scatter."""
    env = doc["environment"]
    lines = [f"- machine: {env['cpu_count']} cores (os.cpu_count()), {env['platform']}; "
             f"torch {env['versions'].get('torch')}, mindspore {env['versions'].get('mindspore')}, "
             f"hyper_parallel {env['versions'].get('hyper_parallel')}"
             f"{_library_note(doc)}; wall time "
             f"{doc['wall_s']:.0f} s; grid: {doc['grid']}; ranks "
             f"{'bound to cores (each launch, every implementation)' if env.get('bind_cores') else 'not bound to cores'}",
             "- ref = FSDP2 (torch) or the DP baseline (MindSpore); ratios > 1: hyper_parallel "
             "slower / bigger / more bytes. AG/RS/AR = bytes per step / theoretical minimum "
             "(HSDP RS/AR are over 'shard'/'replicate').",
             "- overhead = step − (compute + raw collectives); negative = communication "
             "overlapped with compute. exposed = step − compute. Raw collectives: every "
             "hyper_parallel launch times them after its steps, pooled over the launches; "
             "'rounds' (summary table): each launch's median step against its own raw "
             "collectives, in launch order. Same-launch compute: compute-only stepped again at "
             "the end of each distributed launch, in its processes; that overhead subtracts it "
             "instead of the separate compute-only launches' (per round: each launch against "
             "its own compute and raw collectives).",
             "- alternated: each hyper_parallel launch ends with rounds in which its step, the "
             "compute-only step, the interleaved floor's step and a round of raw collectives "
             "run one after the other; the overhead is the median over rounds of each round's "
             "step − (compute + raw collectives), so its terms come from the same minutes. "
             "Interleaved floor: the plain model with the minimal collectives issued from hooks "
             "where the step needs them (synchronous, no library code). interleave cost = floor "
             "− (compute + raw collectives): what placing the collectives between the compute "
             "costs by itself; library overhead = step − floor: hyper_parallel's own cost "
             "(negative where it overlaps communication with compute).",
             "- CPU overhead = step CPU − (compute CPU + raw collectives CPU), per rank, CPU time of "
             "the whole process: the work an implementation adds, without the effect of ranks "
             "sharing cores. raw CPU/wall: cores a rank keeps busy during the raw collectives "
             f"({env['cpu_count']} cores here); near the cores each rank has, communication "
             "cannot hide behind compute. Detail table: the CPU overhead split between the "
             "thread that runs the step (hooks, copies, scaling, issuing collectives) and the "
             "framework's other threads (communication).",
             "- round spread: how far hyper_parallel's own launches of one configuration "
             "disagree (slowest minus fastest launch median, % of the pooled step): the noise "
             "of this run.",
             f"- MindSpore pipeline: {env.get('mindspore_pipeline', 'async')} for every MindSpore "
             f"implementation alike (benchmarks/README.md, 'MindSpore pipeline')"]
    if doc.get("grid_note"):
        lines.append(f"- {doc['grid_note']}")
    for row in doc["configurations"]:
        factor = row["figures"].get("hp", {}).get("composed_reduce_scatter")
        if factor and "sent_bytes_factor" in factor:
            text = (f"- {row['config']['name']}: reduce-scatter runs as {'/'.join(factor['wire'])} "
                    f"over {factor['group_size']} ranks; counted bytes = minimum, each rank sends "
                    f"{factor['sent_bytes_factor']:.1f}x what a native reduce-scatter sends")
            if "time_factor" in factor:
                text += (f"; measured time of the composed reduce-scatters "
                         f"{factor['composed_rs_s'] * 1000:.0f} ms vs all-gathers of the same size "
                         f"{factor['same_size_all_gather_s'] * 1000:.0f} ms: "
                         f"{factor['time_factor']:.2f}x")
            lines.append(text)
    failed = [f"{row['config']['name']}/{impl}" for row in doc["configurations"]
              for impl, fig in row["figures"].items() if "error" in fig]
    if failed:
        lines.append(f"- FAILED launches (details in the JSON): {', '.join(failed)}")
    return "\n".join(lines)


def _library_note(doc: dict) -> str:
    lib = doc.get("library", {}).get("start", {})
    if not lib.get("commit"):
        return ""
    text = f" at {lib['commit']}" + (" + uncommitted changes" if lib.get("dirty") else "")
    if doc["library"].get("changed_during_run"):
        text += " (CHANGED DURING THE RUN)"
    return text


def markdown(doc: dict) -> str:
    return "\n\n".join([summary_table(doc), detail_table(doc), notes(doc)])


def write_json(doc: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(doc, indent=1, sort_keys=True))
    partial.replace(path)


def _plot_order(cfg: dict) -> list:
    ref = configs.REFERENCE[cfg["backend"]]
    first = [impl for impl in ("hp", ref) if impl in cfg["impls"]]
    return first + [impl for impl in cfg["impls"] if impl not in first]


def write_png(doc: dict, path: Path) -> str:
    """Bars of step time and peak memory per configuration and implementation; returns a
    note for the console (written, or why not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"PNG skipped: matplotlib is not installed (pip install matplotlib) — {path.name} not written"
    rows = doc["configurations"]
    colors = {impl: f"C{i}" for i, impl in enumerate(configs.IMPL_LABELS)}
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 1.3 * len(rows) + 3), 8.5), sharex=True)
    labelled = set()
    for metric, scale, axis, label in (("step_s", 1000.0, axes[0], "median step time (ms)"),
                                       ("peak_mb", 1.0, axes[1], "peak memory per rank (MB)")):
        for i, row in enumerate(rows):
            # bars per row in table order: hp, its reference, then the others, centred
            order = _plot_order(row["config"])
            width = 0.8 / max(1, len(order))
            for k, impl in enumerate(order):
                value = row["figures"].get(impl, {}).get(metric)
                if value is None:
                    continue
                name = configs.IMPL_LABELS[impl]
                axis.bar(i + (k - (len(order) - 1) / 2) * width, value * scale, width,
                         color=colors[impl], label=None if name in labelled else name)
                labelled.add(name)
        axis.set_ylabel(label)
        axis.grid(axis="y", alpha=0.3)
    axes[0].legend(ncol=len(configs.IMPL_LABELS), fontsize="small")
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
