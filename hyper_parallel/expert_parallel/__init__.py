"""Expert parallelism written once over the platform: torchtitan's ``ExpertParallel``
style applied by ``hp.parallelize_module`` to a mixture-of-experts layer's experts, and
the router's bias-based load balancing, the same on every framework.

docs/expert-parallel.md describes the plan (expert parallelism with fully_shard, the
gradient divide factor of the experts) and the current limits.
"""

from hyper_parallel.expert_parallel.balance import update_expert_bias
from hyper_parallel.expert_parallel.style import ExpertParallel

__all__ = ["ExpertParallel", "update_expert_bias"]
