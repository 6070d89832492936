"""Where error comes from and how much of a result's drift each part causes.

``tracking``: the module, phase and call site of every op call (used by every ShadowMode). ``state``: what a
training step changes, saved and restored so that the step can run again from the same start. ``adjoint``:
float64 adjoints of a target from the shadow of the gradients autograd computes. ``share``: ``attribute``, the
share of a target's drift each op class, module or call site causes (linear or by ablation).
"""
