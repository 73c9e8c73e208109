"""The driver side of configurations timed in alternated rounds (the ranks run
measure.alternate), and the command line of the example language model's comparisons
(tensor_parallel.py, expert_parallel.py, context_parallel.py).

A round's time is the slowest rank's (a synchronous step runs at its slowest rank); one
round's ratio compares two steps taken seconds apart in the same processes, and the
figures are the median and quartiles over rounds (analysis.spread).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from analysis import spread
from report import publish


def slowest_rounds(ranks: list, kinds, key: str = "times") -> dict:
    """``{kind: [the slowest rank's seconds in each round]}``."""
    return {kind: [max(times) for times in zip(*(r[key][kind] for r in ranks))]
            for kind in kinds}


def round_ratio(slowest: dict, numerator: str, denominator: str) -> dict:
    """The spread over rounds of one round's ``numerator`` / ``denominator`` time."""
    return spread([a / b for a, b in zip(slowest[numerator], slowest[denominator])])


def lm_comparison_main(doc: str, measure: Callable, report: Callable, out: Path, *,
                       sizes, size: str, batch: int, seq: int, rounds: int) -> None:
    """The command line of a comparison on the example language model: the options, the
    defaults given, ``measure`` on the chosen frameworks, the report published."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--backend", choices=("torch", "mindspore", "all"), default="all")
    parser.add_argument("--size", choices=sorted(sizes), default=size)
    parser.add_argument("--batch", type=int, default=batch, help="global batch, sequences")
    parser.add_argument("--seq", type=int, default=seq)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, default=out)
    args = parser.parse_args()
    backends = ["torch", "mindspore"] if args.backend == "all" else [args.backend]
    result = measure(backends, args.size, args.batch, args.seq, args.warmup, args.rounds,
                     args.timeout)
    publish(result, report(result), args.out)
