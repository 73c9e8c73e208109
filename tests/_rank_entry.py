"""Child side of the test harness: ``python -m tests._rank_entry WORKDIR`` runs one rank.

Design note
-----------
tests/multirank.py starts one of these per rank with the launcher's rendezvous environment.
It reads ``{"target": "module:function", "args": (...)}`` from ``WORKDIR/args.pkl``, joins the
process group (``hp.init_distributed``), calls the target, leaves the group
(``hp.destroy_distributed``, whose final barrier keeps a rank from exiting while a peer still
sends to it) and pickles the return value to ``WORKDIR/result.<rank>.pkl``.  Any exception is
written to ``WORKDIR/error.<rank>.txt`` and the rank exits 1.

The process always ends with ``os._exit`` after flushing: a framework's atexit hooks may hang
forever when a peer already died, and the harness only needs the files.

Environment variable ``HP_TEST_NO_DIST=1`` skips init/destroy of the process group, so the
harness itself can be tested without any framework (see tests/test_launch.py).
"""

import importlib
import os
import pickle
import sys
import traceback
from pathlib import Path


def _run(workdir: Path, rank: int) -> None:
    if os.environ.get("HP_BACKEND") == "torch":
        import torch  # lazily: a MindSpore rank must not pay for (or depend on) torch

        torch.set_num_threads(1)  # ranks share few cores, even if OMP_NUM_THREADS says more
    elif os.environ.get("HP_TEST_MS_LAUNCH_BLOCKING") == "1":  # see tests/multirank.py
        import mindspore

        mindspore.runtime.launch_blocking()
    with open(workdir / "args.pkl", "rb") as file:
        payload = pickle.load(file)
    distributed = os.environ.get("HP_TEST_NO_DIST") != "1"
    if distributed:
        import hyper_parallel as hp

        hp.init_distributed()
    module_name, function_name = payload["target"].split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    result = function(*payload["args"])
    if distributed:
        hp.destroy_distributed()
    partial = workdir / f"result.{rank}.pkl.partial"
    with open(partial, "wb") as file:
        pickle.dump(result, file)
    os.replace(partial, workdir / f"result.{rank}.pkl")  # never leave a truncated result


def main() -> None:
    workdir = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    code = 0
    try:
        _run(workdir, rank)
    except BaseException:  # noqa: BLE001 - SystemExit/KeyboardInterrupt in a target also fail it
        # The harness reports this file next to the log tail, so it is not printed as well.
        (workdir / f"error.{rank}.txt").write_text(traceback.format_exc())
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
