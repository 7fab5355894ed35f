"""The model layer: how a model family turns a request (text, images, video, audio) into model inputs.

`adapter` (the model adapter: every vision-language family behind one class, the families as data in
`families`, positions in `positions`), `prompt` (prompt resolution, text and media), `media` (decoding and
sampling media), `library` (the library seam: every mlx-vlm internal the layer touches). Part of the
execution side: it imports MLX and mlx-vlm; the scheduler core never imports it.
"""
