"""Token ids to text for a served request: incremental detokenization (text is released only
once it is final: no half of a multi-byte character) and stop strings (the text ends before the
first one, and generation stops at the token that completed it)."""
from __future__ import annotations


class TextTracker:
    """Tracks one request's generated tokens. ``stop``: stop strings (OpenAI semantics: the
    returned text ends before the first occurrence; it is not included)."""

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tok = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.sent = 0  # characters of the text released so far

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def stop_cut(self, ids: list[int]) -> int | None:
        """How many of ``ids`` to keep when their text contains a stop string (the shortest prefix
        whose text does), else None. Called by the engine after each round."""
        if not self.stop or not any(s in self.decode(ids) for s in self.stop):
            return None
        lo = 1
        while lo < len(ids) and not any(s in self.decode(ids[:lo]) for s in self.stop):
            lo += 1
        return lo

    def final_text(self, ids: list[int], stopped: bool) -> str:
        """The whole text of ``ids``, cut before the first stop string."""
        text = self.decode(ids)
        if self.stop:
            hits = [text.find(s) for s in self.stop if s in text]
            if hits:
                text = text[: min(hits)]
        return text

    def delta(self, ids: list[int], finished: bool) -> str:
        """New text since the last call. Until the request finishes, text that may still change
        is held back: a trailing replacement character (a partial multi-byte token) and, with stop
        strings, the last ``max(len(stop)) - 1`` characters (they may begin a stop string)."""
        text = self.final_text(ids, finished)
        if not finished:
            if text.endswith("\ufffd"):
                text = text.rstrip("\ufffd")
            hold = max((len(s) for s in self.stop), default=1) - 1
            if hold:
                text = text[: max(len(text) - hold, self.sent)]
        out = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return out
