"""The code of a reproduction script (``shadow repro``): ``shadow.repro`` copies this module, below this docstring,
into DIR/repro.py after the facts of the call (``FACTS``), so it runs with torch alone. shadow reads the kept
inputs with the same functions (``checksum``, ``rebuild``, ``decode``, ``outputs``): one definition for both.
Nothing here imports shadow."""

import argparse
import contextlib
import hashlib
import importlib
import json
import math
import os
import sys

import torch


def load(path):
    """``path`` read with torch.load(weights_only=True): tensors and plain values only, never code run; raises
    ValueError saying what is wrong with any other file (truncated, damaged, or carrying a pickled object)."""
    import pickle

    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError("holds a pickled object other than tensors and plain values (a tampered or foreign file: "
                         f"{str(exc).splitlines()[0][:120]}); torch.load(weights_only=True) refused it and ran none "
                         "of it") from None
    except Exception as exc:
        raise ValueError(f"not readable (truncated or damaged: {str(exc).splitlines()[0][:160]})") from None


def is_plain(value):
    """A value made of str, int, float, bool, None, and lists, tuples and str-keyed dicts of those."""
    if isinstance(value, (list, tuple)):
        return all(is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_plain(v) for k, v in value.items())
    return value is None or type(value) in (str, int, float, bool)


class Refused(Exception):
    """A recorded mode naming anything but a mode class of shadow.modes (a tampered repro.py): never built."""


def mode_of(spec):
    """The device-side mode of shadow's (an emulation, a fault) a recorded ``spec`` names, built with the shadow
    installed here: {"emulate": name, "kwargs": ...} as ``shadow run --emulate`` builds it, or {"class":
    "shadow.modes.MODULE:CLASS", "kwargs": ...}. Raises Refused for a spec naming anything else."""
    kwargs = spec.get("kwargs")
    if not isinstance(kwargs, dict) or not is_plain(kwargs):
        raise Refused(f"the arguments of {spec.get('repr')!r} are not plain values")
    if isinstance(spec.get("emulate"), str):
        return importlib.import_module("shadow.modes.emulate").emulate(spec["emulate"], **kwargs)
    module, _, qualname = str(spec.get("class")).partition(":")
    refused = Refused(f"{spec.get('class')!r} is not a mode class of shadow.modes")
    if not module.startswith("shadow.modes.") or not qualname:
        raise refused
    from torch.utils._python_dispatch import TorchDispatchMode

    cls = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part, None)
    if not (isinstance(cls, type) and issubclass(cls, TorchDispatchMode) and cls.__module__.startswith("shadow.modes.")):
        raise refused
    return cls(**kwargs)


def emulations(recorded, off):
    """The modes of the run's emulations and faults rebuilt where shadow is installed (not ``off``), and a line on
    each: applied, or why not. Raises Refused for a spec naming anything but a mode of shadow.modes."""
    if not recorded:
        return [], []
    try:  # by name: shadow is optional here, and this module is also shadow's own
        shadow = importlib.import_module("shadow")
    except ImportError:
        shadow = None
    modes, lines = [], []
    for spec in recorded:
        what = f"note: the recorded error came from an emulation, {spec['repr']}, which is not applied"
        if off:
            lines.append(f"{what} (--no-emulation)")
        elif shadow is None:
            lines.append(f"{what}: shadow is not installed here (with shadow installed, repro.py applies it)")
        elif "reason" in spec:
            lines.append(f"{what}: it cannot be re-created ({spec['reason']})")
        else:
            try:
                mode = mode_of(spec)
            except Refused:
                raise
            except Exception as exc:  # another shadow's modes take other arguments
                lines.append(f"{what}: shadow {shadow.__version__} here cannot build it ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:160]})")
                continue
            modes.append(mode)
            lines.append(f"emulation applied: {mode!r} (shadow {shadow.__version__} is installed here)")
    return modes, lines


