"""Token ids to text for a served request: incremental detokenization (text is released only
once it is final: no half of a multi-byte character) and stop strings (the text ends before the
first one, and generation stops at the token that completed it).

The text is the tokenizer's decode of the whole output (``skip_special_tokens``), and both work
on the new tokens only: in the common case a round's cost does not grow with the output. Each
new token is decoded in a window of the few tokens before it (:class:`IncrementalText`), and a
stop string is looked for in the text the token changed plus the ``max(len(stop)) - 1``
characters before it (a stop string that the new token completes starts there at the
earliest)."""
from __future__ import annotations

import collections
import contextlib
import os
import weakref

# a token whose text is not final (it ends in part of a multi-byte character) waits for the next
# ones; after this many tokens (not counting special tokens) the text is released as it decodes
# (replacement characters stay)
MAX_PENDING = 8
# characters of text the window holds before a new token: the context a decoder uses (the
# leading space a SentencePiece decoder strips from the first word only; the space a clean-up of
# tokenization spaces removes before punctuation or a contraction, up to REWRITE_CHARS back)
CONTEXT_CHARS = 4
# characters a stream holds back when the tokenizer cleans up tokenization spaces: a later token
# may remove a space among them (" ," -> ","; " ' " -> "'" then " 'm" -> "'m": 4 characters back)
REWRITE_CHARS = 4


class IncrementalText:
    """The text of a growing list of token ids, as ``decode(ids[:fed])`` has it, extended a token
    at a time.

    The new tokens' text is the decode of a window, the tokens of the last releases then the new
    ones, minus the decode of the window without the new ones. The window keeps the fewest
    latest releases that hold ``CONTEXT_CHARS`` characters (all of them while there are fewer),
    so it starts with text once there is some: a window that started with tokens without text
    would decode the next word as the first of a text (a SentencePiece decoder strips its
    leading space). Tokens the decode drops wherever they stand (``skipped``: special tokens) are
    left out of it: they change no text. A step thus decodes two windows of a few tokens,
    whatever the length of the list.

    When the window's decode with the new tokens does not begin with its decode without them (a
    decoder that changes earlier text: a clean-up that removes the space before a comma), the
    window is not trusted for that step: the whole list is decoded and compared with the text
    released so far (the output's length in cost, for a token that changes earlier text: rare).
    So a step may replace the end of the released text: it gives ``(back, new, final)``, the
    text's last ``back`` characters are replaced by ``new``. Text that ends in a replacement
    character (part of a multi-byte character) is not final (``final`` False) while fewer than
    ``MAX_PENDING`` tokens wait: the next step may still change it."""

    def __init__(self, decode, skipped: frozenset[int] = frozenset()):
        self.decode = decode
        self.skipped = skipped  # ids the decode drops wherever they stand
        self.fed = 0  # tokens fed
        self._new: list[int] = []  # the tokens fed since the last release (not skipped): their text is not final
        self._groups = collections.deque()  # (tokens, characters) of the releases in the window, oldest first
        self._context = 0  # characters of the releases in the window
        self._pieces: list[str] = []  # the released text, a piece per release
        self.length = 0  # characters of the released text
        self._pending = (0, "")  # (back, text) of the tokens fed since the last release
        self._changed = 0  # the first character the last step changed (of the text with the pending part)

    def step(self, ids: list[int]) -> tuple[int, str, bool]:
        """Feed ``ids[self.fed]``: ``(back, new, final)``, the text of the tokens fed since the
        last release replaces the released text's last ``back`` characters. Final text is
        released; text that is not may still change with the next token."""
        token = ids[self.fed]
        self.fed += 1
        if token in self.skipped:  # the text is unchanged
            return (*self._pending, not self._new)
        length, held_back = self.length, self._pending[0]
        self._new.append(token)
        window = [t for tokens, _ in self._groups for t in tokens]
        before, now = self.decode(window), self.decode(window + self._new)
        back, new = (0, now[len(before):]) if now.startswith(before) else self._from_start(ids)
        self._changed = length - max(back, held_back)
        if new.endswith("\ufffd") and len(self._new) < MAX_PENDING:
            self._pending = (back, new)
            return back, new, False
        self._pending = (0, "")
        self._replace(back, new)
        self._advance(len(new))
        return back, new, True

    def _from_start(self, ids: list[int]) -> tuple[int, str]:
        """(back, new) from the decode of the whole list against the released text."""
        released, full = "".join(self._pieces), self.decode(ids[: self.fed])
        same = len(os.path.commonprefix([released, full]))
        return len(released) - same, full[same:]

    def _replace(self, back: int, new: str) -> None:
        """Drop the released text's last ``back`` characters, then append ``new``."""
        self.length += len(new) - back
        while back:
            last = self._pieces.pop()
            if len(last) > back:
                self._pieces.append(last[: len(last) - back])
            back = max(0, back - len(last))
        if new:
            self._pieces.append(new)

    def _advance(self, chars: int) -> None:
        """The new tokens released ``chars`` characters: the window keeps the latest releases
        that hold ``CONTEXT_CHARS`` characters."""
        self._groups.append((self._new, chars))
        self._new = []
        self._context += chars
        while len(self._groups) > 1 and self._context - self._groups[0][1] >= CONTEXT_CHARS:
            self._context -= self._groups.popleft()[1]

    def tail(self, n: int) -> str:
        """The released text's last ``n`` characters (fewer when it is shorter)."""
        out, got = [], 0
        for piece in reversed(self._pieces):
            if got >= n:
                break
            out.append(piece)
            got += len(piece)
        text = "".join(reversed(out))
        return text[len(text) - min(n, len(text)):]

    def recent(self, extra: int) -> str:
        """The text of the tokens fed (the part that is not final included), from ``extra``
        characters before the first one the last step changed."""
        back, pending = self._pending
        t = self.tail(self.length - max(0, self._changed - extra))
        return t[: len(t) - back] + pending

    def extend(self, ids: list[int]) -> tuple[int, str]:
        """Feed every token of ``ids`` not fed yet: ``(back, new)``, the final text they released
        replaces the last ``back`` characters of the text released before."""
        back, out = 0, ""
        while self.fed < len(ids):
            b, new, final = self.step(ids)
            if final:
                back += max(0, b - len(out))
                out = out[: max(0, len(out) - b)] + new
        return back, out


_DROPPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # dropped_ids of each tokenizer


def dropped_ids(tok) -> frozenset[int]:
    """The ids ``tok.decode(ids, skip_special_tokens=True)`` drops wherever they stand: its
    special tokens (added tokens marked special, each checked to decode to nothing; once per
    tokenizer)."""
    with contextlib.suppress(KeyError, TypeError):
        return _DROPPED[tok]
    added = getattr(tok, "added_tokens_decoder", None) or {}
    ids = frozenset(i for i, t in added.items()
                    if getattr(t, "special", False) and tok.decode([i], skip_special_tokens=True) == "")
    with contextlib.suppress(TypeError):  # a tokenizer without weak references: checked again next time
        _DROPPED[tok] = ids
    return ids


class TextTracker:
    """Tracks one request's generated tokens. ``stop``: stop strings (OpenAI semantics: the
    returned text ends before the first occurrence; it is not included).

    :meth:`stop_cut` runs on the scheduler thread and :meth:`delta` on the server's event loop:
    each keeps its own decoding state."""

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tok = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # characters that may begin a stop string
        # characters a stream holds back: a later token's clean-up of tokenization spaces may
        # change the last few, and a stop string may begin ``hold`` characters before a change
        rewrites = REWRITE_CHARS if getattr(tokenizer, "clean_up_tokenization_spaces", False) else 0
        self._stream_hold = self.hold + rewrites
        self._skipped = dropped_ids(tokenizer)
        self._cut = IncrementalText(self.decode, self._skipped)
        self._stream = IncrementalText(self.decode, self._skipped)
        self._unsent = ""  # text decoded for delta, not released yet
        self._quiet = False  # delta releases nothing more before the request finishes
        self._sent: list[str] = []  # the text released so far
        self.sent = 0  # its characters

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def stop_cut(self, ids: list[int]) -> int | None:
        """How many of ``ids`` to keep when their text contains a stop string (the shortest prefix
        whose text does), else None. Called by the engine after each round with the row's tokens
        so far (the previous call's plus the round's); only the new ones are decoded."""
        if not self.stop:
            return None
        if len(ids) < self._cut.fed:  # not an extension of what was checked: start over
            self._cut = IncrementalText(self.decode, self._skipped)
        while self._cut.fed < len(ids):
            self._cut.step(ids)
            # a stop string the new token completed overlaps the text it changed
            window = self._cut.recent(self.hold)
            if any(s in window for s in self.stop):
                return self._cut.fed
        return None

    def final_text(self, ids: list[int], stopped: bool) -> str:
        """The whole text of ``ids``, cut before the first stop string."""
        return self._before_stop(self.decode(ids))

    def _before_stop(self, text: str) -> str:
        """``text`` up to its first stop string."""
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return text[: min(hits)] if hits else text

    def delta(self, ids: list[int], finished: bool) -> str:
        """New text since the last call. Until the request finishes, text that may still change
        is held back: a partial multi-byte character and, with stop strings, the last
        ``max(len(stop)) - 1`` characters (they may begin a stop string), plus ``REWRITE_CHARS``
        with a tokenizer that cleans up tokenization spaces. The last call releases the rest of
        :meth:`final_text`."""
        if finished:
            return self._release_rest(ids)
        if self._quiet:
            return ""
        back, new = self._stream.extend(ids)
        if back > len(self._unsent):  # text already sent changed: nothing after it fits
            self._quiet = True
            return ""
        text = self._unsent[: len(self._unsent) - back] + new  # the unsent text is at most a hold's characters
        cut = self._before_stop(text)
        self._quiet = len(cut) < len(text)  # the engine ends the request at this round's stop string
        out = cut if self._quiet else cut[: max(len(cut) - self._stream_hold, 0)]
        self._unsent = cut[len(out):]
        return self._send(out)

    def _release_rest(self, ids: list[int]) -> str:
        """The rest of :meth:`final_text` after the text released so far. The released text is a
        prefix of it (the text held back covers what a later token may change); were it not,
        no text after it would be consistent with it, and nothing more is released."""
        final, sent = self.final_text(ids, True), "".join(self._sent)
        return self._send(final[len(sent):] if final.startswith(sent) else "")

    def _send(self, out: str) -> str:
        if out:
            self._sent.append(out)
            self.sent += len(out)
        return out
