"""The differences between the torch versions shadow supports (2.4.1, which torch-directml pins, to 2.13).

Every version-dependent line of shadow lives here, each with the versions it tells apart, so that the
rest of the code reads as if there were one torch. Tests that cannot run on an older torch skip with
a reason computed from what is missing (``hasattr(aten, "_safe_softmax")``), not from version numbers.

>>> dispatch_key_for_device("privateuseone")
'PrivateUse1'
"""

from __future__ import annotations

import copy
import functools
import sys
from typing import Any, Callable

import torch

# Device types whose dispatch key is not their name capitalized (torch < 2.1 had no
# torch._C._dispatch_key_for_device; 2.4.1 and 2.13 both have it: this is only its fallback).
_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA", "mps": "MPS", "xpu": "XPU", "privateuseone": "PrivateUse1",
                  "meta": "Meta", "hpu": "HPU", "mtia": "MTIA", "lazy": "Lazy", "xla": "XLA"}


def dispatch_key_for_device(device_type: str) -> str:
    """The backend dispatch key of a device type: "cuda" -> "CUDA", "privateuseone" (or the name it was
    renamed to with ``torch.utils.rename_privateuse1_backend``) -> "PrivateUse1"."""
    fn = getattr(torch._C, "_dispatch_key_for_device", None)
    if fn is not None:
        try:
            return fn(device_type)
        except RuntimeError:  # a device type this torch does not know
            pass
    if device_type == torch._C._get_privateuse1_backend_name():
        return "PrivateUse1"
    return _DISPATCH_KEYS.get(device_type, device_type.upper())


def xpu_compiled() -> bool:
    """Whether this torch was built with XPU (Intel GPU) support. torch.xpu exists from 2.4 on; ``_is_compiled``
    is its only way to ask that does not initialize the device."""
    xpu = getattr(torch, "xpu", None)
    return xpu is not None and bool(getattr(xpu, "_is_compiled", lambda: False)())


# --- schemas: kernels that write arguments their schema does not mark as written ---
def _undeclared_writes() -> dict:
    """Written-but-undeclared arguments of older schemas, by op: torch 2.4 declares rrelu_with_noise's
    ``noise`` (the random slopes it fills in training) as a plain ``Tensor``; 2.5 made it ``Tensor(b!)``."""
    found = {}
    op = getattr(torch.ops.aten, "rrelu_with_noise", None)
    if op is not None:
        noise = op.default._schema.arguments[1]
        if noise.name == "noise" and (noise.alias_info is None or not noise.alias_info.is_write):
            found[op.default] = (1,)
    return found


UNDECLARED_WRITES = _undeclared_writes()


# --- torch.compile under a dispatch mode ---
@functools.cache
def compile_skips_dispatch_modes() -> bool:
    """Whether dynamo skips frames while a dispatch mode is active, so a compiled module runs eagerly under
    shadow (recent torch: 2.13's convert_frame asks ``any_torch_dispatch_mode_on_stack``). torch 2.4 runs the
    compiled code: its fused kernels write outputs without dispatching, so shadow never sees them."""
    import torch._dynamo.convert_frame as convert_frame  # only asked once a compiled module ran: dynamo is loaded

    return any(hasattr(convert_frame, name) for name in (
        "any_torch_dispatch_mode_on_stack", "is_in_any_mode_without_ignore_compile_internals",
        "is_in_torch_dispatch_mode"))


# --- torch.compile: each compiled graph's call shown to ShadowMode, with its aten graph (shadow.compiled.hooks) ---
def compiled_graph_operator():
    """The higher-order operator Inductor runs a compiled graph through under a dispatch mode, when
    ``torch._inductor.config.wrap_inductor_compiled_regions`` was set at its compile (torch 2.13; it carries the
    aten graph Inductor lowered); None where this torch has none (2.4)."""
    try:
        from torch._higher_order_ops.wrap import inductor_compiled_code
    except ImportError:
        return None
    return inductor_compiled_code


def show_compiled_graphs(wrap: Callable[[Any, Any], Any], load: bool) -> Callable[[], None] | None:
    """Make the graphs Inductor compiles from now on visible to ShadowMode: torch 2.13 sets Inductor's
    ``wrap_inductor_compiled_regions``; torch 2.4 wraps ``compile_fx`` so that each graph ``compile_fx_inner``
    compiles comes back as ``wrap(compiled, aten graph)`` (the graph copied before Inductor's passes rewrite it).
    Returns the undo, or None where Inductor's config is not loaded and ``load`` is False (``torch.compile`` with
    Inductor loads it: nothing compiles with Inductor yet)."""
    if not load and "torch._inductor.config" not in sys.modules:
        return None
    if compiled_graph_operator() is not None:
        import torch._inductor.config as config

        saved = config.wrap_inductor_compiled_regions
        config.wrap_inductor_compiled_regions = True
        return lambda: setattr(config, "wrap_inductor_compiled_regions", saved)
    import torch._inductor.compile_fx as compile_fx

    original = compile_fx.compile_fx
    depth = [0]  # compile_fx calls itself (config patches, cpp wrapper): only the outermost call wraps

    def inner(inner_compile: Callable[..., Any]) -> Callable[..., Any]:
        def compile_inner(gm: torch.fx.GraphModule, example_inputs: Any, *args: Any, **kwargs: Any) -> Any:
            source = copy.deepcopy(gm)  # the post-grad passes rewrite gm in place
            return wrap(inner_compile(gm, example_inputs, *args, **kwargs), source)
        return compile_inner

    @functools.wraps(original)
    def compile_fx_shown(model_: Any, example_inputs_: Any, inner_compile: Any = None, **kwargs: Any) -> Any:
        depth[0] += 1
        try:
            if inner_compile is None:
                inner_compile = compile_fx.compile_fx_inner
            if depth[0] == 1:
                inner_compile = inner(inner_compile)
            return original(model_, example_inputs_, inner_compile=inner_compile, **kwargs)
        finally:
            depth[0] -= 1

    compile_fx.compile_fx = compile_fx_shown
    return lambda: setattr(compile_fx, "compile_fx", original)


