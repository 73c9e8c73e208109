"""Expert parallelism measured on both frameworks, same shapes: the example language model
with experts (``--moe``) at dp2 x ep2 against FSDP over the same 4 ranks.

[Note: what is measured, and against what]
One launch of 4 ranks per framework (expert_parallel_rank.py), every model in the same
processes:

- per-rank parameter and optimizer-state bytes at ep2 (experts split over 2 ranks, sharded
  over the 2 ranks holding the same experts) against ep1 (FSDP over those 2 ranks, no
  split): the experts should hold half, and so should the rest (sharded over 4 ranks at
  ep2, over 2 at ep1);
- step time of dp2 x ep2 against FSDP over 4 ranks, one step each in alternated rounds
  (the order reversed every round), the per-round ratio's median and quartiles; a round's
  time is the slowest rank's;
- the bytes the all-to-alls move over the ``ep`` dim in one step (``hp.comm_stats``: what a
  rank sends to other ranks), against what the routing of that step implies: per layer the
  counts exchanged (int64), each row a rank sends to another rank's expert and each row it
  returns, forward and again in backward (``implied_bytes``).

    python benchmarks/expert_parallel.py                      # both frameworks, size tiny
    python benchmarks/expert_parallel.py --size small --rounds 2 --backend torch
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _path in (HERE, HERE.parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from examples.lm.config import SIZES  # noqa: E402
from examples.lm.expert_parallel import EXPERTS  # noqa: E402
from alternated import lm_comparison_main, round_ratio, slowest_rounds  # noqa: E402
from analysis import spread  # noqa: E402
from launch_ranks import launch  # noqa: E402

RESULTS = HERE / "results"
EP = 2


def implied_bytes(counts: list, rank: int, hidden: int) -> int:
    """What ``rank`` sends over "ep" in one fp32 step: ``counts[r][layer]`` is the
    per-expert rows rank r routed in that layer (ranks 2g and 2g+1 form an expert group)."""
    local = EXPERTS // EP
    group = [rank - rank % EP + i for i in range(EP)]
    mine = range(rank % EP * local, rank % EP * local + local)
    total = 0
    for layer, routed in enumerate(counts[rank]):
        sent = sum(n for e, n in enumerate(routed) if e not in mine)
        returned = sum(counts[peer][layer][e] for peer in group if peer != rank for e in mine)
        total += (EXPERTS - local) * 8 + 2 * (sent + returned) * hidden * 4
    return total


def measure(backends: list, size: str, batch: int, seq: int, warmup: int, rounds: int,
            timeout_s: float, progress=print) -> dict:
    """Each framework's figures (module docstring)."""
    out = {"size": size, "batch": batch, "seq": seq, "rounds": rounds, "backends": {}}
    for backend in backends:
        job = {"size": size, "batch": batch, "seq": seq, "warmup": warmup, "rounds": rounds}
        ranks = launch("expert_parallel_rank.py", job, 4, backend, timeout_s, bind_cores=True)
        slowest = slowest_rounds(ranks, ("fsdp4", "ep2"))
        memory = {kind: {part: max(sum(r["state_bytes"][kind][part]) for r in ranks)
                         for part in ("experts", "rest")} for kind in ("fsdp4", "ep2", "ep1")}
        counts = [r["counts"] for r in ranks]
        figures = {
            "step_s": {kind: spread(times) for kind, times in slowest.items()},
            "ep2_vs_fsdp4": round_ratio(slowest, "ep2", "fsdp4"),
            "state_bytes": memory,
            "ep2_vs_ep1_bytes": {part: memory["ep2"][part] / memory["ep1"][part]
                                 for part in ("experts", "rest")},
            "all_to_all": [r["all_to_all"] for r in ranks],
            "implied_bytes": [implied_bytes(counts, r, SIZES[size]["hidden"])
                              for r in range(len(ranks))],
        }
        out["backends"][backend] = figures
        ratio = figures["ep2_vs_fsdp4"]
        progress(f"  {backend}: dp2 x ep2 / FSDP 4 step time {ratio['median']:.2f} "
                 f"[{ratio['q1']:.2f}, {ratio['q3']:.2f}], experts' state at ep2 / ep1 "
                 f"{figures['ep2_vs_ep1_bytes']['experts']:.3f}", flush=True)
    return out


def report(result: dict) -> str:
    lines = [f"Expert parallelism, example LM size {result['size']} with 4 experts per layer "
             f"(top-2), global batch {result['batch']} x {result['seq']} bytes, 4 ranks, "
             f"fp32, AdamW, {result['rounds']} alternated rounds:", "",
             "| framework | state/rank ep2 / ep1: experts | the rest | step dp2 x ep2 / FSDP 4 "
             "(median [q1, q3]) | FSDP 4 step s | dp2 x ep2 step s | all-to-all bytes/step "
             "rank 0 measured / implied (calls) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for backend, f in result["backends"].items():
        ratio, step = f["ep2_vs_fsdp4"], f["step_s"]
        calls, measured = f["all_to_all"][0]
        lines.append(
            f"| {backend} | {f['ep2_vs_ep1_bytes']['experts']:.3f} | "
            f"{f['ep2_vs_ep1_bytes']['rest']:.3f} | {ratio['median']:.2f} "
            f"[{ratio['q1']:.2f}, {ratio['q3']:.2f}] | {step['fsdp4']['median']:.3f} | "
            f"{step['ep2']['median']:.3f} | {measured:,} / {f['implied_bytes'][0]:,} "
            f"({calls}) |")
    return "\n".join(lines)


def main() -> None:
    lm_comparison_main(__doc__, measure, report, RESULTS / "expert_parallel.json", sizes=SIZES,
                       size="tiny", batch=8, seq=32, rounds=4)


if __name__ == "__main__":
    main()
