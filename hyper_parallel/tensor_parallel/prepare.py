"""``PrepareModuleInput``, ``PrepareModuleOutput``, ``PrepareModuleInputOutput``: a module's
inputs or outputs moved from one layout to another, with torch's arguments and checks.

A plain tensor is taken to be in its ``*_layouts`` entry (a ``LayoutTensor`` keeps its
own placement), moved to the ``desired_*`` one, and returned as a ``LayoutTensor`` unless
``use_local_output`` (redistribute.py has the gradients of each move). ``None`` entries
leave their value alone.
"""

from __future__ import annotations

from hyper_parallel.platform import get_platform
from hyper_parallel.tensor_parallel.layout import LayoutTensor, mark_local
from hyper_parallel.tensor_parallel.placement import Placement, check_placement
from hyper_parallel.tensor_parallel.redistribute import check_movable
from hyper_parallel.tensor_parallel.style import ParallelStyle, prepared, style_on


def _as_tuple(layouts):
    return (layouts,) if isinstance(layouts, Placement) else layouts


def _checked(layouts, what: str):
    for layout in layouts or ():
        check_placement(layout, what, allow_none=True)
    return layouts


def _prepared_value(value, layout, desired, mesh, use_local_output, style):
    """``value`` moved as ``style`` (a style at work, ``style_on``) moves it."""
    if layout is None:
        return value
    if not (isinstance(value, LayoutTensor) or get_platform().is_tensor(value)):
        raise TypeError(f"expecting a tensor or a LayoutTensor for layout {layout}; got "
                        f"{type(value).__name__}")
    local = prepared(value, layout, desired, mesh, result_grads_whole=use_local_output,
                     consumer=style)
    placement = desired if desired is not None else \
        (value.placement if isinstance(value, LayoutTensor) else layout)
    if use_local_output:
        return mark_local(local, placement, mesh, style)
    return LayoutTensor(local, placement, mesh)


def _no_output_change(mod, args, kwargs, output):
    return None


class PrepareModuleInput(ParallelStyle):
    """Move a module's inputs to the layouts its forward needs."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None,
                 input_kwarg_layouts=None, desired_input_kwarg_layouts=None,
                 use_local_output=False):
        self.input_layouts = _checked(_as_tuple(input_layouts), "input_layouts")
        self.desired_input_layouts = _checked(_as_tuple(desired_input_layouts),
                                              "desired_input_layouts")
        self.use_local_output = use_local_output
        if self.input_layouts is not None:
            if self.desired_input_layouts is None:
                raise ValueError("PrepareModuleInput: desired_input_layouts must be given "
                                 "with input_layouts")
            if len(self.input_layouts) != len(self.desired_input_layouts):
                raise ValueError("PrepareModuleInput: input_layouts and desired_input_layouts "
                                 "should have the same length")
        self.with_kwargs = input_kwarg_layouts is not None
        self.input_kwarg_layouts = dict(input_kwarg_layouts or {})
        self.desired_input_kwarg_layouts = dict(desired_input_kwarg_layouts or {})
        if self.with_kwargs and len(self.input_kwarg_layouts) != len(
                self.desired_input_kwarg_layouts):
            raise ValueError("PrepareModuleInput: input_kwarg_layouts and "
                             "desired_input_kwarg_layouts should have the same length")
        _checked(tuple(self.input_kwarg_layouts.values()), "input_kwarg_layouts")
        _checked(tuple(self.desired_input_kwarg_layouts.values()), "desired_input_kwarg_layouts")
        for given, desired in zip(self.input_layouts or (), self.desired_input_layouts or ()):
            if given is not None and desired is not None:
                check_movable(given, desired)

    def prepare_inputs(self, args, kwargs, mesh, module):
        where = style_on(self, module)
        if self.input_layouts is not None:
            if len(args) != len(self.input_layouts):
                raise ValueError(f"module inputs and input_layouts should have the same length: "
                                 f"{len(args)} inputs, {len(self.input_layouts)} layouts")
            args = tuple(_prepared_value(value, layout, desired, mesh, self.use_local_output,
                                         where)
                         for value, layout, desired
                         in zip(args, self.input_layouts, self.desired_input_layouts))
        if self.with_kwargs:
            kwargs = {key: _prepared_value(value, self.input_kwarg_layouts.get(key),
                                           self.desired_input_kwarg_layouts.get(key), mesh,
                                           self.use_local_output, where)
                      for key, value in kwargs.items()}
        return tuple(args), kwargs

    def apply(self, module, mesh):
        get_platform().register_forward_hooks(
            module, lambda mod, args, kwargs: self.prepare_inputs(args, kwargs, mesh, mod),
            _no_output_change)
        return module

    def __repr__(self) -> str:
        return (f"PrepareModuleInput(input_layouts={self.input_layouts}, desired_input_layouts="
                f"{self.desired_input_layouts}, input_kwarg_layouts={self.input_kwarg_layouts}, "
                f"desired_input_kwarg_layouts={self.desired_input_kwarg_layouts}, "
                f"use_local_output={self.use_local_output})")


class PrepareModuleOutput(ParallelStyle):
    """Move a module's outputs to the layouts the next computation needs."""

    def __init__(self, *, output_layouts, desired_output_layouts, use_local_output=True):
        self.output_layouts = _checked(_as_tuple(output_layouts), "output_layouts")
        self.desired_output_layouts = _checked(_as_tuple(desired_output_layouts),
                                               "desired_output_layouts")
        self.use_local_output = use_local_output
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise ValueError("PrepareModuleOutput: output_layouts and desired_output_layouts "
                             "should have the same length")
        for given, desired in zip(self.output_layouts, self.desired_output_layouts):
            if given is not None and desired is not None:
                check_movable(given, desired)

    def prepare_outputs(self, outputs, mesh, module):
        where = style_on(self, module)
        single = not isinstance(outputs, tuple)
        outputs = (outputs,) if single else outputs
        if len(outputs) != len(self.output_layouts):
            raise ValueError(f"module outputs and output_layouts should have the same length: "
                             f"{len(outputs)} outputs, {len(self.output_layouts)} layouts")
        prepared_outputs = tuple(
            _prepared_value(value, layout, desired, mesh, self.use_local_output, where)
            for value, layout, desired
            in zip(outputs, self.output_layouts, self.desired_output_layouts))
        return prepared_outputs[0] if len(prepared_outputs) == 1 else prepared_outputs

    def apply(self, module, mesh):
        get_platform().register_forward_hooks(
            module, lambda mod, args, kwargs: None,
            lambda mod, args, kwargs, output: self.prepare_outputs(output, mesh, mod))
        return module

    def __repr__(self) -> str:
        return (f"PrepareModuleOutput(output_layouts={self.output_layouts}, "
                f"desired_output_layouts={self.desired_output_layouts}, "
                f"use_local_output={self.use_local_output})")


class PrepareModuleInputOutput(ParallelStyle):
    """``PrepareModuleInput`` and ``PrepareModuleOutput`` on one module."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None,
                 input_kwarg_layouts=None, desired_input_kwarg_layouts=None,
                 use_local_input=False, output_layouts, desired_output_layouts,
                 use_local_output=True):
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input)
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output)

    def apply(self, module, mesh):
        self.prepare_module_input.apply(module, mesh)
        self.prepare_module_output.apply(module, mesh)
        return module

    def __repr__(self) -> str:
        return (f"PrepareModuleInputOutput({self.prepare_module_input!r}, "
                f"{self.prepare_module_output!r})")
