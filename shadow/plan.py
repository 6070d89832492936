"""The op plan: the one normalized view of an op's calls, read once from its aten schema.

Every rule (replay, budget, reference, emulation) and the engine read arguments through it: by schema
name with defaults (``arg``, ``bind``), rewritten (``replace``), or walked tensor by tensor (``tensors``,
``map_tensors``), so no caller flattens with pytree or indexes a schema of its own.

>>> plan = plan_of(torch.ops.aten.add.Tensor)
>>> plan.bind((torch.ones(1), torch.ones(1)), {})["alpha"], plan.base
(1, 'add')
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, Callable, Iterator

import torch

from . import _compat

aten = torch.ops.aten


class ArgType(enum.Enum):
    TENSOR = "Tensor"  # Tensor or Tensor?
    TENSORS = "Tensor[]"  # Tensor[] (foreach lists)
    OPT_TENSORS = "Tensor?[]"  # Tensor?[] (index, index_put)
    TENSOR_LISTS = "Tensor[][]"  # Tensor[][] (the c10d list collectives: allgather_, reduce_scatter_)
    REMAP = "remap"  # a dtype or device candidate: rewritten for the float64 CPU replay
    NUMBERS = "Scalar[]"  # a list of numbers, one per element of a foreach op's lists (_foreach_div_.ScalarList)


@dataclasses.dataclass(frozen=True, slots=True)
class ArgSpec:
    index: int
    name: str
    type: ArgType
    write: bool
    kwarg_only: bool

    def get(self, args: tuple | list, kwargs: dict) -> Any:
        if not self.kwarg_only and self.index < len(args):
            return args[self.index]
        return kwargs.get(self.name)

    def put(self, args: list, kwargs: dict, value: Any) -> None:
        if not self.kwarg_only and self.index < len(args):
            args[self.index] = value
        else:  # by name, where the call passed it so or left it to its default
            kwargs[self.name] = value


@dataclasses.dataclass(frozen=True, slots=True)
class Param:
    """A schema argument as ``arg`` reads it, read once: the schema's own objects are rebuilt at every access."""

    name: str
    kwarg_only: bool
    has_default: bool
    default: Any  # the schema default (lists are handed out as copies)


@dataclasses.dataclass(frozen=True, slots=True)
class ReturnSpec:
    tensors: bool  # Tensor[] rather than Tensor
    is_tensor: bool
    aliases_write: bool  # returns a written argument (in-place, out=): not a fresh output
    aliases_read: bool  # a view of an argument


# Kernels that mutate arguments their schema does not mark as written (native_batch_norm's running stats).
UNDECLARED_WRITES: dict[torch._ops.OpOverload, tuple[int, ...]] = {
    aten.native_batch_norm.default: (3, 4),
}
if torch.distributed.is_available():  # c10d ops that return only a Work and write their first argument
    for _name in ("allreduce_coalesced_", "allgather_into_tensor_coalesced_", "reduce_scatter_tensor_coalesced_"):
        if hasattr(torch.ops.c10d, _name):
            UNDECLARED_WRITES[getattr(torch.ops.c10d, _name).default] = (0,)
for _name in ("cudnn_batch_norm", "miopen_batch_norm"):
    if hasattr(aten, _name):
        UNDECLARED_WRITES[getattr(aten, _name).default] = (3, 4)
UNDECLARED_WRITES.update(_compat.UNDECLARED_WRITES)  # older torch: rrelu_with_noise's noise (torch 2.4)

