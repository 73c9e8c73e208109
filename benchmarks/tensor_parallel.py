"""Tensor parallelism measured on both frameworks, same shapes: the example language model at
dp2 x tp2 against FSDP over the same 4 ranks.

[Note: what is measured, and against what]
One launch of 4 ranks per framework (tensor_parallel_rank.py), every model in the same
processes:

- per-rank parameter + gradient + optimizer-state bytes at tp2 (dp2 x tp2) against tp1
  (FSDP over the same 2 data-parallel ranks, no tensor parallelism): the layers the plan
  splits should hold half, the norms (replicated) the same;
- step time of dp2 x tp2 against FSDP over 4 ranks, one step each in alternated rounds
  (the order reversed every round), the per-round ratio's median and quartiles; a round's
  time is the slowest rank's;
- the bytes the tensor-parallel collectives move in one step (``hp.comm_stats`` on the tp
  dim, as it counts them: an all-gather's gathered output, a reduce-scatter's input, an
  all-reduce's tensor), against what the plan implies (``implied_comm``).

    python benchmarks/tensor_parallel.py                      # both frameworks, size small
    python benchmarks/tensor_parallel.py --size tiny --rounds 2 --backend torch
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _path in (HERE, HERE.parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from examples.lm.config import SIZES  # noqa: E402
from alternated import lm_comparison_main, round_ratio, slowest_rounds  # noqa: E402
from analysis import spread  # noqa: E402
from launch_ranks import launch  # noqa: E402

RESULTS = HERE / "results"


def implied_comm(size: str, batch: int, seq: int) -> dict:
    """``{op: [calls, bytes]}`` one fp32 training step of the example plan moves over the
    tp dim at tp2, per rank (examples/lm/tensor_parallel.py): with ``X`` one (b, t, hidden)
    activation of a data-parallel rank's ``b = batch / 2`` sequences,

    - all-gather: the attention's and the MLP's inputs in forward, and in backward the
      gradients of the row-wise outputs and the embedding's (each X), ``4L + 2``;
    - reduce-scatter: the row-wise outputs and the embedding's in forward, and in backward
      the partial gradients of the attention's, the MLP's and the head's inputs, ``4L + 2``;
    - all-reduce: the loss's row maximum, sum of exponentials and target log-probability
      (``b * t`` floats each), and the gradients of the ``2L + 1`` sequence-parallel
      norms' weights (``hidden`` floats each)."""
    s = SIZES[size]
    layers, hidden, rows = s["layers"], s["hidden"], batch // 2 * seq
    activation = rows * hidden * 4
    return {"all_gather": [4 * layers + 2, (4 * layers + 2) * activation],
            "reduce_scatter": [4 * layers + 2, (4 * layers + 2) * activation],
            "all_reduce": [3 + 2 * layers + 1, 3 * rows * 4 + (2 * layers + 1) * hidden * 4]}


def measure(backends: list, size: str, batch: int, seq: int, warmup: int, rounds: int,
            timeout_s: float, progress=print) -> dict:
    """Each framework's figures (module docstring)."""
    out = {"size": size, "batch": batch, "seq": seq, "rounds": rounds,
           "implied_comm": implied_comm(size, batch, seq), "backends": {}}
    for backend in backends:
        job = {"size": size, "batch": batch, "seq": seq, "warmup": warmup, "rounds": rounds}
        ranks = launch("tensor_parallel_rank.py", job, 4, backend, timeout_s, bind_cores=True)
        slowest = slowest_rounds(ranks, ("fsdp4", "tp2"))
        memory = {kind: {part: max(sum(r["state_bytes"][kind][part]) for r in ranks)
                         for part in ("split", "rest")} for kind in ("fsdp4", "tp2", "tp1")}
        comm = {}
        for key, (calls, nbytes) in ranks[0]["tp_comm"].items():
            op = key.split(":")[0]
            comm[op] = [comm.get(op, [0, 0])[0] + calls, comm.get(op, [0, 0])[1] + nbytes]
        figures = {
            "step_s": {kind: spread(times) for kind, times in slowest.items()},
            "tp2_vs_fsdp4": round_ratio(slowest, "tp2", "fsdp4"),
            "state_bytes": memory,
            "tp2_vs_tp1_bytes": {part: memory["tp2"][part] / memory["tp1"][part]
                                 for part in ("split", "rest")},
            "tp_comm": comm,
            "losses": {kind: ranks[0]["losses"][kind] for kind in ("fsdp4", "tp2")},
        }
        out["backends"][backend] = figures
        ratio = figures["tp2_vs_fsdp4"]
        progress(f"  {backend}: dp2 x tp2 / FSDP 4 step time {ratio['median']:.2f} "
                 f"[{ratio['q1']:.2f}, {ratio['q3']:.2f}], split layers' state at tp2 / tp1 "
                 f"{figures['tp2_vs_tp1_bytes']['split']:.3f}", flush=True)
    return out


def report(result: dict) -> str:
    implied = result["implied_comm"]
    lines = [f"Tensor parallelism, example LM size {result['size']}, global batch "
             f"{result['batch']} x {result['seq']} bytes, 4 ranks, fp32, AdamW, "
             f"{result['rounds']} alternated rounds:", "",
             "| framework | state/rank tp2 / tp1: split layers | the rest | step dp2 x tp2 / "
             "FSDP 4 (median [q1, q3]) | FSDP 4 step s | dp2 x tp2 step s | "
             "tp bytes/step measured / implied |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    total_implied = sum(v[1] for v in implied.values())
    for backend, f in result["backends"].items():
        ratio, step = f["tp2_vs_fsdp4"], f["step_s"]
        measured = sum(v[1] for v in f["tp_comm"].values())
        lines.append(
            f"| {backend} | {f['tp2_vs_tp1_bytes']['split']:.3f} | "
            f"{f['tp2_vs_tp1_bytes']['rest']:.3f} | {ratio['median']:.2f} "
            f"[{ratio['q1']:.2f}, {ratio['q3']:.2f}] | {step['fsdp4']['median']:.3f} | "
            f"{step['tp2']['median']:.3f} | {measured / 2**20:.2f} MiB / "
            f"{total_implied / 2**20:.2f} MiB |")
    lines += ["", "| framework | op | calls measured / implied | bytes measured / implied |",
              "| --- | --- | --- | --- |"]
    for backend, f in result["backends"].items():
        for op, (calls, nbytes) in sorted(implied.items()):
            got = f["tp_comm"].get(op, [0, 0])
            lines.append(f"| {backend} | {op} | {got[0]} / {calls} | {got[1]:,} / {nbytes:,} |")
    return "\n".join(lines)


def main() -> None:
    lm_comparison_main(__doc__, measure, report, RESULTS / "tensor_parallel.json", sizes=SIZES,
                       size="small", batch=8, seq=128, rounds=6)


if __name__ == "__main__":
    main()
