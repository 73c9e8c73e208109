"""The layers of hyper_parallel run one way (docs/architecture.md, "Layers"): import-linter's
contracts in .importlinter hold for the package as it is, and a planted import that breaks
one fails with the chain of imports named.

A plant is written into a copy of hyper_parallel/ in a temporary folder, which the linter
reads instead of the real one; each is an import inside a function, which counts as much as
one at the top of a file."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = ROOT / ".importlinter"


def _lint(root: pathlib.Path) -> subprocess.CompletedProcess:
    """lint-imports with the repository's contracts over the hyper_parallel/ under ``root``."""
    env = dict(os.environ, PYTHONPATH=str(root), COLUMNS="300", NO_COLOR="1")
    code = "import sys; from importlinter.cli import lint_imports_command; lint_imports_command()"
    return subprocess.run([sys.executable, "-c", code, "--no-cache", "--no-logo", str(CONFIG)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_the_contracts_hold():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout, result.stdout


LAZY = "\n\ndef _planted():\n    from {imported} import {name}\n    return {name}\n"

# (file the plant goes into, what it imports, the contract's words and the chain it names)
PLANTS = {
    "the platform imports the core": (
        "platform/torch/platform.py", ("hyper_parallel.fully_shard.gather_codec", "GatherCodec"),
        ["hyper_parallel.platform is not allowed to import hyper_parallel.fully_shard",
         "hyper_parallel.platform.torch.platform -> hyper_parallel.fully_shard.gather_codec"]),
    "the core imports an adapter": (
        "fully_shard/param.py", ("hyper_parallel.interop.torch.gather_hooks", "hooks_codec"),
        ["hyper_parallel.fully_shard is not allowed to import hyper_parallel.interop",
         "hyper_parallel.fully_shard.param -> hyper_parallel.interop.torch.gather_hooks"]),
    "the core imports a framework": (
        "fully_shard/policy.py", ("torch", "float32"),
        ["hyper_parallel.fully_shard is not allowed to import torch",
         "hyper_parallel.fully_shard.policy -> torch"]),
    "a circle inside a layer": (
        "fully_shard/unit_state.py", ("hyper_parallel.fully_shard.state", "FSDPState"),
        ["No cycles are allowed in hyper_parallel.fully_shard", ".unit_state -> .state"]),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_planted_import_fails_naming_its_chain(tmp_path, plant):
    target, (imported, name), expected = PLANTS[plant]
    shutil.copytree(ROOT / "hyper_parallel", tmp_path / "hyper_parallel",
                    ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "hyper_parallel" / target, "a") as file:
        file.write(LAZY.format(imported=imported, name=name))
    result = _lint(tmp_path)
    assert result.returncode != 0, result.stdout
    for words in expected:
        assert words in result.stdout, result.stdout


def test_a_new_module_needs_a_layer(tmp_path):
    shutil.copytree(ROOT / "hyper_parallel", tmp_path / "hyper_parallel",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "hyper_parallel" / "newcomer.py").write_text('"""Not placed in any layer."""\n')
    result = _lint(tmp_path)
    assert result.returncode != 0, result.stdout
    assert "hyper_parallel.newcomer" in result.stdout, result.stdout
