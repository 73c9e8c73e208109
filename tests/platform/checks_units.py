"""Conformance checks of the platform contract: how the framework's own code sees a unit
(``unit_bases``, ``present_unit``, ``native_unit_api``).

The harness (context, registry, assertion helpers) is conformance.py."""

from __future__ import annotations

import hyper_parallel as hp
from tests.platform.conformance import _check, local_check


@local_check
def check_unit_bases_and_present_unit(ctx):
    p = ctx.p
    bases = p.unit_bases()
    _check(isinstance(bases, tuple) and all(isinstance(b, type) for b in bases),
           f"unit_bases must be a tuple of classes, got {bases!r}")
    model = ctx.side.model()
    probe = type("FSDPProbe", (hp.FSDPModule, type(model), *bases), {})
    # FSDP2's FSDPModule.__new__ reads the original class at __mro__[2]
    _check(probe.__mro__[1:3] == (hp.FSDPModule, type(model)),
           f"with unit_bases {bases} a unit's class resolves {probe.__mro__[:4]}; hyper_parallel's "
           f"FSDPModule and the module's own class must come first")
    _check(p.native_unit_api(model) is None and p.native_unit_api(model.fc1) is None,
           "native_unit_api of a module nothing sharded must be None")
    _check(all(issubclass(probe, base) for base in bases),
           "a unit's class is not a subclass of every unit base")
    calls, before = [], [(name, p.direct_params(m)) for name, m in p.named_modules(model)]
    p.present_unit(model, lambda: calls.append("reduce"))
    _check(calls == [], "present_unit must only keep reduce_accumulated, not call it")
    _check([(name, p.direct_params(m)) for name, m in p.named_modules(model)] == before,
           "present_unit changed the module's submodules or parameters")
