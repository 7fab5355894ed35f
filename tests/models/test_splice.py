"""The id expansion of spliced images (scheduler/models/splice.py): each image's run of ids in the processor's prompt
(one id, or LLaVA-NeXT's feature count) becomes one id per embedding row and back, with the images' row counts; the
engine-level equality with solo mlx-vlm is in tests/models/test_vlm_families*.py, on the families that splice."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler.models import splice

M = -200


def test_expand_writes_each_image_id_once_per_row_and_collapse_undoes_it():
    ids = [5, M, 6, 7, M, M, 8]  # the last two images side by side: one run of markers once expanded
    runs = ((1, 3), (1, 2), (1, 4))
    expanded = splice.expand(ids, M, runs)
    assert expanded == [5, M, M, M, 6, 7, M, M, M, M, M, M, 8]
    assert splice.collapse(expanded, M, runs) == ids
    # re-fed outputs after the prompt (a preempted request's) pass through
    assert splice.collapse(expanded + [9, 10], M, runs) == ids + [9, 10]


def test_a_run_of_ids_becomes_its_rows():
    """llava_next: the processor writes an image's HF feature count of ids (5 here), the merge gives it 4 rows."""
    ids = [5, M, M, M, M, M, 6]
    expanded = splice.expand(ids, M, ((5, 4),))
    assert expanded == [5, M, M, M, M, 6]
    assert splice.collapse(expanded, M, ((5, 4),)) == ids


def test_the_mask_follows_the_ids():
    ids = [5, M, 6]
    mask = np.array([[1, 1, 0]])
    wide = splice.expand_along(mask, ids, M, ((1, 3),))
    assert wide.tolist() == [[1, 1, 1, 1, 0]]
    assert splice.collapse_along(wide, splice.expand(ids, M, ((1, 3),)), M, ((1, 3),)).tolist() == mask.tolist()


@pytest.mark.parametrize("ids, runs", [([5, M, 6], ((1, 2), (1, 2))), ([5, 6], ((1, 2),)), ([M, M], ((1, 1),))])
def test_image_ids_other_than_the_images_are_refused(ids, runs):
    with pytest.raises(ValueError, match=r"image\(s\)"):
        splice.expand(ids, M, runs)


def test_collapse_refuses_runs_that_are_not_the_images_rows():
    with pytest.raises(ValueError, match="do not match"):
        splice.collapse([5, M, M, 6], M, ((1, 3),))
    with pytest.raises(ValueError, match="holds 1 image"):
        splice.collapse([5, M, M, 6], M, ((1, 2), (1, 2)))


def test_a_draft_ends_before_a_negative_id():
    """Prompt lookup copies whatever followed an n-gram in the prompt, a spliced image's -200 included; no
    embedding holds it, so the executor cuts the draft there (and the drafter's log-probs with it)."""
    import mlx.core as mx

    from scheduler.execution.drafters import Draft
    from scheduler.execution.executor import _embeddable

    assert _embeddable(Draft("a", [5, M, 7], mx.zeros((3, 4)))).tokens == [5]
    assert _embeddable(Draft("a", [5, M, 7], mx.zeros((3, 4)))).logprobs.shape == (1, 4)
    kept = Draft("b", [5, 6])
    assert _embeddable(kept) is kept


@pytest.fixture(scope="module")
def janus(tmp_path_factory):
    import mlx_vlm

    from scheduler.fixtures.vlm_families import build_tiny_vlm

    return mlx_vlm.load(str(build_tiny_vlm("janus", tmp_path_factory.mktemp("janus"))))


def _image():
    from PIL import Image

    return Image.fromarray(np.random.default_rng(3).integers(0, 256, (40, 56, 3), dtype=np.uint8))


def test_a_spliced_prompt_is_planned_and_limited_by_its_rows(janus):
    """The engine's prompt is mlx-vlm's cache: the processor's ids with the image's one id written once per row
    (144 on the tiny Janus), so max_model_len and the KV budget count the rows. A context that holds the ids but not
    the rows refuses the request at add_request; the same prompt without the image fits."""
    from scheduler import Engine, EngineConfig
    from scheduler.models.prompt import MediaInputs
    from scheduler.request import InvalidRequest

    model, processor = janus
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    resolved = Engine(model, processor).prompts.resolve(chat, None, MediaInputs.of([_image()]))
    marker = model.config.image_token_index
    ids = resolved.token_ids
    assert ids.count(marker) == 144 and resolved.num_media_tokens == 144
    few = len(ids) - 143 + 5  # the processor's ids (one for the image) and a few more: fewer than the rows
    engine = Engine(model, processor, EngineConfig(max_model_len=few))
    with pytest.raises(InvalidRequest, match=f"has {len(ids)} tokens; max_model_len is {few}"):
        engine.add_request(prompt=chat, images=[_image()])
    text = [{"role": "user", "content": "What is it?"}]
    engine.add_request(prompt=text)
    assert engine.has_pending()