def checksum(t):
    """sha256 of a tensor's values as its dtype holds them (its elements in order, whatever its strides); read from
    a copy (numpy marks what it reads non-resizable: never the program's own tensor)."""
    raw = t.detach().to("cpu", copy=True).contiguous().reshape(-1).view(torch.uint8)
    try:
        data = raw.numpy().tobytes()
    except Exception:  # torch without numpy
        data = bytes(raw.tolist())
    return hashlib.sha256(data).hexdigest()


def rebuild(kept, device="cpu", wide=False):
    """A kept tensor with its shape, strides and storage offset, in its own dtype on ``device`` (built on the CPU,
    then copied over in that dtype: the device is never asked for float64), or ``wide``: in float64 (complex128)
    on the CPU, exactly. An out= buffer's values are zeros."""
    size, stride, offset = kept["size"], kept["stride"], kept["offset"]
    dtype = getattr(torch, kept["dtype"])
    if wide and (dtype.is_floating_point or dtype.is_complex):
        dtype = torch.complex128 if dtype.is_complex else torch.float64
    extent = 1 + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else 0
    base = torch.zeros(offset + extent, dtype=dtype)
    if kept["values"] is not None and extent:
        where = torch.arange(offset + extent).as_strided(size, stride, offset)
        base[where.reshape(-1)] = kept["values"].reshape(-1).to(dtype)
    return base.to(device).as_strided(size, stride, offset)


def decode(tree, tensors, device=None):
    """An argument as the op takes it from its kept form: {"tensor": i} is tensors[i]; a dtype, device, layout or
    memory format by name (a device: ``device`` where given)."""
    if isinstance(tree, list):
        return [decode(v, tensors, device) for v in tree]
    if isinstance(tree, dict):
        if "tensor" in tree:
            return tensors[tree["tensor"]]
        if "device" in tree:
            return torch.device(device if device is not None else tree["device"])
        if "complex" in tree:
            return complex(*tree["complex"])
        (kind, name), = tree.items()  # dtype, layout, memory_format
        return getattr(torch, name)
    return tree


def arguments(args, kwargs, tensors, device=None):
    """The call's (args, kwargs) from their kept forms (``decode``)."""
    return decode(args, tensors, device), {k: decode(v, tensors, device) for k, v in kwargs.items()}


def outputs(result, tensors, written):
    """The call's outputs by slot: its returned tensors (lists expanded), or its written arguments where it returns
    none (in-place foreach ops)."""
    flat = []
    for v in (result if isinstance(result, (list, tuple)) else [result]):
        flat.extend(v if isinstance(v, (list, tuple)) else [v])
    flat = [t for t in flat if isinstance(t, torch.Tensor)]
    return flat if flat else [tensors[i] for i in written]


def figures(y, r, dtype, bound, ulps):
    """The error of y (the device's output, on the CPU) against the float64 reference r, in shadow's units
    (docs/error-units.md): max abs, max ulp of ``dtype``, rel_norm, budget used (max abs / bound, or max ulp / ulps),
    over the elements where both are finite; the others are counted apart where they differ."""
    real = dtype.to_real() if dtype.is_complex else dtype
    y = y.to(r.dtype)
    ok = torch.isfinite(y) & torch.isfinite(r)
    d = (y - r).abs()[ok].double()
    ra = r.abs()[ok].double()
    out = {"max_abs": 0.0, "max_ulp": 0.0, "rel_norm": 0.0, "norm": 0.0, "budget_used": 0.0, "n": r.numel(),
           "nonfinite": int((~ok & (y != r) & ~(torch.isnan(y) & torch.isnan(r))).sum())}
    if not d.numel() or float(d.max()) == 0.0:
        return out
    p = -round(math.log2(torch.finfo(real).eps))
    unit = (ra.view(torch.int64) & 0x7FF0000000000000).view(torch.float64).clamp_min(torch.finfo(real).tiny)
    nd, nr = float(d.square().sum().sqrt()), float(ra.square().sum().sqrt())
    out.update(max_abs=float(d.max()), max_ulp=float((d / unit).max()) * 2.0 ** p, norm=nd,
               rel_norm=nd / nr if nr > 0 else math.inf)
    if ulps is not None:
        out["budget_used"] = out["max_ulp"] / ulps if ulps > 0 else math.inf
    else:
        b = bound.double().expand(r.shape)[ok]
        hit = d > 0
        out["budget_used"] = float(torch.where(b[hit] > 0, d[hit] / b[hit], math.inf).max())
    return out


