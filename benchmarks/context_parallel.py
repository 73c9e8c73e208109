"""Context parallelism measured on both frameworks, same shapes: the example language model
at cp2 (ring attention, fully_shard over the 2 ranks) against one process at the same
global batch.

[Note: what is measured, and against what]
One launch of 2 ranks per framework (context_parallel_rank.py), both models in the same
processes:

- the bytes autograd keeps for backward in one forward, per rank, at cp2 against one
  process (the framework's saved-tensor hooks): the activations of half of every sequence,
  and the weights each matmul keeps (the same in both); on a sequence long enough for the
  activations to dominate, about a half;
- step time of cp2 against one process stepping the whole global batch, one step each in
  alternated rounds (the order reversed every round), the per-round ratio's median and
  quartiles; a round's time is the slowest rank's;
- the bytes the ring moves in one step (``hp.comm_stats`` on the cp dim: each send),
  against what the ring implies (``implied_comm``).

    python benchmarks/context_parallel.py                      # both frameworks, size small
    python benchmarks/context_parallel.py --size tiny --seq 32 --rounds 2 --backend torch
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
CP = 2


def implied_comm(size: str, batch: int, seq: int) -> dict:
    """``{op: [calls, bytes]}`` of one fp32 training step of the ring at cp2, per rank: each
    of the L attention layers passes its keys and values (``batch`` sequences, every head
    after the example's grouped-query repeat, ``seq / cp`` positions) on cp - 1 times in
    forward, and their gradients back cp - 1 times in backward, one send each."""
    s = SIZES[size]
    kv = 2 * batch * s["heads"] * (seq // CP) * (s["hidden"] // s["heads"]) * 4
    sends = 2 * s["layers"] * (CP - 1)
    return {"send": [sends, sends * kv]}


def measure(backends: list, size: str, batch: int, seq: int, warmup: int, rounds: int,
            timeout_s: float, progress=print) -> dict:
    """Each framework's figures (module docstring)."""
    out = {"size": size, "batch": batch, "seq": seq, "rounds": rounds,
           "implied_comm": implied_comm(size, batch, seq), "backends": {}}
    for backend in backends:
        job = {"size": size, "batch": batch, "seq": seq, "warmup": warmup, "rounds": rounds}
        ranks = launch("context_parallel_rank.py", job, CP, backend, timeout_s, bind_cores=True)
        slowest = slowest_rounds(ranks, ("one", "cp2"))
        saved = {kind: max(r["saved_bytes"][kind] for r in ranks) for kind in ("one", "cp2")}
        figures = {
            "step_s": {kind: spread(times) for kind, times in slowest.items()},
            "cp2_vs_one": round_ratio(slowest, "cp2", "one"),
            "saved_bytes": saved,
            "cp2_vs_one_saved": saved["cp2"] / saved["one"],
            "cp_comm": ranks[0]["cp_comm"],
            "losses": {kind: ranks[0]["losses"][kind] for kind in ("one", "cp2")},
        }
        out["backends"][backend] = figures
        ratio = figures["cp2_vs_one"]
        progress(f"  {backend}: cp2 / one process step time {ratio['median']:.2f} "
                 f"[{ratio['q1']:.2f}, {ratio['q3']:.2f}], saved for backward cp2 / one "
                 f"{figures['cp2_vs_one_saved']:.3f}", flush=True)
    return out


def report(result: dict) -> str:
    implied = result["implied_comm"]["send"]
    lines = [f"Context parallelism, example LM size {result['size']}, global batch "
             f"{result['batch']} x {result['seq']} bytes, 2 ranks (ring), fp32, AdamW, "
             f"{result['rounds']} alternated rounds:", "",
             "| framework | saved for backward/rank cp2 / one process | step cp2 / one "
             "process (median [q1, q3]) | one-process step s | cp2 step s | "
             "ring sends/step measured / implied | ring bytes/step measured / implied |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for backend, f in result["backends"].items():
        ratio, step = f["cp2_vs_one"], f["step_s"]
        calls, nbytes = f["cp_comm"].get("send", [0, 0])
        lines.append(
            f"| {backend} | {f['cp2_vs_one_saved']:.3f} ({f['saved_bytes']['cp2'] / 2**20:.1f} "
            f"/ {f['saved_bytes']['one'] / 2**20:.1f} MiB) | {ratio['median']:.2f} "
            f"[{ratio['q1']:.2f}, {ratio['q3']:.2f}] | {step['one']['median']:.3f} | "
            f"{step['cp2']['median']:.3f} | {calls} / {implied[0]} | "
            f"{nbytes / 2**20:.2f} / {implied[1] / 2**20:.2f} MiB |")
    return "\n".join(lines)


def main() -> None:
    lm_comparison_main(__doc__, measure, report, RESULTS / "context_parallel.json", sizes=SIZES,
                       size="small", batch=2, seq=256, rounds=4)


if __name__ == "__main__":
    main()
