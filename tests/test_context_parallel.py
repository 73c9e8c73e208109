"""Context parallelism (hp.context_parallel, hp.scaled_dot_product_attention) on both
frameworks, against one process on the same data.

The shared 2-rank launch per backend (tests/context_parallel_scenarios.py) runs:

- attention at cp2, forward and backward, ring and all-to-all, causal and without a mask:
  each rank's output and gradients of its queries, keys and values, put back at their
  sequence positions, equal the one-process attention's (torch: its own
  ``scaled_dot_product_attention``, here reached through the context's routing; MindSpore:
  a softmax of MindSpore ops) to ``FP32_RTOL``; every buffer is whole again after;
- the example's language model (examples/lm, tiny) at cp2 under ``hp.fully_shard`` over
  the joined (dp, cp) dims, with ``hp.clip_grad_norm_``, 5 AdamW steps inside the context
  (ids, targets and rotary tables as buffers): the mean of the ranks' losses equals the
  one-process loss on the whole batch to ``FP32_RTOL`` at every step, the parameters after
  the last step to ``ADAMW_RTOL``;
- what the context refuses inside a rank, and attention computed by hand.

Under ``-m slow``: the attention at cp4 (4 ranks); the same training with all-to-all
attention at cp2, at dp2 x cp2 on 4 ranks with both strategies, in fully_shard's mixed
precision at cp2, on torch with the attention recomputed in backward; and the reproducer
of torch's own ``context_parallel`` failing on CPU. Bad arguments of ``context_parallel``
fail before anything changes, here in the test process on a mesh without groups.
"""

from __future__ import annotations

import numpy as np
import pytest

import hyper_parallel as hp
from tests import shared_launch
from tests.tolerance import ADAMW_RTOL, FP32_RTOL, LOW_PRECISION_RTOL, assert_close

BACKENDS = ["torch", "mindspore"]
ATTENTION_CASES = [f"{s}-{m}" for s in ("ring", "all_to_all") for m in ("full", "causal")]
TARGET = "tests.context_parallel_scenarios:"
#: the parameter dtype of the mixed-precision case (MindSpore CPU has no bfloat16 matmul)
LOW = {"torch": "bfloat16", "mindspore": "float16"}

shared_launch.register(__name__, "cp_attention", 2, TARGET + "attention",
                       lambda backend: (backend,), timeout_s=120)
shared_launch.register(__name__, "cp_attention_cp4", 4, TARGET + "attention",
                       lambda backend: (backend,), timeout_s=300, slow=True)
shared_launch.register(__name__, "cp_training", 2, TARGET + "training",
                       lambda backend: (backend, 1, ("ring",)), timeout_s=240)
shared_launch.register(__name__, "cp_bad_attention", 2, TARGET + "bad_attention",
                       lambda backend: (backend,), timeout_s=120)
shared_launch.register(__name__, "cp_training_all_to_all", 2, TARGET + "training",
                       lambda backend: (backend, 1, ("all_to_all",)), timeout_s=240, slow=True)
shared_launch.register(__name__, "cp_training_low_precision", 2, TARGET + "training",
                       lambda backend: (backend, 1, ("ring",), LOW[backend]), timeout_s=240,
                       slow=True)
shared_launch.register(__name__, "cp_training_recompute", 2, TARGET + "training",
                       lambda backend: (backend, 1, ("ring",), None, True),
                       backends=("torch",), timeout_s=240, slow=True)
shared_launch.register(__name__, "cp_torch_own", 2, TARGET + "torch_own_context_parallel",
                       lambda backend: (backend,), backends=("torch",), timeout_s=60, slow=True)
