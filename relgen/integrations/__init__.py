"""Drop-in integrations: `patch(model)` runs a model's relative-position attention on relgen's kernels.

    import relgen.integrations
    names = relgen.integrations.patch(model)   # in place; the qualified names of the patched attention modules
    relgen.integrations.unpatch(model)         # the original forwards back

Parameters stay the model's own (a checkpoint loads, trains and saves unchanged). A call using something the
kernels cannot serve runs the model's own code, with a one-time warning naming the feature.
"""

from relgen.integrations._core import Adapter, Unsupported, fall_back, patch, register, unpatch

__all__ = ["Adapter", "Unsupported", "fall_back", "patch", "register", "unpatch"]
