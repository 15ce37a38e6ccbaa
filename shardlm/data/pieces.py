"""Long documents -> pieces whose tokens, concatenated, are exactly the tokens of the whole document.

Handing a tokenizer one 100 MB string costs memory in proportion to it (GPT-2's fast tokenizer peaks at
~1.8 GB on 10.8 MB) and runs on one core. So a document longer than `PIECE_CHARS` is cut, but only where
the cut cannot change the tokens: at a whitespace/non-whitespace boundary (or, failing that, a word/non-word
boundary) where the tokenizer itself agrees. The check tokenizes a window around the candidate cut whole and
in two halves: equal ids mean no token (pre-tokenizer split or BPE merge) crosses the cut, and since a
pre-tokenizer's context is local, the whole document splits there too. That holds for byte-level BPE
(GPT-2, Llama 3, Qwen), SentencePiece-style Metaspace and byte tokenizers alike without knowing which is
used. A text with no such cut in a whole piece (one "word" longer than a piece) is cut anyway, with a
warning: bounded memory wins over a few changed tokens at that one place.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator

PIECE_CHARS = 256 << 10  # a document longer than this is cut into pieces of about this size
WINDOW = 512  # characters each side of a candidate cut that the check tokenizes
TRIES = 8  # candidates checked per kind of boundary and span before falling back
SPANS = (2 << 10, 64 << 10)  # how far before the target cuts are looked for, near first
# before whitespace (`word| next`: right for byte-level BPE and SentencePiece alike), after it, then any
# word/non-word boundary (text without spaces, such as Chinese, cut at its punctuation)
BOUNDARIES = tuple(map(re.compile, (r"(?<=\S)(?=\s)", r"(?<=\s)(?=\S)", r"(?<=\w)(?=\W)|(?<=\W)(?=\w)")))

Encode = Callable[[list[str]], list[list[int]]]


def neutral(text: str, cut: int, encode: Encode) -> bool:
    """Whether cutting `text` at `cut` leaves the tokens of the window around it unchanged."""
    window = text[max(0, cut - WINDOW): cut + WINDOW]
    k = cut - max(0, cut - WINDOW)
    whole, left, right = encode([window, window[:k], window[k:]])
    return whole == left + right


def find_cut(text: str, target: int, encode: Encode, floor: int = 1) -> int | None:
    """A token-neutral cut in `(floor, target]`, as close to `target` as possible; None if none is found."""
    for span in SPANS:
        lo = max(floor, target - span)
        region = text[lo:target]
        for pattern in BOUNDARIES:
            candidates = [lo + m.start() for m in pattern.finditer(region)]
            for cut in reversed(candidates[-TRIES:]):
                if neutral(text, cut, encode):
                    return cut
    return None


def cut_documents(fragments: Iterator[tuple[str, bool]], encode: Encode, size: int = PIECE_CHARS,
                  name: str = "") -> Iterator[tuple[str, bool]]:
    """`(text, ends_document)` fragments, cut anywhere, -> pieces of at most `size` characters cut where
    the tokens do not change. Memory: one piece plus one fragment; a fragment of many pieces (a 50 MB
    CSV cell) is walked with an offset, not re-sliced after every piece."""
    buffer, start, warned = "", 0, False
    for text, end in fragments:
        buffer = buffer[start:] + text
        start = 0
        while len(buffer) - start > size:
            cut = find_cut(buffer, start + size, encode, floor=start + max(1, size // 2))
            if cut is None:
                cut = start + size
                if not warned:
                    warned = True
                    print(f"warning: {name}: a run of {size:,} characters with no word boundary where the "
                          "tokens would not change; cut there anyway (tokens at that cut may differ from "
                          "tokenizing the document whole)", file=sys.stderr)
            yield buffer[start:cut], False
            start = cut
        if end:
            yield buffer[start:], True
            buffer, start = "", 0
    if len(buffer) > start:
        yield buffer[start:], True
