"""Parameters all-gathered in a lower precision than they are kept in
(fully_shard/gather_codec.py): FSDP2's all-gather extension on torch, driven by torchao's
float8 and int8 training, and ``hp.CastGather`` on both frameworks.

The scenarios (tests/lowprec_scenarios.py) run in the shared launch of each backend at 2
ranks, and torch's at 4 (HSDP 2 x 2; marked slow: the 2-rank cases cover the codec path,
these add the replicate dim and the shard dim's own mesh for float8's amax).
Bytes are checked against the count made from the parameters' shapes: what each codec
sends per element (float8 and int8: 1 byte, plus int8's float32 row scales; bfloat16: 2;
each rank's part of a codec tensor padded to 8 bytes), float32's 4 for the rest, twice a
step for a block (forward, re-gather before backward), once for the root.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from tests import shared_launch
from tests.lowprec_scenarios import expected_gather_bytes
from tests.tolerance import assert_close

BACKENDS = ["torch", "mindspore"]
TORCH_ONLY = ("torchao_float8", "torchao_float8_precompute", "torchao_float8_bf16",
              "torchao_int8", "bad_hooks")
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


def _names(backend: str) -> list:
    if backend != "torch":
        return ["cast"]
    return ["cast", *(TORCH_ONLY if HAS_TORCHAO else ("bad_hooks",))]


HSDP = ("hsdp_torchao_float8", "hsdp_torchao_float8_bf16", "hsdp_torchao_int8")

shared_launch.register(__name__, "lowprec_2", 2, "tests.lowprec_scenarios:run_all",
                       lambda backend: (_names(backend),), timeout_s=400)
shared_launch.register(__name__, "lowprec_4", 4, "tests.lowprec_scenarios:run_all",
                       lambda backend: (list(HSDP) if HAS_TORCHAO else [],),
                       backends=("torch",), timeout_s=400, slow=True)


def _wire(per_rank_bytes: int, shard_size: int = 2) -> int:
    """A codec tensor's all-gather bytes: each rank's part padded to 8 bytes
    (fully_shard/codec_leg.py)."""
    return shard_size * -(-per_rank_bytes // 8) * 8


def _results(backend: str, name: str) -> list:
    key = "lowprec_4" if name.startswith("hsdp_") else "lowprec_2"
    return [r[name] for r in shared_launch.results(key, backend)]


needs_torchao = pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed (the "
                                   "'test' extra: pip install torchao==0.18.0 --no-deps)")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_cast_gather_halves_the_bytes_and_trains_within_bfloat16(backend):
    """``set_gather_codec(model, CastGather("bfloat16"))``: the matrices travel in bfloat16
    (2 bytes an element, the vectors stay float32), and the losses stay within bfloat16's
    rounding of the full-precision run's."""
    for r in _results(backend, "cast"):
        sizes = r["sizes"]
        assert r["ref_bytes"] == expected_gather_bytes(sizes, lambda n, numel, rows: 4 * numel)
        assert r["bytes"] == expected_gather_bytes(
            sizes, lambda n, numel, rows: _wire(numel) if rows is not None else 4 * numel)
        assert_close(r["losses"], r["ref_losses"], 2e-3)  # bfloat16 weights: ~3 digits
        assert r["losses"] != r["ref_losses"], "the codec changed nothing: was it applied?"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_set_gather_codec_refuses_bad_input_and_changes_nothing(backend):
    """After fully_shard, a codec that is not a GatherCodec, a list instead of a module, a
    predicate that is not callable, a CastGather dtype that is not a float of 16 bits: each
    a named error, and no parameter marked."""
    expected = {"after fully_shard": ("ValueError", "call set_gather_codec before fully_shard"),
                "not a codec": ("TypeError", "must be a hyper_parallel GatherCodec"),
                "not a module": ("TypeError", "set_gather_codec takes a module"),
                "bad predicate": ("TypeError", "predicate must be a function"),
                "bad dtype": ("ValueError", "'bfloat16' or 'float16', got 'int8'")}
    for r in _results(backend, "cast"):
        for case, (kind, words) in expected.items():
            error, message, changed = r["bad_input"][case]
            assert error == kind and words in message, (case, error, message)
            assert not changed, f"{case}: a parameter was marked"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_row_gather_sends_a_quarter_and_trains_within_its_rounding(backend):
    """``hp.Int8RowGather()``: the matrices travel as int8 with one float32 scale per row
    (padded rows included), the vectors as float32; the losses stay within int8 rounding
    (half a step of 1/127 of each row's largest weight) of the full-precision run's."""
    for r in _results(backend, "cast"):
        assert r["int8_bytes"] == expected_gather_bytes(
            r["sizes"], lambda n, numel, rows: _wire(numel // 2) + _wire(4 * rows // 2)
            if rows is not None else 4 * numel)
        assert r["int8_bytes"] < 0.3 * r["ref_bytes"]
        assert_close(r["int8_losses"], r["ref_losses"], 5e-3)
        assert r["int8_losses"] != r["ref_losses"], "the codec changed nothing: was it applied?"


def _float8_bytes(r):
    coded = set(r["coded"])
    return expected_gather_bytes(r["sizes"], lambda n, numel, rows: _wire(numel // 2)
                                 if n in coded else 4 * numel)


@needs_torchao
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["torchao_float8", "torchao_float8_precompute",
                                  pytest.param("hsdp_torchao_float8", marks=pytest.mark.slow)])
def test_torchao_float8_all_gather_matches_fsdp2(case):
    """torchao float8 training (tensorwise dynamic scaling, FSDP2 float8 all-gather on, with
    and without precomputed scales): the weights go over the wire in float8 (a quarter of
    float32's bytes; the scale is computed from an all-reduced amax, not gathered), and
    losses and parameters equal FSDP2's bit for bit (its float8 all-gather off: gloo refuses
    it; the scales are global, so the math is the same). At 2 ranks and HSDP 2 x 2 (the
    amax is all-reduced over the shard dim's mesh)."""
    for r in _results("torch", case):
        assert len(r["coded"]) == 7, r["coded"]  # six block linears and the head
        assert r["bytes"] == _float8_bytes(r)
        np.testing.assert_array_equal(r["losses"], r["their_losses"])
        assert r["param_diff"] == 0.0


@needs_torchao
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["torchao_float8_bf16",
                                  pytest.param("hsdp_torchao_float8_bf16", marks=pytest.mark.slow)])
