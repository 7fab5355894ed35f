"""Video and audio inputs: decoding, frame selection and resampling, before any model code runs.

Everything here is CPU work on the caller's thread (``Engine.add_request`` -> ``adapter.prepare``); nothing
touches a model. Failures raise ``MediaError`` naming the input's kind and index (``video 1: ...``).

Video sources (``load_video``)
------------------------------
* a file path (``str`` / ``os.PathLike``), decoded with OpenCV (``cv2.VideoCapture``);
* raw bytes (``bytes`` / ``bytearray`` / ``memoryview``): written to a temporary file that OpenCV opens (its
  FFmpeg backend recognises the container from the content, not the name) and removed afterwards;
* a ``data:video/...;base64,`` URL (an OpenAI-style ``video_url`` part's): its bytes, as above;
* a list/tuple of frames (PIL images or ``HxWx3`` / ``HxWx4`` / ``HxW`` ``uint8`` numpy arrays), taken as
  frames that were already chosen: ``fps`` does not apply to them (they carry no timestamps), only the
  ``max_frames`` cap.

Frame selection (``sample_frame_indices``)
------------------------------------------
``fps`` (> 0) frames per second of video, picked by timestamp: sample ``k`` is at ``t_k = k / fps`` seconds and
takes the frame on screen at that time, ``floor(t_k * source_fps)`` (frame ``i`` covers
``[i / source_fps, (i + 1) / source_fps)``), for every ``t_k`` inside the clip. A 3 s clip at 30 fps sampled at
``fps=2`` gives frames 0, 15, 30, 45, 60, 75. When that is more than ``max_frames`` (>= 1), ``max_frames`` frames
are spread evenly over the whole clip instead (frame ``floor(k * total / max_frames)``; the same as lowering
the rate to ``max_frames / duration``): ``max_frames=4`` on that clip gives 0, 22, 45, 67. A clip shorter than
one sample period gives its first frame; an ``fps`` above the source's rate takes every frame once (never the
same frame twice). A frame list longer than ``max_frames`` is thinned the same way.

The frame count is rounded neither up nor down here: Qwen2-VL's processor groups frames in temporal patches of
2 and repeats the last frame of an odd count, exactly as it does for a solo ``mlx_vlm`` run given those frames.
A file's selection goes to the processor with its metadata (source fps, the selected indices:
``library.video_metadata``), so the processors that write each frame group's time into the prompt (Qwen3-VL,
Qwen3.5, GLM-5-Next, Mage-VL, Nemotron Omni) stamp the frames' own times, as mlx-vlm does for a file it samples;
Gemma 4's processor, which stamps frame j at j / fps from one rate per video, gets the selection's rate instead
(``sampling_rate``: ``fps``, or ``max_frames / duration`` when the cap spreads the samples; not mlx-vlm's mean rate
over the clip, which stamps a 3.25 s clip sampled at 1 fps 0, 0, 1, 2 s).

Frames are read sequentially (``grab`` every frame, ``retrieve`` the chosen ones), up to the last chosen one;
that is exact for every codec, seeking by frame number is not. Errors (``MediaError``): no file, not a video
OpenCV can open, no frame rate, no decodable frame, and truncation: decoding stops before a chosen frame more
than ``max(2, 5%)`` of the declared frames short of the declared count (a smaller shortfall is an estimated
count, as Matroska / WebM give: the selection is then recomputed over the frames that really decode).
Truncation past the last chosen frame is not looked for (it is not read).

Audio sources (``load_audio``)
------------------------------
* a WAV (or other audio) file path, or its bytes: decoded and resampled by ``mlx_vlm.utils.load_audio`` (via
  ``mlx_audio``), the loader ``mlx_vlm.generate`` itself uses, so a solo run hears exactly the same samples;
  stereo is averaged to mono;
* ``(array, sample_rate)``: a float array of samples (``(n,)`` or ``(n, channels)``, averaged to mono),
  resampled with ``mlx_audio.utils.resample_audio`` (the function ``load_audio`` uses for files) when
  ``sample_rate`` differs from the model's. A bare array is refused: its rate would be a guess.
The result is a float32 mono waveform at the model's rate; empty or non-finite audio is a ``MediaError``.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import base64
import io

import numpy as np

from scheduler.request import media_field

VideoInput = Any  # str (path, data:video URL) | os.PathLike | bytes | bytearray | memoryview | Sequence[frames]


class MediaError(ValueError):
    """An input image / video / audio clip cannot be used. ``index`` is its position in the request's list of
    that kind (None when the failure cannot be pinned on one item); ``kind`` is "image", "video" or "audio"."""

    def __init__(self, index: int | None, reason: str, kind: str = "image"):
        self.index = index
        self.reason = reason
        self.kind = kind
        where = f"{kind} {index}" if index is not None else f"{kind}s"
        super().__init__(f"{where}: {reason}")


class RemoteMedia(MediaError):
    """A medium given as an ``http(s)`` URL that was not fetched: remote media are off, its host is not allowed,
    or the fetch failed (``scheduler.models.fetch``); the loaders here never fetch one themselves."""


class MediaLimit(ValueError):
    """More media of one kind in a request than the engine allows (``EngineConfig.max_images_per_request``,
    ``max_videos_per_request``, ``max_audio_per_request``)."""

    def __init__(self, kind: str, count: int, limit: int):
        self.kind, self.count, self.limit = kind, count, limit
        field_name = media_field(kind)
        what = "audio clips" if kind == "audio" else field_name
        super().__init__(f"{count} {what} in one request; at most {limit} (max_{field_name}_per_request)")


def describe_source(source: Any) -> str:
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        return repr(text if len(text) <= 80 else text[:77] + "...")
    return type(source).__name__


# ================================================================================================
# frame selection
# ================================================================================================


def validate_video_sampling(fps: Any, max_frames: Any) -> tuple[float, int]:
    """(fps, max_frames) checked: fps a finite number > 0, max_frames an integer >= 1. ValueError otherwise."""
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps) or fps <= 0:
        raise ValueError(f"video fps: must be a finite number > 0, got {fps!r}")
    if isinstance(max_frames, bool) or not isinstance(max_frames, (int, np.integer)) or max_frames < 1:
        raise ValueError(f"video max_frames: must be an integer >= 1, got {max_frames!r}")
    return float(fps), int(max_frames)


def spread_indices(total: int, count: int) -> list[int]:
    """``count`` indices spread evenly over ``range(total)``: ``floor(k * total / count)``."""
    return [(k * total) // count for k in range(count)]


def sample_frame_indices(total_frames: int, source_fps: float, fps: float, max_frames: int) -> list[int]:
    """Indices of the frames to keep from a ``total_frames``-frame clip recorded at ``source_fps`` (see the
    module docstring). Always at least one frame for a non-empty clip; strictly increasing."""
    return _select_frames(total_frames, source_fps, fps, max_frames)[0]


def sampling_rate(total_frames: int, source_fps: float, fps: float, max_frames: int) -> float:
    """The rate of the selection ``sample_frame_indices`` makes: its sample ``k`` is the frame on screen ``k /
    rate`` seconds into the clip. ``fps``, or the source's rate when ``fps`` is above it (every frame once), or
    ``max_frames / duration`` when the cap spreads the samples over the whole clip. A processor that stamps each
    frame with a time from one rate per video (Gemma 4's ``mm:ss``) stamps the frames' own times with it."""
    return _select_frames(total_frames, source_fps, fps, max_frames)[1]


def _select_frames(total_frames: int, source_fps: float, fps: float, max_frames: int) -> tuple[list[int], float]:
    fps, max_frames = validate_video_sampling(fps, max_frames)
    if total_frames < 1:
        raise ValueError(f"no frames to sample (total_frames={total_frames})")
    if not (math.isfinite(source_fps) and source_fps > 0):
        raise ValueError(f"source frame rate must be > 0, got {source_fps!r}")
    step = max(source_fps / fps, 1.0)  # source frames per sample; above the source rate, every frame once
    indices: list[int] = []
    k = 0
    while True:
        # the 1e-9 keeps exact ratios exact (30 / 2 * 3 == 45, not 44.999...)
        index = math.floor(k * step + 1e-9)
        if index >= total_frames:
            break
        indices.append(index)
        k += 1
        if len(indices) > max_frames:  # the cap binds: spread over the whole clip instead
            return spread_indices(total_frames, max_frames), max_frames * source_fps / total_frames
    return indices, source_fps / step


# ================================================================================================
# decoding
# ================================================================================================


@dataclass
class VideoFrames:
    """The frames chosen from one video, in order, as ``HxWx3`` ``uint8`` RGB arrays (all the same size)."""

    frames: list[np.ndarray]
    indices: tuple[int, ...]  # which source frames they are (for a frame list: positions in it)
    total_frames: int  # frames in the source (decoded, for a file)
    source_fps: float | None  # the container's frame rate; None for a frame list
    meta: dict = field(default_factory=dict)
    rate: float | None = None  # sample k is the frame on screen k / rate seconds in (sampling_rate); None for a list

    @property
    def num_frames(self) -> int:
        return len(self.frames)

    @property
    def timestamps(self) -> list[float] | None:
        if self.source_fps is None:
            return None
        return [i / self.source_fps for i in self.indices]


def _frame_array(frame: Any, index: int, position: int) -> np.ndarray:
    """One frame of a frame list -> ``HxWx3`` uint8 RGB (a copy: later changes to the caller's array do not
    reach the request)."""
    from PIL import Image

    if isinstance(frame, Image.Image):
        try:
            frame.load()
            arr = np.asarray(frame.convert("RGB"))
        except Exception as exc:
            raise MediaError(index, f"frame {position}: cannot decode image: {type(exc).__name__}: {exc}",
                             "video") from exc
    elif isinstance(frame, np.ndarray):
        arr = frame
        if arr.dtype != np.uint8:
            raise MediaError(index, f"frame {position}: dtype {arr.dtype}, want uint8", "video")
        if arr.ndim == 2:
            arr = np.repeat(arr[..., None], 3, axis=-1)
        elif arr.ndim == 3 and arr.shape[-1] == 4:
            arr = arr[..., :3]
        elif arr.ndim == 3 and arr.shape[-1] == 1:
            arr = np.repeat(arr, 3, axis=-1)
        if arr.ndim != 3 or arr.shape[-1] != 3:
            raise MediaError(index, f"frame {position}: shape {tuple(frame.shape)}, want HxWx3 (RGB)", "video")
    else:
        raise MediaError(index, f"frame {position}: unsupported frame type {type(frame).__name__} "
                                "(want PIL.Image or an HxWx3 uint8 numpy array)", "video")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise MediaError(index, f"frame {position}: zero-size frame {arr.shape[1]}x{arr.shape[0]}", "video")
    return np.array(arr, dtype=np.uint8, copy=True, order="C")


def _frames_from_list(frames: Sequence[Any], index: int, max_frames: int) -> VideoFrames:
    if len(frames) == 0:
        raise MediaError(index, "zero frames (an empty frame list)", "video")
    keep = list(range(len(frames))) if len(frames) <= max_frames else spread_indices(len(frames), max_frames)
    arrays = [_frame_array(frames[i], index, i) for i in keep]
    shapes = {a.shape for a in arrays}
    if len(shapes) > 1:
        raise MediaError(index, f"frames differ in size: {sorted(shapes)}", "video")
    return VideoFrames(arrays, tuple(keep), len(frames), None)


def _read_selected(cap: Any, wanted: Sequence[int]) -> tuple[list[np.ndarray], int]:
    """Decode sequentially up to the last wanted frame. Returns (RGB frames of the wanted indices that were
    reached, frames grabbed)."""
    import cv2

    wanted_set = set(wanted)
    last = max(wanted)
    frames: list[np.ndarray] = []
    position = 0
    while position <= last:
        if not cap.grab():
            break
        if position in wanted_set:
            ok, frame = cap.retrieve()
            if not ok or frame is None:
                break
            frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
        position += 1
    return frames, position


def _count_frames(path: str) -> int:
    import cv2

    cap = cv2.VideoCapture(path)
    try:
        n = 0
        while cap.isOpened() and cap.grab():
            n += 1
        return n
    finally:
        cap.release()


def _decode_file(path: str, index: int, fps: float, max_frames: int, what: str) -> VideoFrames:
    import cv2

    cap = cv2.VideoCapture(path)
    try:
        if not cap.isOpened():
            raise MediaError(index, f"not a readable video ({what})", "video")
        source_fps = float(cap.get(cv2.CAP_PROP_FPS) or 0.0)
        if not (math.isfinite(source_fps) and source_fps > 0):
            raise MediaError(index, f"the video has no frame rate ({what})", "video")
        claimed = int(cap.get(cv2.CAP_PROP_FRAME_COUNT) or 0)
    finally:
        cap.release()
    total = claimed if claimed > 0 else _count_frames(path)
    if total < 1:
        raise MediaError(index, f"zero frames ({what})", "video")
    for _attempt in range(2):
        wanted, rate = _select_frames(total, source_fps, fps, max_frames)
        cap = cv2.VideoCapture(path)
        try:
            frames, grabbed = _read_selected(cap, wanted)
        finally:
            cap.release()
        if len(frames) == len(wanted):
            shapes = {f.shape for f in frames}
            if len(shapes) > 1:
                raise MediaError(index, f"decoded frames differ in size: {sorted(shapes)}", "video")
            return VideoFrames(frames, tuple(wanted), total, source_fps,
                               meta={"claimed_frames": claimed, "fps": fps, "max_frames": max_frames}, rate=rate)
        if grabbed < 1:
            raise MediaError(index, f"zero frames decode ({what})", "video")
        if total - grabbed > _tolerated_shortfall(total):
            raise MediaError(index, f"truncated or corrupt: decoding stops at frame {grabbed} of the {total} "
                                    f"frames the container declares ({what})", "video")
        total = grabbed  # an estimated frame count, a little too high: sample what really decodes
    raise MediaError(index, f"frames stop decoding part-way ({what})", "video")


def _tolerated_shortfall(declared: int) -> int:
    """Frames a container's declared count may exceed what decodes before the file counts as truncated:
    some containers (Matroska / WebM) only estimate the count from duration x rate."""
    return max(2, declared // 20)


def load_video(source: VideoInput, index: int, fps: float, max_frames: int) -> VideoFrames:
    """Decode one video and select its frames (see the module docstring). Raises ``MediaError`` naming
    ``video index``; ``ValueError`` for bad ``fps`` / ``max_frames``."""
    fps, max_frames = validate_video_sampling(fps, max_frames)
    if isinstance(source, (list, tuple)):
        return _frames_from_list(source, index, max_frames)
    if isinstance(source, np.ndarray) and source.ndim == 4:  # (T, H, W, C) stack of frames
        return _frames_from_list(list(source), index, max_frames)
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if not data:
            raise MediaError(index, "empty video data (bytes)", "video")
        fd, tmp = tempfile.mkstemp(prefix="mlxsched-video-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            return _decode_file(tmp, index, fps, max_frames, f"{len(data)} bytes")
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    if isinstance(source, str) and source.startswith("data:"):  # an OpenAI-style video_url part's data: URL
        return load_video(_data_url_bytes(source, "video", index), index, fps, max_frames)
    if isinstance(source, str) and source.startswith(("http://", "https://")):
        raise RemoteMedia(index, "remote URLs are not fetched; pass the video bytes, a file path, a data: URL or "
                                 "its frames", "video")
    if isinstance(source, str) and source.startswith("file://"):
        source = source[len("file://"):]
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.exists():
            raise MediaError(index, f"file not found: {describe_source(source)}", "video")
        if not path.is_file():
            raise MediaError(index, f"not a regular file: {describe_source(source)}", "video")
        if path.stat().st_size == 0:
            raise MediaError(index, f"empty file: {describe_source(source)}", "video")
        return _decode_file(str(path), index, fps, max_frames, describe_source(source))
    raise MediaError(index, f"unsupported video type {type(source).__name__} "
                            "(want a file path, bytes, or a list of frames)", "video")


# ================================================================================================
# audio
# ================================================================================================

AudioInput = Any  # str | os.PathLike | bytes | tuple[np.ndarray, int]


def _check_waveform(wave: Any, index: int, what: str) -> np.ndarray:
    wave = np.asarray(wave, dtype=np.float32)
    if wave.ndim != 1:
        raise MediaError(index, f"decoded to shape {wave.shape}, want mono samples ({what})", "audio")
    if wave.size == 0:
        raise MediaError(index, f"no samples ({what})", "audio")
    if not np.isfinite(wave).all():
        raise MediaError(index, f"samples are not all finite ({what})", "audio")
    return wave


def _resample(wave: np.ndarray, rate: int, target: int) -> np.ndarray:
    if rate == target:
        return wave
    from mlx_audio.utils import resample_audio

    return np.asarray(resample_audio(wave, rate, target), dtype=np.float32)


def load_audio(source: AudioInput, index: int, sample_rate: int) -> np.ndarray:
    """One audio clip -> float32 mono samples at ``sample_rate`` (see the module docstring). Raises
    ``MediaError`` naming ``audio index``."""
    if isinstance(source, tuple):
        if len(source) != 2:
            raise MediaError(index, "want (samples, sample_rate)", "audio")
        samples, rate = source
        if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or rate <= 0:
            raise MediaError(index, f"sample rate must be a positive integer, got {rate!r}", "audio")
        arr = np.asarray(samples)
        if not np.issubdtype(arr.dtype, np.floating):
            raise MediaError(index, f"samples of dtype {arr.dtype}: want floats in [-1, 1]", "audio")
        if arr.ndim == 2:
            arr = arr.mean(axis=1)  # (samples, channels) -> mono, as mlx-vlm downmixes files
        arr = _check_waveform(arr, index, f"{arr.shape[0] if arr.ndim else 0} samples at {rate} Hz")
        return _check_waveform(_resample(arr, int(rate), sample_rate), index, "after resampling")
    if isinstance(source, np.ndarray):
        raise MediaError(index, "a bare array has no sample rate: pass (samples, sample_rate)", "audio")
    if isinstance(source, str) and source.startswith(("http://", "https://")):
        raise RemoteMedia(index, "remote URLs are not fetched; pass the audio bytes or a file path", "audio")
    from mlx_vlm.utils import load_audio as vlm_load_audio

    if isinstance(source, (bytes, bytearray, memoryview)):
        import io

        data = bytes(source)
        if not data:
            raise MediaError(index, "empty audio data (bytes)", "audio")
        what, target = f"{len(data)} bytes", io.BytesIO(data)
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source)
        what = describe_source(source)
        if not path.exists():
            raise MediaError(index, f"file not found: {what}", "audio")
        if not path.is_file():
            raise MediaError(index, f"not a regular file: {what}", "audio")
        if path.stat().st_size == 0:
            raise MediaError(index, f"empty file: {what}", "audio")
        target = str(path)
    else:
        raise MediaError(index, f"unsupported audio type {type(source).__name__} "
                                "(want a file path, bytes, or (samples, sample_rate))", "audio")
    try:
        wave = vlm_load_audio(target, sr=sample_rate)
    except Exception as exc:
        raise MediaError(index, f"not readable audio ({what}): {type(exc).__name__}: {exc}", "audio") from exc
    return _check_waveform(wave, index, what)




# ================================================================================================
# images
# ================================================================================================

ImageInput = Any  # PIL.Image.Image | str | os.PathLike | bytes | bytearray | memoryview | a data:image URL


def load_image(source: ImageInput, index: int) -> Any:
    """Decode one image fully (a truncated file fails here, not later) into RGB, with EXIF orientation applied
    the way ``mlx_vlm.utils.load_image`` does. Raises ``MediaError`` naming ``index``."""
    from PIL import Image, ImageOps

    if isinstance(source, Image.Image):
        image = source
    else:
        data = _read_source(source, index)
        if not data:
            raise MediaError(index, f"empty image data ({describe_source(source)})")
        try:
            image = Image.open(io.BytesIO(data))
        except Exception as exc:
            raise MediaError(index, f"not a readable image ({describe_source(source)}): {type(exc).__name__}: {exc}") from exc
    try:
        image.load()  # force a full decode: truncated / corrupt data raises here
        width, height = image.size
        if width <= 0 or height <= 0:
            raise MediaError(index, f"zero-size image ({width}x{height})")
        image = ImageOps.exif_transpose(image)
        image = image.convert("RGB")
    except MediaError:
        raise
    except Exception as exc:
        raise MediaError(index, f"cannot decode image ({describe_source(source)}): {type(exc).__name__}: {exc}") from exc
    if image.width <= 0 or image.height <= 0:
        raise MediaError(index, f"zero-size image ({image.width}x{image.height})")
    return image


def _data_url_bytes(url: str, kind: str, index: int) -> bytes:
    """The payload of a ``data:<kind>/...;base64,`` URL."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith(f"data:{kind}/") or ";base64" not in head:
        raise MediaError(index, f"unsupported data URI (want data:{kind}/...;base64,...)", kind)
    try:
        return base64.b64decode(payload, validate=True)
    except Exception as exc:
        raise MediaError(index, f"bad base64 in data URI: {exc}", kind) from exc


def _read_source(source: Any, index: int) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if isinstance(source, str) and source.startswith("data:"):
        return _data_url_bytes(source, "image", index)
    if isinstance(source, str) and source.startswith(("http://", "https://")):
        raise RemoteMedia(index, "remote URLs are not fetched; pass the image bytes, a file path, a data: URL or "
                                 "a PIL image")
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            if not path.exists():
                raise MediaError(index, f"file not found: {describe_source(source)}")
            if not path.is_file():
                raise MediaError(index, f"not a regular file: {describe_source(source)}")
            return path.read_bytes()
        except MediaError:
            raise
        except OSError as exc:
            raise MediaError(index, f"cannot read {describe_source(source)}: {exc}") from exc
    raise MediaError(index, f"unsupported image type {type(source).__name__} "
                            "(want PIL.Image, a file path, bytes or a data:image URI)")


__all__ = ["AudioInput", "ImageInput", "MediaError", "MediaLimit", "RemoteMedia", "VideoFrames", "describe_source", "load_audio", "load_image",
           "load_video", "sample_frame_indices", "sampling_rate", "spread_indices", "validate_video_sampling"]
