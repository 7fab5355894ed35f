"""Execution: the only layer that runs MLX models.

`executor` (the MLX executor: per-request prefill, the batched decode, drafting's verify), `runners` (how the
executor calls a text or a vision-language model), `library` (the library seam: every reach into mlx-lm / mlx-vlm
internals), `drafters` and `mtp` (draft proposals). The scheduler core never imports this package; the engine
wires it to the core.
"""
