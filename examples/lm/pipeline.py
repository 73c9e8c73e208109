"""The example model cut into pipeline stages (``--pp N``), written once for both frameworks.

[Note: the split]
torchtitan's way: ``hp.pipelining.generate_llm_fqn_per_model_part`` weighs the embedding,
each decoder layer and the norm with the head into ``N`` stages (``2 N`` for the
interleaved schedule, two per pp rank), named as this model names its modules, and
``hp.pipelining.pipeline_module_split`` keeps of the whole model only what this pp rank's
stages are named for; a part keeps the whole model's parameter names. Each part is then
laid out as a whole model is (examples/lm/layout.py: the tensor-parallel plan's keys that
name its modules, each decoder layer and the part ``fully_shard`` units over the
data-parallel dims), and the schedule trains the parts on ``mesh["pp"]``: each step's rows are cut into
``microbatches`` micro-batches, the last stage's loss is the mean of theirs, and the
gradients are those of that mean (the schedule's ``scale_grads``), as one process's over
the whole batch.
"""

from __future__ import annotations

SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B"}
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved": 2}
# this model's names for generate_llm_fqn_per_model_part's (torchtitan's Llama's)
NAMES = dict(input_modules=("model.embed_tokens",), layers="model.layers",
             output_modules=("model.norm", "lm_head"))


def check_pipeline(pp: int, schedule: str, layers: int, rows: int, microbatches: int,
                   refused: dict) -> str | None:
    """Why ``--pp pp`` cannot run (None if it can); ``rows``: each data-parallel rank's rows
    per step; ``refused``: ``{option: given}`` of the options that do not compose with it."""
    given = [option for option, on in refused.items() if on]
    if pp > 1 and given:
        return (f"--pp does not compose with {', '.join(given)}: pipelined runs take --tp, "
                f"--mesh, --recompute and checkpoints; leave out {', '.join(given)}")
    stages = pp * STAGES_PER_RANK[schedule]
    if pp > 1 and stages > layers + 2:
        return (f"--pp {pp} with --pp-schedule {schedule} makes {stages} stages, more than "
                f"the model's {layers} layers, embedding and head: lower --pp")
    if microbatches < 1 or rows % microbatches:
        return (f"--microbatches {microbatches} must divide each data-parallel rank's "
                f"{rows} rows per step (--batch over the data-parallel ranks)")
    return None


def module_names_per_stage(hp, pp: int, schedule: str, layers: int) -> list:
    """Every stage's module names, in stage order."""
    return hp.pipelining.generate_llm_fqn_per_model_part(pp * STAGES_PER_RANK[schedule],
                                                         layers, **NAMES)


class Pipeline:
    """This rank's stages of the example model and the schedule that trains them."""

    def __init__(self, hp, model, mesh, schedule: str, microbatches: int, device):
        self.hp, self.mesh, self.schedule_name = hp, mesh, schedule
        self.microbatches, self.schedule = microbatches, None
        names = module_names_per_stage(hp, mesh.size(), schedule, len(model.model.layers))
        self.stages, self.parts = hp.pipelining.pipeline_module_split(
            model, mesh, SCHEDULES[schedule], device, names)
        self.is_first = any(stage.is_first for stage in self.stages)
        self.is_last = any(stage.is_last for stage in self.stages)

    def start(self, loss_fn) -> None:
        """The schedule over the stages, once their parts are laid out."""
        hp = self.hp
        if STAGES_PER_RANK[self.schedule_name] > 1:
            self.schedule = hp.pipelining.ScheduleInterleaved1F1B(
                self.stages, self.microbatches, loss_fn=loss_fn)
        else:
            kind = (hp.pipelining.ScheduleGPipe if self.schedule_name == "gpipe"
                    else hp.pipelining.Schedule1F1B)
            self.schedule = kind(self.stages[0], self.microbatches, loss_fn=loss_fn)

    def step(self, ids, targets) -> float | None:
        """One step's forwards and backwards: the mean of the micro-batches' losses on the
        last stage, None on the other ranks."""
        return self._run(self.schedule.step, ids, targets)

    def eval(self, ids, targets) -> float | None:
        """The forwards only, on a held-out batch: as ``step``."""
        return self._run(self.schedule.eval, ids, targets)

    def _run(self, run, ids, targets):
        losses = [] if self.is_last else None
        run(*((ids,) if self.is_first else ()), target=targets if self.is_last else None,
            losses=losses)
        to_numpy = self.hp.get_platform().to_numpy
        return None if losses is None else sum(float(to_numpy(v)) for v in losses) / len(losses)


def held_row(values: list) -> list:
    """``values`` and a 1 where this rank holds them, zeros where it does not (its values are
    None: a pipeline's losses are the last stage's): summed over the ranks, the last entry
    counts the ranks that hold them."""
    held = values[0] is not None
    return [v if held else 0.0 for v in values] + [float(held)]
