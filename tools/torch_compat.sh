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

# The torch half: every case but those named for MindSpore (-k); cases that need MindSpore
# without the name (the checkpoint chain that crosses to it, the framework choice of a
# process that imported both) skip themselves where it is not installed.
HP_BACKEND=torch "$py" examples/train_mlp.py --nproc 2
HP_BACKEND=torch "$py" -m pytest -q -k "not mindspore" "$@"