def show_cpp_kernels(sink: Callable[[torch.fx.GraphModule, str, list], None]) -> Callable[[], None] | None:
    """torch 2.13: until the returned undo, every C++ kernel Inductor generates is shown to ``sink(graph, name,
    arguments)`` as its call is written: the post-grad graph Inductor lowers (``V.graph.module``, whose node names
    the ``inductor_compiled_code`` operator's graph keeps), the kernel's name, and per C++ argument in order the
    (read, written) node names of the values it holds before and after the call (None: none; the whole list None
    where a buffer is no node's value). Inductor's FX graph and AOTAutograd caches are off meanwhile: a cached graph
    generates no code (the code they would return is the code generated again). None on torch 2.4: shadow's graph
    there is AOTAutograd's, copied before Inductor's post-grad passes rename and replace its nodes."""
    if compiled_graph_operator() is None:
        return None
    import torch._functorch.config as functorch_config
    import torch._inductor.config as config
    from torch._inductor.codegen import cpp
    from torch._inductor.virtualized import V

    original = cpp.KernelGroup.call_kernel

    def call_kernel(group: Any, wrapper: Any, kernel_name: str) -> Any:
        try:
            sink(V.graph.module, kernel_name, _cpp_kernel_arguments(group.args, V.graph))
        except Exception:  # what shadow cannot read of a kernel must not stop the compile: it is not judged alone
            pass
        return original(group, wrapper, kernel_name)

    saved = config.fx_graph_cache, functorch_config.enable_autograd_cache
    cpp.KernelGroup.call_kernel = call_kernel
    config.fx_graph_cache = functorch_config.enable_autograd_cache = False

    def undo() -> None:
        cpp.KernelGroup.call_kernel = original
        config.fx_graph_cache, functorch_config.enable_autograd_cache = saved
    return undo


def _cpp_kernel_arguments(args: Any, graph: Any) -> list | None:
    """A C++ kernel's arguments in the order ``KernelArgs.cpp_argdefs`` writes them (in-place buffers, inputs,
    outputs; sizes last): (read, written) node names. A buffer written that is no node's value (a Welford
    reduction's partial statistics) is written as None (not compared); the whole list is None where a buffer read
    from outside the kernel is no node's value, a buffer is written into another's memory, or sizes are passed."""
    from torch._inductor.ir import NonOwningLayout

    if args.sizevars:
        return None

    def node(name: str) -> str | None:
        if name in graph.graph_inputs:
            return name
        origin = getattr(graph.get_buffer(name), "origin_node", None)
        return origin.name if origin is not None else None

    inplace = {id(v): v for v in args.inplace_buffers.values() if hasattr(v, "other_names")}
    # an in-place buffer the kernel wrote first itself (a reduction's partial result, then its final one) reads
    # nothing from outside it
    reads = [b.other_names[0] not in args.output_buffers for b in inplace.values()]
    found = [(node(b.other_names[0]) if read else False, node(b.other_names[-1]))
             for b, read in zip(inplace.values(), reads)]
    found += [(node(n), None) for n in args.input_buffers if n not in args.inplace_buffers]
    written = [n for n in args.output_buffers if n not in graph.graph_inputs]
    # a buffer written into another's memory (a slice of a cat's output, which the kernel may read back whole)
    if any(read is None for read, _ in found) or \
            any(isinstance(graph.get_buffer(n).get_layout(), NonOwningLayout) for n in written):
        return None
    found = [(read or None, written) for read, written in found]
    return found + [(None, node(n)) for n, inner in args.output_buffers.items()
                    if n not in args.inplace_buffers and isinstance(inner, str)]


def drop_compiled_code(module: torch.nn.Module) -> None:
    """Drop the code dynamo compiled for a ``torch.compile(model)`` module, so that its next call compiles again:
    the entries of the model's ``forward`` (the frame dynamo compiles, torch 2.4 to 2.13) and of the function the
    module's ``forward`` wraps (``wrap_inline``'s, or the model's ``__call__``). Both torch versions keep the
    cache per code object (``reset_code``) and the wrapped function as ``innermost_fn``."""
    from torch._dynamo.eval_frame import innermost_fn

    for fn in (innermost_fn(module.forward), getattr(module, "_orig_mod", module).forward):
        fn = getattr(fn, "__func__", fn)
        code = getattr(fn, "__code__", None)
        if code is not None:
            torch._C._dynamo.eval_frame.reset_code(code)


# --- nested tensors ---
@functools.cache
def nested_views_of_larger_buffers() -> bool:
    """Whether ``torch._nested_view_from_buffer`` views a buffer whose storage holds more than the components
    (2.13 does; 2.4.1 asserts that the two sizes are equal)."""
    try:
        torch._nested_view_from_buffer(torch.zeros(2), torch.tensor([[1]]), torch.tensor([[1]]), torch.tensor([0]))
    except RuntimeError:
        return False
    return True