def merged(per_output):
    """One call's figures over its outputs, as shadow merges them."""
    out = dict(per_output[0])
    for f in per_output[1:]:
        for k in ("max_abs", "max_ulp", "rel_norm", "budget_used"):
            out[k] = max(out[k], f[k])
        out["norm"], out["n"] = math.hypot(out["norm"], f["norm"]), out["n"] + f["n"]
        out["nonfinite"] += f["nonfinite"]
    return out


def effective_bits(norm, model):
    """The stored mantissa bits that explain the error (shadow.budgets.effective_bits): every quantity the op reads
    rounded once to p bits, its sums accumulated as a correct kernel's (docs/budgets.md)."""
    if norm == 0.0:
        return math.inf
    excess = norm ** 2 / model["kappa"]
    if model["acc_sq"] > 0.0:
        excess -= model["ua"] ** 2 * model["acc_sq"] * (1 + 3 * math.sqrt(2 / max(model["n_out"], 1)))
        if excess <= 0.0:
            return model["stored"]
    if model["scale_sq"] <= 0.0 or math.isinf(norm):
        return -math.inf
    return min(-0.5 * math.log2(excess / model["scale_sq"]) - 1.0, model["stored"])


def numerics_changed(recorded):
    """The recorded numerics settings (torch.backends...) that read otherwise in this process: name -> (then, now)."""
    changed = {}
    for name, then in recorded.items():
        path, call = (name[:-2], True) if name.endswith("()") else (name, False)
        try:
            obj = torch
            for part in path.split(".")[1:]:
                obj = getattr(obj, part)
            now = obj() if call else obj
        except Exception:  # not in this torch, or not readable here
            continue
        if isinstance(now, (bool, int, float, str)) and now != then:
            changed[name] = (then, now)
    return changed


