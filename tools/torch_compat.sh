#!/usr/bin/env bash
# Runs the demo and the torch half of the suite under one torch release, in a venv of its
# own (.venv-torch-RELEASE, without MindSpore), so that every release pyproject.toml admits
# for torch can be tried: `make torch-compat TORCH=2.14.1`. The venv is kept between runs
# (a CUDA build of torch is several GB); `make clean` removes it.
#
#   tools/torch_compat.sh RELEASE [PYTEST_ARGS...]
set -euo pipefail

release=${1:?usage: tools/torch_compat.sh RELEASE [PYTEST_ARGS...]}
shift
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
venv=.venv-torch-$release
py=$venv/bin/python

test -x "$py" || "$python" -m venv "$venv"
"$py" -m pip install -q "torch==$release"
# The project's own torch extra must admit the release, or pip would replace it here.
"$py" -m pip install -q -e ".[torch,test]"
found=$("$py" -c "import torch; print(torch.__version__.split('+')[0])")
if [ "$found" != "$release" ]; then
    echo "torch-compat: asked for torch $release, the venv holds $found" >&2
    exit 1
fi
echo "torch-compat: torch $found in $venv ($(du -sh "$venv" | cut -f1))"

# The torch half: every case but those named for MindSpore (-k), and those whose torch run
# resumes from a checkpoint a MindSpore launch wrote in the same chain
# (tests/checkpoint_launches.py), which .venv, holding both frameworks, runs. Modules that
# need both frameworks import-skip themselves.
needs_mindspore=(
    test_checkpoint.py::test_resume_on_torch_at_one_rank
    test_checkpoint.py::test_sgd_momentum_resumes_at_one_rank_on_torch
    test_checkpoint.py::test_sgd_momentum_moves_between_the_frameworks
    test_checkpoint.py::test_batchnorm_buffers_resume_on_torch_at_one_rank
    test_checkpoint.py::test_crash_mid_save_leaves_previous_checkpoint
    test_checkpoint.py::test_rank_dying_in_an_async_write_leaves_previous_checkpoint
    test_checkpoint.py::test_bfloat16_stored_as_bf16_bit_for_bit
    test_checkpoint_safety.py::test_bad_checkpoint_is_a_clear_error_and_changes_nothing
)
deselect=()
for name in "${needs_mindspore[@]}"; do
    deselect+=(--deselect "tests/$name")
done

HP_BACKEND=torch "$py" examples/train_mlp.py --nproc 2
HP_BACKEND=torch "$py" -m pytest -q -k "not mindspore" "${deselect[@]}" "$@"
