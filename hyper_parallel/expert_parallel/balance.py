"""Load balancing of a mixture-of-experts router by a bias on its scores (torchtitan's
auxiliary-loss-free balancing, DeepSeek-V3's): the per-expert token counts of a step are
summed over every data- and expert-parallel rank, and each expert's bias moves against its
load, outside autograd.

[Note: the update]
With ``n`` the summed counts of one layer's experts, the bias moves by
``coeff * sign(mean(n) - n)``, centred (the mean of the moves subtracted), so an expert
chosen more than the average becomes less likely to be chosen next step; the bias only
picks experts, the weights of the chosen ones stay the router's scores. Every rank sums
the same counts, so every rank's bias stays the same, as one process's would on the whole
batch. The counts are then zeroed for the next step.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hyper_parallel.platform import get_platform


def update_expert_bias(expert_bias: Any, tokens_per_expert: Any, mesh: Any = None, *,
                       coeff: float = 1e-3) -> None:
    """Move ``expert_bias`` (one value per expert) against ``tokens_per_expert`` (this
    rank's counts since the last update) summed over every dim of ``mesh`` (the data- and
    expert-parallel ranks; None: this rank's counts only), in place; zero the counts."""
    p = get_platform()
    if tuple(p.shape(expert_bias)) != tuple(p.shape(tokens_per_expert)):
        raise ValueError(f"update_expert_bias: expert_bias has shape "
                         f"{tuple(p.shape(expert_bias))} and tokens_per_expert "
                         f"{tuple(p.shape(tokens_per_expert))}; give one count per expert")
    with p.no_grad():
        counts = p.cast(p.clone(tokens_per_expert), p.dtype("float32"))
        for dim in range(mesh.ndim if mesh is not None else 0):
            if mesh.size(dim) > 1:
                p.all_reduce(counts, mesh.get_group(dim), dim=mesh.mesh_dim_names[dim]).wait()
        n = np.asarray(p.to_numpy(counts), dtype=np.float64)
        delta = coeff * np.sign(n.mean() - n)
        delta -= delta.mean()
        bias = np.asarray(p.to_numpy(expert_bias), dtype=np.float64) + delta
        p.copy_into(expert_bias, p.cast(p.from_numpy(bias.astype(np.float32)),
                                        p.dtype_of(expert_bias)))
        p.copy_into(tokens_per_expert, p.zeros(p.shape(tokens_per_expert),
                                               p.dtype_of(tokens_per_expert)))
