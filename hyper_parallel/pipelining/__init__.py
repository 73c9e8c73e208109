"""Pipeline parallelism with torch's ``torch.distributed.pipelining`` names, written once
over the platform's point-to-point operations (docs/pipelining.md)."""

from hyper_parallel.pipelining.schedules import (
    Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
)
from hyper_parallel.pipelining.split import (
    generate_llm_fqn_per_model_part, pipeline_module_split,
)
from hyper_parallel.pipelining.stage import PipelineStage

__all__ = ["PipelineStage", "Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B",
           "generate_llm_fqn_per_model_part", "pipeline_module_split"]
