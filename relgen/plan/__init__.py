"""Stage 2, the plan: the analyzer turns a spec at a sequence length into a `Plan` — the relation rows and their
reachable offset ranges, contiguity, the saturation bounds [L, U] (proven by interval arithmetic or measured over
the analysed window), the expansion β that copies buckets to columns, the projection windows and the gradient path
(offset or atomic). The Plan is the only input of code generation."""

from relgen.plan.analyze import Plan, analyze

__all__ = ["Plan", "analyze"]
