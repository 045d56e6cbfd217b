"""A store's URL as chunkq shows it: never its password, in a summary, a log line or an error."""

from __future__ import annotations

import re

_PASSWORD_IN_QUERY = re.compile(r"(?i)((?:^|[?&;])password=)[^&;]*")


def redacted(url: str) -> str:
    """``url`` as every message, summary and log line shows it: no password, neither the one in its
    user part (``postgresql://u:SECRET@h/db``) nor one in its query (``?password=SECRET``)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    where, slash, tail = rest.partition("/")
    user, at, host = where.rpartition("@")
    name, _, password = user.partition(":")
    if at and password:
        where = f"{name}:***@{host}"
    return _PASSWORD_IN_QUERY.sub(r"\1***", f"{scheme}://{where}{slash}{tail}")


def redacted_text(text: str, url: str) -> str:
    """``text`` with ``url``'s password taken out wherever a client's message repeated it."""
    for secret in _secrets(url):
        text = text.replace(secret, "***")
    return text


def _secrets(url: str) -> list[str]:
    from urllib.parse import parse_qs, unquote, urlsplit

    try:
        parts = urlsplit(url)
        found = [parts.password] if parts.password else []
        found += parse_qs(parts.query).get("password", [])
    except ValueError:
        return []
    return [s for s in found + [unquote(s) for s in found] if s]
