"""What makes an API token guessable: the rules ``outbox serve`` checks its tokens by and
``outbox token`` generates by. Pure: no web framework, no I/O."""

from __future__ import annotations

import itertools

#: Shortest token accepted: 32 characters (`outbox token` gives 43, `openssl rand -hex 32` 64).
MIN_TOKEN_LENGTH = 32
#: Longest token accepted (a bearer header is a line of an HTTP request).
MAX_TOKEN_LENGTH = 512
#: Fewest distinct characters in a token: 32 random hex digits hold 10 or fewer with a
#: probability of about 1e-4 (`outbox token`'s 43 base64url characters: none in 100,000 tries).
MIN_DISTINCT_CHARACTERS = 10
#: A token whose neighbouring characters mostly repeat or count up or down is a pattern.
MAX_PATTERN_SHARE = 0.5
#: Placeholders of the deploy examples and documentation: never real tokens.
PLACEHOLDERS = ("change-me", "changeme", "replace-me", "example", "token", "secret", "password")


def token_weakness(token: str) -> str | None:
    """Why ``token`` can be guessed (or is no token), or None: a placeholder, under 32 or over
    512 characters, under 10 distinct characters, a third of it twice (``Pass-2026-Pass-2026``),
    or mostly neighbours that repeat or count by one (``aaaa...``, ``1234...``, ``abcd...``).
    The reason never quotes the token."""
    value = token.strip()
    if any(value.lower().startswith(p) for p in PLACEHOLDERS):
        return "is a documented placeholder, not a secret"
    if len(value) < MIN_TOKEN_LENGTH:
        return f"is shorter than {MIN_TOKEN_LENGTH} characters"
    if len(value) > MAX_TOKEN_LENGTH:
        return f"is longer than {MAX_TOKEN_LENGTH} characters"
    if len(set(value)) < MIN_DISTINCT_CHARACTERS:
        return f"has fewer than {MIN_DISTINCT_CHARACTERS} distinct characters"
    stretch = -(-len(value) // 3)
    seen = {value[i : i + stretch] for i in range(len(value) - stretch + 1)}
    if len(seen) < len(value) - stretch + 1:
        return "holds a stretch of a third of its length twice"
    steps = [ord(b) - ord(a) for a, b in itertools.pairwise(value)]
    if sum(abs(step) <= 1 for step in steps) > MAX_PATTERN_SHARE * len(steps):
        return "is mostly repeated or counting characters"
    return None
