"""The model's view of paged KV: a step's new K/V written into pages, and attention over them
with the `xla` path or the Pallas kernels."""
