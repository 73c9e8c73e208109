"""Train a Llama-style byte-level language model with fully_shard, on torch or MindSpore.

    python examples/train_lm.py --nproc 2                        # torch, 2 CPU ranks, ~13M params
    python examples/train_lm.py --backend mindspore --nproc 2
    python examples/train_lm.py --nproc 4 --mesh 2x2 --dtype bf16  # HSDP, bf16 parameters
    python examples/train_lm.py --nproc 4 --tp 2                  # FSDP over 2 x tensor parallel 2
    python examples/train_lm.py --nproc 2 --moe --ep 2            # experts split over 2 ranks
    python examples/train_lm.py --nproc 8 --moe --ep 2 --tp 2 --mesh 2x2  # HSDP x EP x TP
    python examples/train_lm.py --nproc 4 --cp 2                  # FSDP 2 x context parallel 2
    python examples/train_lm.py --nproc 8 --pp 2 --tp 2           # pipeline 2 x FSDP 2 x TP 2
    python examples/train_lm.py --size 124m --nproc 8            # GPT-2-small sized

The model (examples/lm/: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU, with
Hugging Face Llama's parameter names) is written once per framework; every decoder layer
and the root are fully_shard units; with ``--tp N`` the model is first split over N ranks
with Megatron's tensor-parallel plan (examples/lm/tensor_parallel.py); with ``--cp N`` each
sequence is split over N ranks (hp.context_parallel, docs/context-parallel.md); with ``--pp N``
the model is cut into N pipeline stages by module names (examples/lm/pipeline.py,
docs/pipelining.md), each stage laid out as the whole model would be. It trains with
AdamW on random windows of the bundled text (examples/data/), a progress line per step, a
checkpoint every ``--ckpt-every`` steps in ``--out``, validation at each checkpoint and at
the end, and the loss curve as a PNG.

A checkpoint is portable: ``--resume`` takes one written by either framework at any number
of ranks and mesh, so a run started on torch continues on MindSpore (and back) on the
batches the uninterrupted run would have seen:

    python examples/train_lm.py --steps 100 --ckpt-every 50
    python examples/train_lm.py --steps 100 --backend mindspore --resume runs/train_lm/step-00050

``--export DIR`` writes the trained weights in the Hugging Face layout with their
config.json, for ``transformers.LlamaForCausalLM.from_pretrained(DIR)``; with ``--moe``,
the weights only, each expert under its own names (examples/lm/expert_parallel.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.lm.config import SIZES  # noqa: E402
from examples.lm.pipeline import SCHEDULES  # noqa: E402

DTYPES = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("torch", "mindspore"),
                        default=os.environ.get("HP_BACKEND", "torch"),
                        help="framework (default: $HP_BACKEND, else torch)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks on this machine (default 2)")
    parser.add_argument("--mesh", metavar="RxS",
                        help="HSDP: R replicas of S-way sharding, R*S = --nproc (default: "
                             "FSDP over all ranks)")
    parser.add_argument("--tp", type=int, default=1, metavar="N",
                        help="tensor-parallel degree: each layer split over N ranks, FSDP "
                             "(or --mesh's HSDP) over the nproc / N groups (default 1: none)")
    parser.add_argument("--moe", action="store_true",
                        help="a mixture of experts in place of each MLP (4 experts, top-2, "
                             "router-bias balancing; built eagerly)")
    parser.add_argument("--ep", type=int, default=1, metavar="N",
                        help="with --moe: the experts split over N of the sharding ranks "
                             "(with --tp: of each tensor-parallel position's; with --mesh RxS: "
                             "of the S) (default 1: none)")
    parser.add_argument("--cp", type=int, default=1, metavar="N",
                        help="context-parallel degree: each sequence split over N ranks, which "
                             "fully_shard shards over too (default 1: none)")
    parser.add_argument("--pp", type=int, default=1, metavar="N",
                        help="pipeline-parallel degree: the model cut into N stages (2 N "
                             "with --pp-schedule interleaved), each over nproc / N ranks "
                             "(default 1: none)")
    parser.add_argument("--pp-schedule", choices=sorted(SCHEDULES), default="1f1b",
                        help="the pipeline schedule (default 1f1b)")
    parser.add_argument("--microbatches", type=int, metavar="M",
                        help="micro-batches per step under --pp (default: --pp)")
    parser.add_argument("--recompute", action="store_true",
                        help="activation recompute: each decoder layer's forward runs again "
                             "in backward")
    parser.add_argument("--size", choices=sorted(SIZES), default="small",
                        help="model size (default small, ~13M parameters)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="parameter dtype in forward and backward; gradients are reduced "
                             "and the optimizer steps in fp32 (default fp32)")
    parser.add_argument("--eager-init", action="store_true",
                        help="build the full model before sharding it (default: deferred, on "
                             "torch's meta device or under MindSpore's no_init_parameters, so "
                             "a rank only ever allocates its shards)")
    parser.add_argument("--steps", type=int, default=120, help="last step to train to (default 120)")
    parser.add_argument("--batch", type=int, default=8,
                        help="global batch in sequences, split over the ranks (default 8)")
    parser.add_argument("--seq", type=int, help="sequence length in bytes (default: the size's)")
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default 2e-3)")
    parser.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (default 1.0)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batches (default 0)")
    parser.add_argument("--out", default="runs/train_lm",
                        help="checkpoints, metrics.json and loss.png go here (default runs/train_lm)")
    parser.add_argument("--ckpt-every", type=int, default=0, metavar="K",
                        help="checkpoint every K steps into OUT/step-NNNNN (default 0: only "
                             "with --ckpt-at-end)")
    parser.add_argument("--ckpt-at-end", action="store_true", help="checkpoint after the last step")
    parser.add_argument("--keep", type=int, default=2, help="checkpoints kept (default 2, newest)")
    parser.add_argument("--resume", metavar="PATH", help="continue from this checkpoint")
    parser.add_argument("--eval-batches", type=int, default=4,
                        help="held-out batches per validation (default 4; 0: none)")
    parser.add_argument("--export", metavar="DIR",
                        help="write the final weights in the Hugging Face layout to DIR")
    parser.add_argument("--timeout", type=float, metavar="SECONDS",
                        help="end the job if it runs longer (default: no limit)")
    args = parser.parse_args(argv)
    args.seq = args.seq or SIZES[args.size]["seq"]
    args.mesh_shape = _mesh_shape(parser, args)
    data_parallel = args.nproc // (args.pp * args.tp * args.cp)
    if args.batch % data_parallel:
        parser.error(f"--batch {args.batch} must divide over the {data_parallel} data-parallel "
                     f"ranks (--nproc {args.nproc} / --pp {args.pp} / --tp {args.tp} / --cp "
                     f"{args.cp}): each takes an equal share of each global batch")
    _check_pipeline(parser, args, args.batch // data_parallel)
    if args.seq % (2 * args.cp):
        parser.error(f"--seq {args.seq} must be a multiple of 2 x --cp = {2 * args.cp}: each "
                     f"sequence is cut into 2 x cp chunks (docs/context-parallel.md)")
    if args.seq > SIZES[args.size]["seq"]:
        parser.error(f"--seq {args.seq} is longer than size {args.size}'s rotary tables "
                     f"({SIZES[args.size]['seq']})")
    if args.backend == "mindspore" and args.dtype == "bf16":
        parser.error("--dtype bf16: MindSpore on CPU has no bfloat16 matmul; use --dtype fp16")
    _check_experts(parser, args)
    return args


def _check_pipeline(parser, args, rows: int) -> None:
    """``--pp`` (examples/lm/pipeline.py): what composes with it, its stages and
    micro-batches."""
    from examples.lm.pipeline import check_pipeline

    if args.pp == 1 and args.microbatches:
        parser.error("--microbatches needs --pp: micro-batches are the pipeline schedule's")
    args.microbatches = args.microbatches or args.pp
    refused = {"--cp": args.cp > 1, "--moe": args.moe, "--export": bool(args.export)}
    problem = check_pipeline(args.pp, args.pp_schedule, SIZES[args.size]["layers"], rows,
                             args.microbatches, refused)
    if problem:
        parser.error(problem)


def _check_experts(parser, args) -> None:
    """``--moe`` / ``--ep`` (examples/lm/expert_parallel.py): the model is built eagerly
    (its router bias is a constant of the build)."""
    from examples.lm.expert_parallel import check_degree

    if args.ep > 1 and not args.moe:
        parser.error("--ep N splits the experts of --moe: add --moe")
    problem = check_degree(args.nproc, args.ep, args.tp, args.mesh, args.cp)
    if problem:
        parser.error(problem)
    args.eager_init = args.eager_init or args.moe


def _mesh_shape(parser, args):
    """The mesh's shape: None (FSDP over all ranks), (R, S) for HSDP; with ``--cp N`` the
    context-parallel dim N is appended, then with ``--tp N`` the tensor-parallel dim N;
    with ``--pp N`` the pipeline dim N comes first (FSDP: (N, nproc / N))."""
    if args.tp < 1 or args.nproc % args.tp:
        parser.error(f"--tp {args.tp} must divide --nproc {args.nproc}")
    if args.cp < 1 or args.nproc % (args.tp * args.cp):
        parser.error(f"--cp {args.cp} x --tp {args.tp} must divide --nproc {args.nproc}")
    if args.pp < 1 or args.nproc % (args.pp * args.tp * args.cp):
        parser.error(f"--pp {args.pp} x --tp {args.tp} must divide --nproc {args.nproc}")
    shape = _data_mesh_shape(parser, args)
    if args.pp == 1:
        return shape
    return (args.pp,) + (shape or (args.nproc // (args.pp * args.tp),))


def _data_mesh_shape(parser, args):
    """fully_shard's mesh shape, the pipeline dim left out."""
    nproc = args.nproc // args.pp
    if args.tp > 1:
        from examples.lm.tensor_parallel import check_degree

        problem = check_degree(args.size, args.tp, args.seq)
        if problem:
            parser.error(problem)
    extra = tuple(n for n in (args.cp, args.tp) if n > 1)
    if args.mesh is None:
        return None if not extra else (nproc // (args.tp * args.cp),) + extra
    try:
        replicas, shards = (int(n) for n in args.mesh.lower().split("x"))
    except ValueError:
        parser.error(f"--mesh {args.mesh!r}: expected RxS, e.g. 2x2")
    if replicas * shards * args.tp * args.cp != nproc:
        cp = f" x --cp {args.cp}" if args.cp > 1 else ""
        pp = f" x --pp {args.pp}" if args.pp > 1 else ""
        parser.error(f"--mesh {args.mesh}{cp} x --tp {args.tp}{pp} has "
                     f"{replicas * shards * args.tp * args.cp * args.pp} ranks but --nproc is "
                     f"{args.nproc}")
    return (replicas, shards) + extra


def _meshes(hp, platform, args) -> tuple:
    """(fully_shard's mesh, its dp_mesh_dims, the tensor-parallel mesh, the
    context-parallel mesh, the pipeline mesh): None for FSDP over all ranks, for
    fully_shard's reading of the mesh by position, and for no tensor, context or pipeline
    parallelism. The pipeline dim is the first, the tensor-parallel dim the last, so its
    ranks are adjacent; fully_shard shards over the context-parallel ranks too (their
    gradients are averaged as one process's)."""
    if args.mesh_shape is None:
        return None, None, None, None, None
    data = ("replicate", "shard") if args.mesh else ("shard",)
    cp = ("cp",) if args.cp > 1 else ()
    pp = ("pp",) if args.pp > 1 else ()
    names = pp + data + cp + (("tp",) if args.tp > 1 else ())
    mesh = hp.init_device_mesh(platform.device_type(), args.mesh_shape, mesh_dim_names=names)
    dims = None
    if cp:
        dims = hp.DataParallelMeshDims(shard=("shard", "cp"),
                                       replicate="replicate" if args.mesh else None)
    # joined dims take the whole mesh (dp_mesh_dims leaves the tensor-parallel dim out)
    return (mesh[data] if (args.tp > 1 or pp) and not cp else mesh, dims,
            mesh["tp"] if args.tp > 1 else None, mesh["cp"] if cp else None,
            mesh["pp"] if pp else None)


def rank_main(args: argparse.Namespace) -> None:
    import hyper_parallel as hp
    from examples.lm.config import hf_config, parameter_count
    from examples.lm.data import ByteCorpus, rank_rows
    from examples.lm.progress import plot_losses, progress_line

    os.environ.setdefault("HP_BACKEND", args.backend)  # started by torchrun or msrun
    hp.init_distributed()
    platform = hp.get_platform()
    rank, world = platform.rank(), platform.world_size()
    if platform.name == "torch":
        from examples.lm.trainer_torch import Trainer
    else:
        from examples.lm.trainer_mindspore import Trainer
    mesh, dp_mesh_dims, tp_mesh, cp_mesh, pp_mesh = _meshes(hp, platform, args)
    mp_policy = hp.MixedPrecisionPolicy(param_dtype=DTYPES[args.dtype],
                                        reduce_dtype=DTYPES[args.dtype] and "float32")
    ep_meshes = (None, None)
    if args.moe:
        from examples.lm.expert_parallel import expert_meshes

        ep_meshes = expert_meshes(hp, platform.device_type(), world, args.ep, args.tp,
                                  int(args.mesh.lower().split("x")[0]) if args.mesh else 1)
    trainer = Trainer(args.size, mesh, mp_policy, not args.eager_init, args.lr,
                      args.weight_decay, args.clip, tp_mesh, cp_mesh, dp_mesh_dims,
                      moe=args.moe, ep_meshes=ep_meshes, recompute=args.recompute,
                      pipeline=None if pp_mesh is None else (pp_mesh, args.pp_schedule,
                                                             args.microbatches))
    # a tensor- or context-parallel group's ranks take the same rows: those of their
    # data-parallel rank (the same in every pipeline stage)
    stage_world = world // args.pp
    data_rank = (rank % stage_world) // (args.tp * args.cp)
    data_world = stage_world // (args.tp * args.cp)
    corpus = ByteCorpus()
    history, validation = [], []
    if args.resume:
        extra = hp.load_checkpoint(args.resume, trainer.model, trainer.optimizer,
                                   pp_mesh=_pp_mesh(trainer))
        _check_resumable(args, extra)
        if args.moe:
            from examples.lm.expert_parallel import restore_router_biases

            restore_router_biases(hp, trainer.model, extra["router_biases"])
        history, validation = extra["history"], extra["validation"]
    start = history[-1]["step"] if history else 0
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"train_lm: {platform.name}, {world} ranks ({_layout(args)}), size {args.size} "
        f"({parameter_count(args.size) / 1e6:.1f}M parameters), {args.dtype}, "
        f"{'eager' if args.eager_init else 'deferred'} init, batch {args.batch} x {args.seq} bytes"
        + (f", resumed at step {start} from {args.resume}" if args.resume else ""), flush=True)
    began = time.perf_counter()
    for step in range(start, args.steps):
        ids, targets = corpus.batch(step, args.batch, args.seq, args.seed)
        tick = time.perf_counter()
        loss, grad_norm = trainer.step(rank_rows(ids, data_rank, data_world),
                                       rank_rows(targets, data_rank, data_world))
        (loss,) = trainer.mean_over_ranks([loss])
        seconds = time.perf_counter() - tick
        record = {"step": step + 1, "loss": loss, "grad_norm": grad_norm, "backend": platform.name,
                  "tokens_per_s": args.batch * args.seq / seconds,
                  "memory_mb": trainer.peak_memory_mb(), "elapsed_s": time.perf_counter() - began}
        history.append(record)
        say(progress_line(record, args.steps), flush=True)
        last = step + 1 == args.steps
        if (args.ckpt_every and (step + 1) % args.ckpt_every == 0) or (last and args.ckpt_at_end):
            _validate(args, trainer, corpus, data_rank, data_world, validation, step + 1, say)
            _checkpoint(args, hp, trainer, history, validation, step + 1, rank, say)
        elif last:
            _validate(args, trainer, corpus, data_rank, data_world, validation, step + 1, say)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "metrics.json"), "w") as file:
            json.dump({"args": _saved_args(args), "history": history, "validation": validation}, file)
        png = os.path.join(args.out, "loss.png")
        title = f"train_lm {args.size} on {_layout(args)}, {args.dtype}"
        say(f"loss curve: {png}" if plot_losses(history, validation, png, title)
            else "loss curve skipped: matplotlib is not installed (pip install matplotlib)")
    if args.export and args.moe:
        from examples.lm.expert_parallel import per_expert_names

        hp.export_full(args.export, trainer.model, key_map=per_expert_names(hp))
        say(f"exported, each expert under its own names (no config.json): {args.export}")
    elif args.export:
        hp.export_full(args.export, trainer.model, config=hf_config(args.size))
        say(f"exported for from_pretrained: {args.export}")
    hp.destroy_distributed()