def main(argv, facts):
    parser = argparse.ArgumentParser(description=f"Reproduce call {facts['call']} of a shadow run: {facts['op']}.")
    parser.add_argument("--device", default=facts["device"], help=f"where to run the op (default: the run's, "
                        f"{facts['device']}); e.g. cpu, to compare")
    parser.add_argument("--setup", metavar="MODULE[:FUNCTION]", help="import MODULE first (and call FUNCTION()): "
                        "what registers the device's backend, e.g. torch_directml")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    parser.add_argument("--no-emulation", action="store_true", help="run the op without the run's emulations and "
                        "faults (applied by default where shadow is installed)")
    args = parser.parse_args(argv)
    if args.setup:
        module, _, function = args.setup.partition(":")
        loaded = importlib.import_module(module)
        if function:
            getattr(loaded, function)()
    try:
        device = torch.device(args.device)
        torch.empty(1, device=device)
    except Exception as exc:
        print(f"repro.py: the device {args.device!r} is not available here ({str(exc).splitlines()[0]}); import "
              "its backend first with --setup MODULE[:FUNCTION] (torch_directml for DirectML), or give --device "
              "cpu", file=sys.stderr)
        return 2
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "inputs.pt")
    fix = "write it again with shadow repro from the run's report"
    if not os.path.exists(path):
        print(f"repro.py: {path}: missing: the inputs live next to repro.py; {fix}", file=sys.stderr)
        return 2
    try:
        data = load(path)
    except ValueError as exc:
        print(f"repro.py: {path}: {exc}; {fix}", file=sys.stderr)
        return 2
    try:
        modes, notes = emulations(facts["emulation"], args.no_emulation)
    except Refused as exc:
        print(f"repro.py: refused to apply an emulation: {exc}; this file's FACTS are not as shadow repro wrote "
              "them: write it again, or run with --no-emulation", file=sys.stderr)
        return 2
    if not isinstance(data, dict) or not {"tensors", "args", "kwargs", "bounds", "checksums"} <= set(data):
        print(f"repro.py: {path}: not the inputs of a shadow reproduction; {fix}", file=sys.stderr)
        return 2
    namespace, name, overload = facts["op"].split(".")
    op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    dtype = getattr(torch, facts["dtype"])
    on_device = [rebuild(t, device) for t in data["tensors"]]
    a, kw = arguments(data["args"], data["kwargs"], on_device, device)
    with contextlib.ExitStack() as stack:  # the device's op under the run's emulations (outermost first)
        for mode in modes:
            stack.enter_context(mode)
        result = op(*a, **kw)
    got = [t.detach().to("cpu") for t in outputs(result, on_device, data["written"])]
    wide = [rebuild(t, wide=True) for t in data["tensors"]]
    a, kw = arguments(data["reference_args"], data["reference_kwargs"], wide)
    reference = outputs(op(*a, **kw), wide, data["written"])
    slots = sorted(data["bounds"])
    fig = merged([figures(got[s], reference[s], dtype, data["bounds"][s], data["ulps"]) for s in slots])
    fig["effective_bits"] = effective_bits(fig["norm"], data["bits"])
    fig["over_budget"] = fig["budget_used"] > 1.0
    fig["output_matches"] = all(checksum(got[s]) == data["checksums"].get(s) for s in slots)
    fig["device"] = str(device)
    fig["emulation_applied"] = [repr(m) for m in modes]
    changed = numerics_changed(data["numerics"])
    if args.json:
        print(json.dumps(fig))
        return 1 if fig["over_budget"] else 0
    shapes = ", ".join(f"{t['name']} {t['dtype']}{list(t['size'])}" for t in data["tensors"])
    budget = facts["budget"]
    rec = facts["recorded"]
    print(f"{facts['op']}({shapes}) on {device} (torch {torch.__version__}; recorded on {facts['device']}, "
          f"torch {facts['torch']}, call {facts['call']})")
    print(f"device output: {'the recorded one, bit for bit' if fig['output_matches'] else 'differs from the recorded one'}")
    print(f"error against float64 (on the CPU, inputs upcast exactly): max abs {fig['max_abs']:.6g}, max ulp "
          f"{fig['max_ulp']:.6g} of {facts['dtype']}, rel_norm {fig['rel_norm']:.3g}, effective bits "
          f"{fig['effective_bits']:.3g} of {data['bits']['stored']:g}"
          + (f", {fig['nonfinite']} non-finite elements differ" if fig["nonfinite"] else ""))
    bounds = [b for b in data["bounds"].values() if b is not None]
    span = f"; bound {min(float(b.min()) for b in bounds):.3g} to {max(float(b.max()) for b in bounds):.3g}" \
        if bounds else ""
    print(f"budget ({budget['family']}): {budget['formula']}{span}")
    print(f"budget used: {fig['budget_used']:.4g} (recorded: {rec['budget_used']:.4g}; max abs "
          f"{rec['max_abs']:.6g}, max ulp {rec['max_ulp']:.6g})")
    for line in notes:
        print(line)
    for key, (then, now) in changed.items():
        print(f"note: {key} was {then!r} in the run, is {now!r} here")
    if fig["over_budget"]:
        print(f"conclusion: over budget: {fig['budget_used']:.3g}x the error a correct {facts['dtype']} kernel may "
              f"make on these inputs; more than rounding: reduced-precision arithmetic, an approximation, or a bug")
        return 1
    print(f"conclusion: within budget ({fig['budget_used']:.3g} of it): the error of correct {facts['dtype']} "
          "rounding")
    return 0
