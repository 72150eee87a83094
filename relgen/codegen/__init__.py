"""Stage 3, code generation: a Plan becomes the source of one Python module of Triton kernels and autograd glue.
`render` re-checks every Plan field the templates read (`PlanValues`: exact types, identifiers, fixed choices) and
renders the Jinja templates of templates/ with a finalize that refuses anything else, so no text of a spec becomes
code; `write_module` writes the formatted module with a header naming the spec, its hash and the plan summary."""

from relgen.codegen.generator import PlanValues, build, format_source, render, write_module

__all__ = ["PlanValues", "build", "format_source", "render", "write_module"]