shared_launch.register(__name__, "cp_training_dp2_cp2", 4, TARGET + "training",
                       lambda backend: (backend, 2, ("ring", "all_to_all")), timeout_s=900,
                       slow=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ATTENTION_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_at_cp2_equals_one_process(backend, case):
    _check_attention(shared_launch.results("cp_attention", backend), case)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ATTENTION_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_at_cp4_equals_one_process(backend, case):
    """Four ranks: eight chunks, three ring steps, every causal chunk pair kind on each."""
    _check_attention(shared_launch.results("cp_attention_cp4", backend), case)


def _check_attention(per_rank: list, case: str) -> None:
    reference = per_rank[0]["cases"][case]["reference"]
    for i, what in enumerate(("output", "query gradient", "key gradient", "value gradient")):
        whole = np.full_like(reference[i], np.nan)
        for result in per_rank:
            whole[:, :, result["positions"]] = result["cases"][case]["local"][i]
        assert not np.isnan(whole).any(), f"{what}: positions no rank holds"
        assert_close(whole, reference[i], FP32_RTOL, err_msg=f"{case}: {what}")
    for rank, result in enumerate(per_rank):
        assert result["cases"][case]["restored"], f"rank {rank}: a buffer was not restored"


def _check_training(per_rank: list, strategy: str) -> None:
    reference = per_rank[0]["reference"]
    losses = np.mean([result[strategy]["losses"] for result in per_rank], 0)
    assert_close(losses, reference["losses"], FP32_RTOL, err_msg=f"{strategy}: losses")
    params = per_rank[0][strategy]["params"]
    assert params.keys() == reference["params"].keys()
    for name, value in reference["params"].items():
        assert_close(params[name], value, ADAMW_RTOL, err_msg=f"{strategy}: {name}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_lm_trained_at_cp2_equals_one_process(backend):
    _check_training(shared_launch.results("cp_training", backend), "ring")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_lm_trained_at_cp2_all_to_all_equals_one_process(backend):
    _check_training(shared_launch.results("cp_training_all_to_all", backend), "all_to_all")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_lm_trained_at_cp2_in_mixed_precision(backend):
    """fully_shard's mixed precision (bfloat16 on torch, float16 on MindSpore, gradients
    reduced in float32) at cp2: the losses within the low precision's own tolerance of the
    float32 one-process run, and not equal to it (the policy applied)."""
    per_rank = shared_launch.results("cp_training_low_precision", backend)
    reference = per_rank[0]["reference"]["losses"]
    losses = np.mean([result["ring"]["losses"] for result in per_rank], 0)
    assert_close(losses, reference, LOW_PRECISION_RTOL[LOW[backend]])
    assert not np.allclose(losses, reference, rtol=1e-7, atol=0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lm_trained_at_cp2_with_recomputed_attention():
    """torch: the attention recomputed in backward (non-reentrant checkpoint), backward
    inside the context: the ring runs again, and the training is one process's."""
    _check_training(shared_launch.results("cp_training_recompute", "torch"), "ring")


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("strategy", ["ring", "all_to_all"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_lm_trained_at_dp2_cp2_equals_one_process(backend, strategy):
    """fully_shard over the joined (dp, cp) dims of a 2x2 mesh: gradients averaged over the
    four ranks as one process would, each dp pair on its own rows of the batch."""
    _check_training(shared_launch.results("cp_training_dp2_cp2", backend), strategy)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_the_context_refuses(backend):
    """Refused inside a rank, each with the buffers whole again after: a sequence that
    reached the attention unsplit, an attn_mask, heads all-to-all cannot split."""
    result = shared_launch.results("cp_bad_attention", backend)[0]
    for case, words in (("unsplit", "attention over 16 positions"),
                        ("attn_mask", "attn_mask"),):
        assert result[case]["error"] is not None and words in result[case]["error"], case
        assert result[case]["restored"], case
    assert "3 heads over 2 context-parallel ranks" in result["heads"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_by_hand_under_the_context(backend):
    """A model whose attention never goes through scaled_dot_product_attention: the context
    raises when it closes. One that routes some attention and computes other attention by
    hand is not detected: the hand-written attention attends to the local keys only, and
    its rows differ from the whole sequence's (the condition docs/context-parallel.md
    names)."""
    result = shared_launch.results("cp_bad_attention", backend)[0]
    assert "no attention went through scaled_dot_product_attention" in result["by_hand"]["error"]
    assert result["by_hand"]["restored"]
    mixed = result["mixed"]
    expected = mixed["reference"][:, :, mixed["positions"]]
    assert_close(mixed["routed"], expected, FP32_RTOL)
    assert np.abs(mixed["by_hand"] - expected).max() > 0.1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torch_own_context_parallel_on_cpu():
    """The reproducer of docs/context-parallel.md's limit: torch 2.13's own context_parallel
    has no rule for the attention kernel torch runs on CPU."""
    error = shared_launch.results("cp_torch_own", "torch")[0]
    assert error is not None and "_scaled_dot_product_flash_attention_for_cpu" in error, error


# ---------------------------------------------------------------- bad arguments
def _bad_cases(p):
    rng = np.random.default_rng(0)
    ids = p.from_numpy(rng.integers(0, 9, (2, 16)))
    table = p.from_numpy(rng.standard_normal((12, 4)).astype(np.float32))
    odd = p.from_numpy(rng.integers(0, 9, (2, 10)))
    other = p.from_numpy(rng.integers(0, 9, (2, 16)))
    return {
        "a sequence the split cannot divide": (dict(buffers=[odd], buffer_seq_dims=[1]),
                                               "must be a multiple of 4"),
        "a buffer whose sequence dim does not match": (
            dict(buffers=[ids, table], buffer_seq_dims=[1, 0]), "every buffer holds the same"),
        "fewer seq dims than buffers": (dict(buffers=[ids, table], buffer_seq_dims=[1]),
                                        "one sequence dim per buffer"),
        "a seq dim the buffer lacks": (dict(buffers=[ids], buffer_seq_dims=[2]),
                                       r"is not a dim of buffers\[0\]"),
        "no_restore_buffers outside buffers": (
            dict(buffers=[ids], buffer_seq_dims=[1], no_restore_buffers=[other]), "subset"),
        "an unknown strategy": (dict(buffers=[ids], buffer_seq_dims=[1], strategy="tree"),
                                "strategy"),
    }, [ids, table, odd, other]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments_fail_before_anything_changes(backend, monkeypatch):
    monkeypatch.setenv("HP_BACKEND", backend)
    p = hp.get_platform()
    mesh = hp.DeviceMesh("cpu", (2,), ("cp",), [None])  # no groups: no collective
    cases, tensors = _bad_cases(p)
    before = [p.to_numpy(t).copy() for t in tensors]
    for what, (kwargs, words) in cases.items():
        with pytest.raises(ValueError, match=words):
            with hp.context_parallel(mesh, **kwargs):
                raise AssertionError(f"{what}: the context opened")
        for tensor, values in zip(tensors, before):
            np.testing.assert_array_equal(p.to_numpy(tensor), values, err_msg=what)
    two_d = hp.DeviceMesh("cpu", (1, 2), ("dp", "cp"), [None, None])
    with pytest.raises(ValueError, match=r"mesh\['cp'\]"):
        with hp.context_parallel(two_d, buffers=[tensors[0]], buffer_seq_dims=[1]):
            pass
    one = hp.DeviceMesh("cpu", (1,), ("cp",), [None])  # one rank: no group needed
    with pytest.raises(RuntimeError, match="already open"):
        with hp.context_parallel(one, buffers=[tensors[0]], buffer_seq_dims=[1]):
            with hp.context_parallel(one):
                raise AssertionError("a second context opened inside the first")
    np.testing.assert_array_equal(p.to_numpy(tensors[0]), before[0])
