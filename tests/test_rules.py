"""The one rule mechanism (shadow.rules.RuleTable) and the one binder (shadow.plan)."""

import functools

import pytest
import torch

from shadow.errors import DuplicateRuleError
from shadow.plan import ArgType, plan_of
from shadow.rules import RuleTable, rule_name

aten = torch.ops.aten


def _returns_tensors(func) -> bool:
    return any(isinstance(r.type, torch.TensorType) for r in func._schema.returns)


def test_lookup_order_exact_packet_predicate_default_with_fall_through():
    table = RuleTable("test", default=lambda x: "default", packets=_returns_tensors)
    table.register(aten.exp.default)(lambda x: "exact" if x == "exact" else NotImplemented)
    table.register(aten.exp)(lambda x: "packet")  # the packet: overloads without an exact rule
    table.register_predicate(lambda plan: torch.Tag.pointwise in plan.tags)(
        lambda x: "pointwise" if x != "skip" else NotImplemented)
    assert table.run(aten.exp.default, "exact") == "exact"
    assert table.run(aten.exp.default, "other") == "pointwise"  # the exact rule fell through; not the packet's
    assert table.run(aten.exp.out, "other") == "packet"
    assert table.run(aten.sin.default, "other") == "pointwise"
    assert table.run(aten.sin.default, "skip") == "default"
    assert table.run(aten.mm.default, "other") == "default"
    assert len(table.chain(aten.exp.default)) == 3  # exact, predicate, default: the packet's rule is not
    assert table.chain("not an op") == (table.default,)


def test_a_table_without_default_can_have_an_empty_chain():
    table = RuleTable("emulation")
    assert table.chain(aten.mm.default) == () and table.run(aten.mm.default) is NotImplemented


def test_duplicates_name_both_rules_and_keys_are_checked():
    table = RuleTable("budget")

    def mm_rule(c):
        return 1

    table.register(aten.mm.default)(mm_rule)
    with pytest.raises(DuplicateRuleError) as exc:
        table.register(aten.mm.default)(functools.partial(lambda k, c: k, 2))
    assert str(exc.value) == ("a budget rule for aten.mm.default is already registered (mm_rule); "
                              "<lambda>(2) cannot replace it")
    assert isinstance(exc.value, ValueError) and exc.value.op is aten.mm.default
    with pytest.raises(TypeError, match="OpOverloads such as aten.mm.default"):
        table.register(aten.mm)(mm_rule)  # this table takes no packets
    assert rule_name(functools.partial(mm_rule, k=3)) == "mm_rule(k=3)"


def test_scoped_registrations_are_undone():
    table = RuleTable("test", default=lambda: "default")
    with table.scoped():
        table.register(aten.mm.default)(lambda: "mine")
        table.register_predicate(lambda plan: True)(lambda: "any")
        assert table.run(aten.mm.default) == "mine" and table.run(aten.exp.default) == "any"
    assert table.run(aten.mm.default) == "default" and table.run(aten.exp.default) == "default"


def test_lookups_are_remembered_until_the_next_registration():
    """own() and chain() are cached per op: a registration, or the end of a scoped block, forgets them."""
    table = RuleTable("test", packets=_returns_tensors)
    assert table.own(aten.exp.default) is None  # asked (and remembered) before any rule exists
    packet = table.register(aten.exp)(lambda: "packet")
    assert table.own(aten.exp.default) is packet and table.own(aten.exp.out) is packet
    with table.scoped():
        exact = table.register(aten.exp.default)(lambda: "exact")
        assert table.own(aten.exp.default) is exact and table.chain(aten.exp.default) == (exact,)
    assert table.own(aten.exp.default) is packet and table.chain(aten.exp.default) == (packet,)


def test_the_plan_binds_by_schema_name_with_defaults():
    plan = plan_of(aten.addmm.default)
    a, b, c = torch.ones(2, 2), torch.ones(2, 3), torch.ones(3, 2)
    assert plan.arg((a, b, c), {}, "beta") == 1 and plan.arg((a, b, c), {"alpha": 2}, "alpha") == 2
    assert plan.arg((a, b, c), {}, "nonexistent", "dflt") == "dflt"
    assert list(plan.bind((a, b, c), {})) == ["self", "mat1", "mat2", "beta", "alpha"]
    args, kwargs = plan.replace((a, b, c), {}, self=c, alpha=3)  # "self" is an argument name like any other
    assert args[0] is c and kwargs == {"alpha": 3}
    assert (plan.name, plan.op_name, plan.base) == ("aten.addmm.default", "addmm", "addmm")
    assert (plan_of(aten.addmm_.default).base, plan_of(aten.__and__.Tensor).base) == ("addmm", "__and__")
    assert plan_of(aten.addmm.default) is plan  # the schema is read once per op (budgets ask at every call)
    # a list default is a copy each time, so a rule that edits it edits its own
    x = torch.ones(1, 1, 3, 3)
    pool = plan_of(aten.max_pool2d.default)
    stride = pool.arg((x, [2, 2]), {}, "stride")
    assert stride == [] and stride is not pool.arg((x, [2, 2]), {}, "stride")
    stride.append(9)
    assert pool.arg((x, [2, 2]), {}, "stride") == []


def test_the_plan_walks_and_maps_tensor_arguments():
    plan = plan_of(aten._foreach_add.List)
    xs, ys = [torch.ones(2), torch.zeros(2)], [torch.ones(2), torch.ones(2)]
    assert [spec.type for spec in plan.tensor_args] == [ArgType.TENSORS, ArgType.TENSORS]
    assert len(list(plan.tensors((xs, ys), {}))) == 4
    args, _ = plan.map_tensors((xs, ys), {}, lambda t, spec: t + 1, skip=frozenset({1}))
    assert [t.tolist() for t in args[0]] == [[2.0, 2.0], [1.0, 1.0]] and args[1] is ys
    written = plan_of(aten.add_.Tensor)
    assert [s.name for s in written.writes] == ["self"] and written.write_args == frozenset({0})
    assert plan_of(aten.native_batch_norm.default).write_args == frozenset({3, 4})  # undeclared running stats