def test_torchao_float8_with_bfloat16_params(case):
    """The same with ``param_dtype=bfloat16``: torchao's hook casts the float32 shard to
    float8 itself (FSDP2 with float8 all-gather off casts to bfloat16 first), so the run
    agrees with FSDP2's to bfloat16's precision; the bytes are float8's and, for the rest,
    bfloat16's."""
    for r in _results("torch", case):
        coded = set(r["coded"])
        assert r["bytes"] == expected_gather_bytes(
            r["sizes"], lambda n, numel, rows: _wire(numel // 2) if n in coded else 2 * numel)
        assert_close(r["losses"], r["their_losses"], 2e-3)
        assert r["param_diff"] < 0.1


@needs_torchao
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["torchao_int8",
                                  pytest.param("hsdp_torchao_int8", marks=pytest.mark.slow)])
def test_torchao_int8_quantized_training_matches_fsdp2(case):
    """torchao int8 quantized training on the blocks' linears: int8 weights and their
    float32 row scales on the wire, losses and parameters equal to FSDP2's."""
    for r in _results("torch", case):
        coded = set(r["coded"])
        assert len(coded) == 6, coded
        assert r["bytes"] == expected_gather_bytes(
            r["sizes"], lambda n, numel, rows: _wire(numel // 2) + _wire(4 * rows // 2)
            if n in coded else 4 * numel)
        np.testing.assert_array_equal(r["losses"], r["their_losses"])
        assert r["param_diff"] == 0.0


@pytest.mark.timeout(600)
def test_bad_hooks_are_named_at_the_first_all_gather():
    """A subclass with only ``fsdp_pre_all_gather``, one whose pre-hook returns tensors
    without the shard's rows, one whose post-hook returns the wrong shape: each a named
    error at the first forward."""
    for errors in _results("torch", "bad_hooks"):
        assert errors["OnlyPre"].startswith("TypeError") and \
            "defines fsdp_pre_all_gather but not fsdp_post_all_gather" in errors["OnlyPre"]
        assert "'0.weight'" in errors["WrongInputRows"] and \
            "padded rows (4) as dim 0" in errors["WrongInputRows"]
        assert "decoded a full parameter of shape (8, 3)" in errors["WrongFullShape"] and \
            "(8, 8)" in errors["WrongFullShape"]
