"""Token ids to text for a served request: incremental detokenization (text is released only
once it is final: no half of a multi-byte character) and stop strings (the text ends before the
first one, and generation stops at the token that completed it).

Both work on the new tokens only: a round's cost does not grow with the output. Each new token
is decoded in a window of the few tokens before it (:class:`IncrementalText`), and a stop string
is looked for in the new text plus the ``max(len(stop)) - 1`` characters before it (a stop
string that ends in the new text starts there at the earliest)."""
from __future__ import annotations

# a token whose text is not final (it ends in part of a multi-byte character) waits for the next
# ones; after this many tokens the text is released as it decodes (replacement characters stay)
MAX_PENDING = 8
CONTEXT = 4  # tokens kept before a token when only tokens without text (special tokens) came since


class IncrementalText:
    """The text of a growing list of token ids, extended a token at a time.

    A token's text is the decode of the window ``ids[prefix:j + 1]`` minus the decode of
    ``ids[prefix:read]`` (the tokens before it give the context a tokenizer needs, e.g. the
    leading space of a SentencePiece word); it is released once it does not end in a replacement
    character. Each step decodes two windows of a few tokens, whatever the length of the list."""

    def __init__(self, decode):
        self.decode = decode
        self.prefix = 0  # first token of the context window
        self.read = 0  # tokens whose text has been released
        self.fed = 0  # tokens fed (read <= fed: the ones after read wait for the rest of a character)

    def step(self, ids: list[int]) -> tuple[str, bool]:
        """Feed ``ids[self.fed]``: (the text of the tokens fed since the last release, whether it
        is final). Final text is released ("" for a token without text); text that is not (it
        ends in a replacement character) may still change with the next token."""
        self.fed += 1
        before = self.decode(ids[self.prefix: self.read])
        now = self.decode(ids[self.prefix: self.fed])
        new = now[len(before):]
        if now.endswith("\ufffd") and self.fed - self.read < MAX_PENDING:
            return new, False
        # the next token's context: the tokens that released this text; after tokens without
        # text (special tokens), the last few tokens
        self.prefix = self.read if new else max(self.prefix, self.fed - CONTEXT)
        self.read = self.fed
        return new, True

    def extend(self, ids: list[int]) -> str:
        """Feed every token of ``ids`` not fed yet; returns the text they released."""
        out = []
        while self.fed < len(ids):
            new, final = self.step(ids)
            if final:
                out.append(new)
        return "".join(out)


class TextTracker:
    """Tracks one request's generated tokens. ``stop``: stop strings (OpenAI semantics: the
    returned text ends before the first occurrence; it is not included).

    :meth:`stop_cut` runs on the scheduler thread and :meth:`delta` on the server's event loop:
    each keeps its own decoding state."""

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tok = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # characters that may begin a stop string
        self._cut = IncrementalText(self.decode)
        self._tail = ""  # the last ``hold`` characters of the text stop_cut has checked
        self._stream = IncrementalText(self.decode)
        self._unsent = ""  # text decoded for delta, not released yet
        self._stopped = False  # delta saw a stop string: nothing after it is released
        self.sent = 0  # characters of the text released so far

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def stop_cut(self, ids: list[int]) -> int | None:
        """How many of ``ids`` to keep when their text contains a stop string (the shortest prefix
        whose text does), else None. Called by the engine after each round with the row's tokens
        so far (the previous call's plus the round's); only the new ones are decoded."""
        if not self.stop:
            return None
        if len(ids) < self._cut.fed:  # not an extension of what was checked: start over
            self._cut, self._tail = IncrementalText(self.decode), ""
        while self._cut.fed < len(ids):
            new, final = self._cut.step(ids)
            window = self._tail + new  # the text of these tokens as a whole decode has it, even if not final
            if any(s in window for s in self.stop):
                return self._cut.fed
            if final:
                self._tail = window[max(0, len(window) - self.hold):] if self.hold else ""
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
        ``max(len(stop)) - 1`` characters (they may begin a stop string). The last call releases
        the rest of :meth:`final_text`."""
        if finished:
            out = self.final_text(ids, True)[self.sent:]
            self.sent += len(out)
            return out
        if self._stopped:
            return ""
        text = self._unsent + self._stream.extend(ids)  # the unsent text is at most ``hold`` characters
        cut = self._before_stop(text)
        self._stopped = len(cut) < len(text)  # the engine ends the request at this round's stop string
        out = cut if self._stopped else cut[: max(len(cut) - self.hold, 0)]
        self._unsent = cut[len(out):]
        self.sent += len(out)
        return out
