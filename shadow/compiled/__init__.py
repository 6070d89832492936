"""torch.compile under ShadowMode: each compiled graph's call judged as one op against the float64 replay of its
aten graph, with a budget composed from its ops' (docs/compiled.md).

``Graph``: a compiled graph as the engine sees it (``shadow.engine.Engine.graph_call``); ``trace``: its aten graph
traced and run on float64 values; ``budget``: its composed budget; ``propagate``: how an op passes errors on.
"""

from .graph import Graph

__all__ = ["Graph"]
