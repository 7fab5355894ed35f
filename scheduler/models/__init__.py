"""The model layer: how a model family turns a request (text, images, video, audio) into model inputs.

`vlm` holds the vision-language families behind one seam, `media` decodes and samples media. Part of the
execution side: it imports MLX and mlx-vlm; the scheduler core never imports it.
"""
