"""Image inputs of chat requests: ``data:`` URLs decoded with Pillow, checked, resized.

Only inline images are served: a remote URL (``http://``, ``https://``, anything but
``data:``) is refused, since the server fetches nothing from the network.  What is
refused, and why, is an ``ImageError`` whose message the server returns as a 400 naming
the content part:

- a URL that is not a ``data:`` URL, or one that is not base64 (``;base64,``);
- a media type other than ``image/png`` or ``image/jpeg``, or bytes that are neither;
- base64 that does not decode;
- dimensions over ``MAX_IMAGE_SIDE`` per side or ``MAX_IMAGE_PIXELS`` in all, read from
  the header before any pixel is decoded (a decompression bomb never expands);
- a truncated or corrupt file (Pillow's decoder fails while loading the pixels).

An accepted image becomes RGB, resized to the encoder's square input (bilinear), as
``uint8 [S, S, 3]``; its key is the SHA-256 of those pixels, so the encoder cache hits
for one picture sent twice, whatever its file encoding.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings
from dataclasses import dataclass

import numpy as np

MAX_IMAGE_SIDE = 8192
MAX_IMAGE_PIXELS = 1 << 24  # 16.8 MP
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG"}


class ImageError(ValueError):
    """An image input the server refuses; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class DecodedImage:
    pixels: np.ndarray  # uint8 [S, S, 3]
    key: str  # sha256 hex of the pixels
    width: int  # the original size
    height: int


def split_data_url(url: str) -> tuple[str, bytes]:
    """``data:image/png;base64,....`` -> (media type, bytes)."""
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else ""
        what = f"a remote '{scheme}:' URL" if scheme in ("http", "https", "ftp", "file") else "not a data: URL"
        raise ImageError(f"{what}; refstack fetches nothing from the network: send the image inline as "
                         "'data:image/png;base64,...' or 'data:image/jpeg;base64,...'")
    head, sep, payload = url[5:].partition(",")
    if not sep:
        raise ImageError("the data: URL has no ',' before its payload")
    params = head.split(";")
    media = params[0].strip().lower()
    if "base64" not in [p.strip().lower() for p in params[1:]]:
        raise ImageError("the data: URL is not base64-encoded (expected ';base64,')")
    if media not in MEDIA_TYPES:
        raise ImageError(f"media type {media or '(none)'!r} is not an image refstack decodes; "
                         "send image/png or image/jpeg")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"the data: URL's base64 payload does not decode: {exc}") from None
    if not raw:
        raise ImageError("the data: URL's payload is empty")
    return media, raw


def decode_image(url: str, size: int) -> DecodedImage:
    """The image of a ``data:`` URL as encoder input; ``ImageError`` for anything refused."""
    from PIL import Image, UnidentifiedImageError

    media, raw = split_data_url(url)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(raw), formats=["PNG", "JPEG"])
        except UnidentifiedImageError:
            raise ImageError(f"the payload is not a PNG or JPEG image (declared {media})") from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise ImageError(f"the image's dimensions are too large ({exc}); refstack takes at most "
                             f"{MAX_IMAGE_SIDE} pixels a side and {MAX_IMAGE_PIXELS} in all") from None
        except (OSError, ValueError) as exc:
            raise ImageError(f"the image cannot be read: {exc}") from None
        w, h = img.size
        if w < 1 or h < 1 or w > MAX_IMAGE_SIDE or h > MAX_IMAGE_SIDE or w * h > MAX_IMAGE_PIXELS:
            raise ImageError(f"the image is {w}x{h}; refstack takes at most {MAX_IMAGE_SIDE} pixels a side and "
                             f"{MAX_IMAGE_PIXELS} in all")
        if MEDIA_TYPES[media] != img.format:
            raise ImageError(f"the payload is a {img.format} image but the data: URL says {media}")
        try:
            img.load()  # decodes the pixels: a truncated or corrupt file fails here
            rgb = img.convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
        except (OSError, ValueError, SyntaxError) as exc:
            raise ImageError(f"the {img.format} image is truncated or corrupt: {exc}") from None
    pixels = np.asarray(rgb, dtype=np.uint8).copy()
    return DecodedImage(pixels, hashlib.sha256(pixels.tobytes()).hexdigest(), w, h)


def encode_png(pixels: np.ndarray) -> bytes:
    """PNG bytes of uint8 ``[H, W, 3]`` pixels (the benchmark's and the tests' images)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def data_url(png: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(png).decode('ascii')}"