def _layout(args) -> str:
    dp = args.nproc // (args.pp * args.tp * args.cp)
    data = f"HSDP {args.mesh}" if args.mesh else f"FSDP {dp}"
    if args.moe:
        data += f", MoE, EP {args.ep}"
    pp = (f"PP {args.pp} ({args.pp_schedule}, {args.microbatches} micro-batches) x "
          if args.pp > 1 else "")
    return pp + data + (f" x CP {args.cp}" if args.cp > 1 else "") + \
        (f" x TP {args.tp}" if args.tp > 1 else "") + (", recompute" if args.recompute else "")


def _saved_args(args) -> dict:
    return {k: v for k, v in vars(args).items() if k != "mesh_shape"}


def _check_resumable(args, extra) -> None:
    if not isinstance(extra, dict) or "history" not in extra:
        raise SystemExit(f"--resume {args.resume}: not a checkpoint of train_lm.py (its extra "
                         f"data has no training history)")
    saved = extra["args"]
    for name in ("size", "seq", "batch", "seed"):
        if saved[name] != getattr(args, name):
            raise SystemExit(f"--resume {args.resume}: it was trained with --{name} "
                             f"{saved[name]}, this run has {getattr(args, name)}; the batches "
                             f"would not continue the run's. Pass --{name} {saved[name]}")
    if extra["history"] and extra["history"][-1]["step"] >= args.steps:
        raise SystemExit(f"--resume {args.resume}: it is at step {extra['history'][-1]['step']}, "
                         f"past --steps {args.steps}; raise --steps")