def test_a_spliced_image_id_given_as_a_token_is_refused():
    """-200 is no token: outside the vocabulary, a prompt of ids may not hold it (only the engine's own expansion
    of an image's id writes it, next to the image's rows)."""
    from scheduler.request import InvalidRequest, validate_prompt_tokens

    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        validate_prompt_tokens([5, M, 6], 512, 100)
    assert validate_prompt_tokens([5, M, 6], 512, 100, frozenset({M})) == [5, M, 6]


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory):
    import mlx_vlm

    from scheduler.fixtures.vlm_families import build_tiny_vlm

    return mlx_vlm.load(str(build_tiny_vlm("llava_next", tmp_path_factory.mktemp("llava_next"))))


@pytest.mark.parametrize("width, height", [(56, 56), (112, 140), (60, 200), (200, 60), (20, 20), (300, 300)])
def test_llava_next_rows_are_counted_before_the_tower(width, height, llava_next):
    """LLaVA-NeXT's rule (SpliceRows.VIEW_BLOCKS): an image's N ids become min(N, 2 x views) blocks of the tower's
    rows a view. The engine's expanded prompt is as long as mlx-vlm's own embedding of the processor's prompt, for
    images whose N is above and below 2 x views (3 to 5 views of 9 rows here)."""
    from PIL import Image

    from scheduler.models import library
    from scheduler.models.adapter import VLMAdapter

    model, processor = llava_next
    adapter = VLMAdapter(model, processor)
    image = Image.fromarray(np.random.default_rng(width).integers(0, 256, (height, width, 3), dtype=np.uint8))
    chat = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, {"type": "image"}]}]
    prepared = adapter.prepare(chat, images=[image])
    inputs = library.prepare_inputs(model, processor, prepared.prompt, [image])
    embedded = model.get_input_embeddings(inputs["input_ids"], inputs["pixel_values"]).inputs_embeds
    assert len(prepared.input_ids) == embedded.shape[1] != inputs["input_ids"].shape[1]
    (held, rows), = prepared.splice_runs
    assert held == int((inputs["input_ids"] == model.config.image_token_index).sum().item())
    assert rows == prepared.num_media_tokens


def test_the_server_writes_a_spliced_image_ids_prompt_logprob_as_json_can_carry_it():
    """vLLM's prompt_logprobs field over a spliced prompt: the image's id has no text and logprob -inf, which
    JSON has no number for (the floor vLLM writes for a masked token)."""
    import json

    from scheduler.server.choices import prompt_logprobs_field
    from scheduler.server.generation import LOGPROB_FLOOR, PromptScores

    class Tokenizer:
        def decode(self, ids):
            assert all(t >= 0 for t in ids), "a negative id decoded"
            return f"<{ids[0]}>"

    scores = PromptScores([5, M, 6], [None, float("-inf"), -1.5], [None, 512, 3], [[], [(7, -0.1)], [(6, -1.5)]])
    field = prompt_logprobs_field(Tokenizer(), scores, 1)
    assert field[1][str(M)] == {"logprob": LOGPROB_FLOOR, "rank": 512, "decoded_token": ""}
    assert field[2]["6"] == {"logprob": -1.5, "rank": 1, "decoded_token": "<6>"}
    json.dumps(field, allow_nan=False)


def test_a_row_count_the_merge_contradicts_fails_loudly(janus):
    """Where a rule counted an image's rows wrong, the prompt would be shifted against mlx-vlm's: the encoders'
    output is then another length than the ids they were given for, and encoding the request raises instead."""
    import dataclasses

    from scheduler.models.adapter import VLMAdapter

    model, processor = janus
    adapter = VLMAdapter(model, processor)
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    prepared = adapter.prepare(chat, images=[_image()])
    marker = model.config.image_token_index
    (held, rows), = prepared.splice_runs
    assert (held, rows) == (1, 144)
    wrong = ((1, rows + 1),)
    ids = splice.expand(splice.collapse(prepared.input_ids, marker, prepared.splice_runs), marker, wrong)
    bad = dataclasses.replace(prepared, input_ids=ids, splice_runs=wrong, media_items=(), mask=None,
                              media_positions=tuple(i for i, t in enumerate(ids) if t == marker))
    assert adapter.encode(prepared).num_tokens == len(prepared.input_ids)
    with pytest.raises(ValueError, match=f"the encoders gave {len(ids) - 1} embeddings for {len(ids)} tokens"):
        adapter.encode(bad)