_TENSOR_TYPES = {
    "Tensor": ArgType.TENSOR,
    "Optional[Tensor]": ArgType.TENSOR,
    "List[Tensor]": ArgType.TENSORS,
    "List[Optional[Tensor]]": ArgType.OPT_TENSORS,
    "List[List[Tensor]]": ArgType.TENSOR_LISTS,
}
_NUMBER_LISTS = {"List[number]", "List[float]", "List[int]", "List[complex]"}
# dtype arguments are typed int in the schema, devices Device: candidates, checked by value at run time.
_REMAP_TYPES = {"int", "Optional[int]", "Device", "Optional[Device]"}


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class OpPlan:
    func: torch._ops.OpOverload
    call: Callable[..., Any]  # func's own entry (OpOverload._op) for the replays: func adds a Python frame
    name: str  # "aten.addmm.default"
    op_name: str  # the schema name without namespace and overload: "add_" for aten.add_.Tensor
    base: str  # ... without an in-place op's trailing underscore: "add"
    positions: dict[str, int]  # argument name -> position in the schema
    params: tuple[Param, ...]  # the schema's arguments, by position
    tensor_args: tuple[ArgSpec, ...]
    remap_args: tuple[ArgSpec, ...]
    returns: tuple[ReturnSpec, ...]
    tags: frozenset
    writes: tuple[ArgSpec, ...]  # declared and undeclared written tensor arguments
    write_args: frozenset[int]  # the indices of every written argument
    out_args: frozenset[int]  # ... of the out= buffers among them (written, never read)
    declared_writes: frozenset[int]  # the ones that bump the version counter
    is_view: bool  # only returns aliases of its inputs and writes nothing: no value to replay
    fresh_returns: bool  # some return is a new value (not an alias of an argument)
    number_lists: tuple[ArgSpec, ...] = ()  # its lists of numbers (ArgType.NUMBERS)

    # --- reading and rewriting arguments by schema name ---
    def has(self, name: str) -> bool:
        return name in self.positions

    def arg(self, args: tuple | list, kwargs: dict, name: str, default: Any = None) -> Any:
        """The argument ``name`` as passed, else its schema default, else ``default``."""
        i = self.positions.get(name)
        if i is None:
            return default
        a = self.params[i]
        if not a.kwarg_only and i < len(args):
            return args[i]
        if name in kwargs:
            return kwargs[name]
        if not a.has_default:
            return default
        return list(a.default) if isinstance(a.default, list) else a.default

    def bind(self, args: tuple | list, kwargs: dict) -> dict[str, Any]:
        """Every argument by name: as passed, else its schema default, else None."""
        return {a.name: self.arg(args, kwargs, a.name) for a in self.params}

    def replace(self, args: tuple | list, kwargs: dict, /, **new: Any) -> tuple[list, dict]:
        """Copies of (args, kwargs) with the named arguments replaced (added as keywords if not passed)."""
        args, kwargs = list(args), dict(kwargs)
        for name, v in new.items():
            i = self.positions[name]
            if not self.params[i].kwarg_only and i < len(args):
                args[i] = v
            else:
                kwargs[name] = v
        return args, kwargs

    # --- walking tensor arguments ---
    def tensors(self, args: tuple | list, kwargs: dict, specs: tuple[ArgSpec, ...] | None = None
                ) -> Iterator[tuple[ArgSpec, torch.Tensor]]:
        """Every tensor passed in the tensor arguments (``specs``: these only), lists expanded, Nones skipped."""
        for spec in self.tensor_args if specs is None else specs:
            v = spec.get(args, kwargs)
            if isinstance(v, torch.Tensor):
                yield spec, v
            elif isinstance(v, (list, tuple)):
                for t in (_flatten(v) if spec.type is ArgType.TENSOR_LISTS else v):
                    if isinstance(t, torch.Tensor):
                        yield spec, t

    def map_tensors(self, args: tuple | list, kwargs: dict, fn: Callable[[torch.Tensor, ArgSpec], Any],
                    skip: frozenset[int] = frozenset()) -> tuple[list, dict]:
        """Copies of (args, kwargs) with every passed tensor t of the tensor arguments replaced by
        ``fn(t, spec)`` (lists element by element; None kept), except the arguments at ``skip``."""
        args, kwargs = list(args), dict(kwargs)
        for spec in self.tensor_args:
            if spec.index in skip:
                continue
            v = spec.get(args, kwargs)
            if v is None:
                continue
            if spec.type is ArgType.TENSOR:
                if isinstance(v, torch.Tensor):  # else a number where the schema takes a tensor: kept
                    spec.put(args, kwargs, fn(v, spec))
            elif spec.type is ArgType.TENSOR_LISTS:
                spec.put(args, kwargs, [[fn(t, spec) if isinstance(t, torch.Tensor) else t for t in inner]
                                        for inner in v])
            else:
                spec.put(args, kwargs, [fn(t, spec) if isinstance(t, torch.Tensor) else t for t in v])
        return args, kwargs


