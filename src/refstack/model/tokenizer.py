"""Byte-level tokenizer: ids 0-255 are bytes, a few special tokens follow.

Byte-level keeps the tokenizer exact and dependency-free: any text round-trips, and
the model's random weights do not care about a learned vocabulary.  "Any text" means
valid Unicode: a lone surrogate (U+D800-U+DFFF outside a pair, which JSON can spell as
``"\\ud800"``) has no UTF-8 bytes, and ``encode`` refuses it with ``UnencodableTextError``
rather than inventing a replacement.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Mapping, Sequence

SPECIAL_TOKENS: tuple[str, ...] = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
NUM_BYTES = 256


class UnencodableTextError(ValueError):
    """Text with a character UTF-8 cannot encode (a lone surrogate); ``index`` is its position."""

    def __init__(self, text: str, index: int) -> None:
        self.index = index
        self.char = text[index]
        super().__init__(f"lone surrogate U+{ord(self.char):04X} at index {index} is not valid Unicode "
                         "and has no UTF-8 encoding")


class StreamDecoder:
    """Turns ids into text one at a time, holding back incomplete UTF-8 sequences.

    A character of 2-4 bytes arrives as 2-4 tokens; emitting each byte on its own
    would stream replacement characters to the client.
    """

    __slots__ = ("_decoder",)

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """The text completed by this token ('' while a character is still partial)."""
        if 0 <= token_id < NUM_BYTES:
            return self._decoder.decode(bytes((token_id,)))
        return ""  # special or unused ids print nothing

    def feed_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.feed(t) for t in token_ids)

    def flush(self) -> str:
        """Whatever is left at the end of the stream (a dangling partial char becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)


class ByteTokenizer:
    """256 byte ids followed by the special tokens; ids beyond those are unused padding."""

    def __init__(self) -> None:
        self.special_ids: dict[str, int] = {tok: NUM_BYTES + i for i, tok in enumerate(SPECIAL_TOKENS)}
        self.bos_id = self.special_ids["<|bos|>"]
        self.eos_id = self.special_ids["<|eos|>"]
        self.pad_id = self.special_ids["<|pad|>"]
        self.im_start_id = self.special_ids["<|im_start|>"]
        self.im_end_id = self.special_ids["<|im_end|>"]

    @property
    def vocab_size(self) -> int:
        """Ids in use; a model's vocab may be larger (padded for nice matmul shapes)."""
        return NUM_BYTES + len(SPECIAL_TOKENS)

    @property
    def prompt_only_ids(self) -> tuple[int, ...]:
        """Special ids that frame a prompt and are never generated."""
        return (self.bos_id, self.pad_id, self.im_start_id)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a generation: plain end-of-sequence and end of a chat turn."""
        return (self.eos_id, self.im_end_id)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        # Special-token strings inside text stay plain bytes, so user text can never
        # forge a turn boundary.
        try:
            ids = list(text.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise UnencodableTextError(text, exc.start) from None
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the byte ids; special and unused ids are skipped."""
        return bytes(t for t in ids if 0 <= t < NUM_BYTES).decode("utf-8", errors="replace")

    def id_to_piece(self, token_id: int) -> str:
        if 0 <= token_id < NUM_BYTES:
            return f"<0x{token_id:02X}>"
        if token_id < self.vocab_size:
            return SPECIAL_TOKENS[token_id - NUM_BYTES]
        return f"<|unused_{token_id}|>"

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes a token stands for; None for special and unused ids."""
        return bytes((token_id,)) if 0 <= token_id < NUM_BYTES else None

    def token_text(self, token_id: int) -> str:
        """A token as one string, the way OpenAI's logprobs name tokens.

        An ASCII byte is its character; any other byte is only part of a UTF-8
        character, so it reads ``bytes:\\xNN`` (OpenAI's spelling for a partial
        character); special and unused ids read as their names.
        """
        if 0 <= token_id < 0x80:
            return chr(token_id)
        if token_id < NUM_BYTES:
            return f"bytes:\\x{token_id:02x}"
        return self.id_to_piece(token_id)

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder()

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """ChatML-like: ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message.

        With ``add_generation_prompt`` the open assistant header is appended so the
        model's next tokens are the reply.
        """
        ids = [self.bos_id]
        for i, msg in enumerate(messages):
            if "role" not in msg or "content" not in msg:
                raise ValueError(f"chat message {i}: expected keys 'role' and 'content', got {sorted(msg)}")
            ids.append(self.im_start_id)
            ids += self.encode(f"{msg['role']}\n{msg['content']}")
            ids.append(self.im_end_id)
            ids += self.encode("\n")
        if add_generation_prompt:
            ids.append(self.im_start_id)
            ids += self.encode("assistant\n")
        return ids