def _validate(args, trainer, corpus, rank, world, validation, step, say) -> None:
    if not args.eval_batches:
        return
    from examples.lm.data import rank_rows

    losses = []
    for i in range(args.eval_batches):
        ids, targets = corpus.batch(i, args.batch, args.seq, args.seed, validation=True)
        losses.append(trainer.evaluate(rank_rows(ids, rank, world), rank_rows(targets, rank, world)))
    loss = sum(trainer.mean_over_ranks(losses)) / len(losses)
    validation.append({"step": step, "loss": loss})
    say(f"validation at step {step}: loss {loss:.4f}", flush=True)


def _pp_mesh(trainer):
    """The pipeline mesh a checkpoint of this rank's model parts takes (None: no stages):
    each pp rank saves and loads its stages' parameters under the whole model's names."""
    return trainer.pipeline.mesh if trainer.pipeline else None


def _checkpoint(args, hp, trainer, history, validation, step, rank, say) -> None:
    path = os.path.join(args.out, f"step-{step:05d}")
    tick = time.perf_counter()
    extra = {"args": _saved_args(args), "history": history, "validation": validation}
    if args.moe:
        from examples.lm.expert_parallel import router_biases

        extra["router_biases"] = router_biases(hp, trainer.model)
    hp.save_checkpoint(path, trainer.model, trainer.optimizer, extra=extra,
                       pp_mesh=_pp_mesh(trainer))
    say(f"checkpoint: {path} ({time.perf_counter() - tick:.1f} s)", flush=True)
    if rank == 0 and args.keep > 0:
        saved = sorted(p for p in Path(args.out).glob("step-*") if p.is_dir())
        for old in saved[:-args.keep]:
            shutil.rmtree(old)


def main() -> None:
    args = parse_args()
    if "RANK" in os.environ:
        rank_main(args)
        return
    command = [sys.executable, "-m", "hyper_parallel.launch", "--nproc", str(args.nproc),
               "--backend", args.backend]
    if args.timeout:
        command += ["--timeout", str(args.timeout)]
    sys.exit(subprocess.call(command + [__file__, *sys.argv[1:]]))


if __name__ == "__main__":
    main()
