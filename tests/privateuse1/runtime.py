"""The stand-in's device module (``torch.privateuseone``): what torch asks of a backend's runtime module, for one
synchronous device whose default generator is the extension's."""

from __future__ import annotations

import time
import types

import torch


def module(ext) -> types.ModuleType:
    """A module object answering torch's questions about the device."""
    mod = types.ModuleType("privateuseone_standin")
    generator: torch.Generator = ext.default_generator()
    mod.is_available = lambda: True
    mod.is_initialized = lambda: True
    mod._is_in_bad_fork = lambda: False
    mod._lazy_init = lambda: None
    mod.device_count = lambda: 1
    mod.current_device = lambda: 0
    mod.set_device = lambda device: None
    mod.synchronize = lambda device=None: None
    mod.get_amp_supported_dtype = lambda: [torch.float16]
    mod.manual_seed = mod.manual_seed_all = lambda seed: generator.manual_seed(int(seed))
    mod.initial_seed = generator.initial_seed
    mod.get_rng_state = lambda device=None: generator.get_state()
    mod.set_rng_state = lambda state, device=None: generator.set_state(state)
    mod.default_generator = generator
    return mod


def let_autograd_threads_finish() -> None:
    """At exit, give up the GIL for a moment. Autograd runs a device's backward on a thread of its own, which drops
    its last reference to the finished graph (and Python objects it holds) just after backward returns: if Python
    is finalizing by then, that thread cannot take the GIL and the process aborts ("terminate called without an
    active exception"), as it did in about a third of the short scripts that exit right after a backward."""
    time.sleep(0.05)
