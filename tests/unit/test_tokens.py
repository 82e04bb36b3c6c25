"""The rules a token is checked by at start-up (issue 48, Medium 1): what they refuse, and that
random tokens pass them."""

from __future__ import annotations

import base64
import random

import pytest

from app.tokens import token_weakness


@pytest.mark.parametrize(
    ("token", "why"),
    [
        ("aaaaaaaaaaaaaaaa", "shorter than 32"),
        ("Operator-Pass-2026", "shorter than 32"),
        ("x" * 513, "longer than 512"),
        ("ab" * 20, "fewer than 10 distinct"),
        ("Operator-Pass-2026-Operator-Pass-2026", "a third of its length twice"),
        ("1234567890" * 4, "a third of its length twice"),
        ("abcdefghijklmnopqrstuvwxyz0123456789", "mostly repeated or counting"),
        ("CHANGE-ME-operator-Qv8Lm3Tz6Xc1Kw9Bn4Hd7Rp2Gy5Fs0", "placeholder"),
    ],
)
def test_a_guessable_token_is_refused_with_its_reason(token: str, why: str) -> None:
    reason = token_weakness(token)
    assert reason is not None and why in reason and token not in reason


def test_random_tokens_pass() -> None:
    rng = random.Random(48)
    for _ in range(2000):
        raw = rng.randbytes(32)
        assert token_weakness(base64.urlsafe_b64encode(raw).decode().rstrip("=")) is None
        assert token_weakness(rng.randbytes(24).hex()) is None
