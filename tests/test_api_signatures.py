"""Every signature docs/api.md writes is the code's (tests/api_signatures.py): parameter
names, order, kinds (``*``) and defaults, in a process of each framework, as
``hp.parallelize_module`` and the tensor-parallel styles are each framework's own."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.multirank import REPO_ROOT

_REPORT = ("import json; from tests.api_signatures import documented, mismatches; "
           "print(json.dumps([len(documented()), mismatches()]))")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_documented_signatures_are_the_codes(backend):
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    done = subprocess.run([sys.executable, "-c", _REPORT], cwd=REPO_ROOT,
                          env={**os.environ, "HP_BACKEND": backend}, capture_output=True,
                          text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    count, mismatches = json.loads(done.stdout.strip().splitlines()[-1])
    assert count >= 25, f"only {count} signatures found in docs/api.md: is the page's layout new?"
    assert not mismatches, "docs/api.md differs from the code:\n" + "\n".join(
        f"## {heading}: {statement}\n    {problem}" for heading, statement, problem in mismatches)


def test_a_wrong_signature_is_found(monkeypatch, tmp_path):
    """The comparison itself: a parameter left out, a default changed, ``*`` dropped and an
    argument that does not bind are each reported."""
    from tests import api_signatures

    page = tmp_path / "api.md"
    page.write_text("## a\n\n```python\n"
                    "hp.load_checkpoint(path, model, optimizer=None, key_map=None) -> extra\n"
                    "hp.init_distributed(timeout_s=300, debug_collectives=None)\n"
                    "hp.init_device_mesh(device_type, mesh_shape, mesh_dim_names=None)\n"
                    "norm = hp.clip_grad_norm_(parameters, max_norm, grad=grads)\n"
                    "hp.torch_nn_names(name)\n```\n", encoding="utf-8")
    monkeypatch.setattr(api_signatures, "API_MD", page)
    found = {statement.split("(")[0].split(" ")[-1]: problem
             for _, statement, problem in api_signatures.mismatches()}
    assert sorted(found) == ["hp.clip_grad_norm_", "hp.init_device_mesh",
                             "hp.init_distributed", "hp.load_checkpoint"], found
    assert "verify=True" in found["hp.load_checkpoint"]
    assert "timeout_s's default is written 300" in found["hp.init_distributed"]
    assert "do not bind" in found["hp.clip_grad_norm_"]
