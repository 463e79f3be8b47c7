"""The restore benchmark's methods, in the table's column order (light: the CLI imports it)."""

from kvtier.planning.plan import AUTO, EXACT_METHODS

METHODS = tuple(m.value for m in EXACT_METHODS) + (AUTO,)  # the table's column order
BASELINES = ("hf_recompute", "hf_torch_save")
