"""What a password is replaced by, and the passwords remembered to be masked wherever they appear:
the masks ``redaction.py`` (every line a process writes) and ``addresses.py`` (a URL as a message
shows it) both build on. See ``redaction.py`` for why."""

from __future__ import annotations

import re
from urllib.parse import unquote

MASK = "***"
MIN_REMEMBERED = 4
PLACEHOLDER = "PASSWORD"  # what messages and help write where the user's password goes
# scheme ":" ["//"] user ":" password "@": the password is everything up to the last "@" before a
# space, so one with an unencoded "/" or "@" is masked whole.
USER_PASSWORD = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*:(?://)?[^\s:/@?#]*:)([^\s]+)@(?=[^\s@]*(?:\s|$))")
QUERY_PASSWORD = re.compile(r"(?i)((?:^|[?&;\s])password=)[^&;\s]*")
_REMEMBERED: set[str] = set()


def remember_secret(secret: str) -> None:
    """Mask ``secret`` (a password as read) and the pieces a client may quote of it from now on."""
    pieces = [secret, unquote(secret), *re.split(r"[/@:?#&=\s%]", secret)]
    _REMEMBERED.update(p for p in pieces if len(p) >= MIN_REMEMBERED)


def redact(text: str) -> str:
    """``text`` with every URL's password and every remembered one replaced by ***."""
    if not text:
        return text
    text = USER_PASSWORD.sub(
        lambda m: m.group(0) if m.group(2) == PLACEHOLDER else f"{m.group(1)}{MASK}@", text
    )
    text = QUERY_PASSWORD.sub(lambda m: f"{m.group(1)}{MASK}", text)
    for secret in sorted(_REMEMBERED, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, MASK)
    return text