@functools.cache
def base_name(op_name: str) -> str:
    """An op's name without its in-place mark, as the op sets of ``shadow.opsets`` hold it: "add_" -> "add"."""
    return op_name[:-1] if op_name.endswith("_") and not op_name.endswith("__") else op_name


@functools.cache
def plan_of(func: torch._ops.OpOverload) -> OpPlan:
    """The plan of an op overload (built once)."""
    schema = func._schema
    undeclared = UNDECLARED_WRITES.get(func, ())
    tensor_args, remap_args, number_lists = [], [], []
    for i, a in enumerate(schema.arguments):
        type_name = str(a.type)
        write = bool(a.alias_info is not None and a.alias_info.is_write) or i in undeclared
        arg_type = _TENSOR_TYPES.get(type_name)
        if arg_type is not None:
            tensor_args.append(ArgSpec(i, a.name, arg_type, write, a.kwarg_only))
        elif type_name in _REMAP_TYPES or a.name in ("pin_memory", "half_to_float"):
            remap_args.append(ArgSpec(i, a.name, ArgType.REMAP, False, a.kwarg_only))
        elif type_name in _NUMBER_LISTS:
            number_lists.append(ArgSpec(i, a.name, ArgType.NUMBERS, False, a.kwarg_only))
    returns = []
    for r in schema.returns:
        type_name = str(r.type)
        arg_type = _TENSOR_TYPES.get(type_name)
        alias = r.alias_info
        returns.append(
            ReturnSpec(
                tensors=arg_type in (ArgType.TENSORS, ArgType.TENSOR_LISTS),
                is_tensor=arg_type is not None,
                aliases_write=bool(alias is not None and alias.is_write),
                aliases_read=bool(alias is not None and not alias.is_write),
            )
        )
    tensor_args = tuple(tensor_args)
    returns = tuple(returns)
    writes = tuple(a for a in tensor_args if a.write)
    op_name = schema.name.split("::")[-1]
    return OpPlan(
        func=func,
        call=getattr(func, "_op", func),
        name=f"{func.namespace}.{op_name}.{func._overloadname}",
        op_name=op_name,
        base=base_name(op_name),
        positions={a.name: i for i, a in enumerate(schema.arguments)},
        params=tuple(Param(a.name, a.kwarg_only, a.has_default_value(),
                           a.default_value if a.has_default_value() else None) for a in schema.arguments),
        tensor_args=tensor_args,
        remap_args=tuple(remap_args),
        returns=returns,
        tags=frozenset(func.tags),
        writes=writes,
        write_args=frozenset(a.index for a in writes),
        out_args=frozenset(a.index for a in writes if schema.arguments[a.index].is_out),
        declared_writes=frozenset(a.index for a in writes if a.index not in undeclared),
        is_view=any(r.is_tensor for r in returns) and all(r.aliases_read for r in returns if r.is_tensor)
        and not writes,
        fresh_returns=any(not (r.aliases_write or r.aliases_read) for r in returns),
        number_lists=tuple(number_lists),
    )


def flat_returns(plan: OpPlan, out: Any) -> list[tuple[ReturnSpec, Any]]:
    """The op's returned values, one per tensor (lists expanded), each with its return spec."""
    if not plan.returns:
        return []
    if len(plan.returns) == 1 and not plan.returns[0].tensors:  # one value: most ops
        return [(plan.returns[0], out)]
    values = (out,) if len(plan.returns) == 1 else tuple(out)
    flat = []
    for spec, v in zip(plan.returns, values):
        if spec.tensors:
            flat.extend((spec, t) for t in _flatten(v))
        else:
            flat.append((spec, v))
    return flat


def _flatten(v: Any) -> list:
    """A Tensor[] or Tensor[][] value as one list."""
    return [t for inner in v for t in inner] if v and isinstance(v[0], (list, tuple)) else list(v)
