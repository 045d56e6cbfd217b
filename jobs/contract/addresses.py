"""How an address a user gives (``--redis-url``, ``--to``, a store URL) is shown: as the library that
connects reads it, with its password masked, and nothing of a value that library cannot read.

A hostile pass pasted ten malformed forms of Redis and PostgreSQL URLs (a password with an unencoded
"/", "@", "#", "?", a space or "%"; a user name with "@"; libpq's keyword strings; the password in
the query) and each printed the password somewhere: a regular expression cannot know where a
malformed URL's password ends, and a client's own parse error quotes what it could not read
(libpq: ``... in URI: "postgresql://u:PW@[::1:1/db"``; redis-py: ``Port could not be cast to
integer value as 'PW'``). So an address is parsed by the connecting library itself: redis-py's
``parse_url`` for ``redis://``, ``rediss://`` and ``unix://``, libpq's (through psycopg) for
``postgresql://`` and keyword strings. What parses is shown rebuilt from its parts, the password
masked, and the password is remembered (``redaction.remember``) so that no later line repeats it;
what does not parse is shown as its scheme and ``…`` only, never with the client's message. Any
other URL shows everything between ``//`` and its last ``@`` masked.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import quote

from chunkq.jobs.contract.masking import MASK, redact, remember_secret

REDIS_SCHEMES = ("redis", "rediss", "unix")
POSTGRES_SCHEMES = ("postgresql", "postgres")
HIDDEN = "..."  # ASCII: a terminal of any encoding shows it
_SECRET_KEYS = ("password", "sslpassword")  # libpq's keywords whose values are secrets
# a secret keyword's value as written, up to the next "key=" (a space in it, unquoted, is unreadable)
_KEYWORD_SECRET = re.compile(
    r"\b(password|sslpassword)\s*=\s*('(?:[^'\\]|\\.)*'|.*?)(?=\s+[A-Za-z_]+\s*=|\s*$)"
)
_QUERY_SECRET = re.compile(r"[?&](password|sslpassword)=(.*?)(?=&[A-Za-z_]+=|#|$)")
_TABLE = re.compile(r"([?&])table=([^&#]*)&?")  # chunkq's own parameter of a pgvector URL


def scheme_and_rest(value: str) -> tuple[str, str, str]:
    """(scheme, "://" or ":", the rest); ("", "", value) for a value with no scheme. A scheme is
    two letters or more: ``C:\\`` is a drive."""
    found = re.match(r"([A-Za-z][A-Za-z0-9+.-]+)(://|:)", value)
    if found is None:
        return "", "", value
    return found.group(1).lower(), found.group(2), value[found.end() :]


def scheme_of(value: str) -> str:
    return scheme_and_rest(value)[0]


def keyword_form(value: str) -> bool:
    """libpq's ``key=value ...`` form (no scheme)."""
    return not scheme_of(value) and re.match(r"\s*[A-Za-z_]+\s*=", value) is not None


def parse_redis(url: str) -> dict[str, Any] | None:
    """redis-py's reading of ``url``, or None where it cannot read it."""
    from redis.connection import ConnectionPool, parse_url

    try:
        parsed = dict(parse_url(url))  # type: ignore[no-untyped-call]
        # Every query parameter becomes a keyword of the connection: one it does not take failed only
        # at the first command, as a TypeError that named it (a password's unencoded "&" made one).
        ConnectionPool.from_url(url).make_connection()
    except (ValueError, TypeError):
        return None
    if not _plain_host(str(parsed.get("host") or "")) or "@" in str(parsed.get("path") or ""):
        return None  # what a password's stray "@" or "/" left in the host, or in a socket's path
    netloc = _redis_netloc(url)
    if netloc.count("[") != netloc.count("]"):
        return None  # "[::1]]": its client drops the stray bracket and reads another address
    query = url.partition("?")[2].partition("#")[0]
    if any("=" not in piece for piece in query.split("&") if piece):
        return None  # a piece its client drops: the rest of a password's unencoded "&"
    return parsed


def split_table(url: str) -> tuple[str, str | None]:
    """A pgvector URL as libpq reads it, and chunkq's ``table`` parameter, taken from the query of
    the part after the last "@" (a password may hold anything)."""
    head, at, tail = url.rpartition("@")
    found = _TABLE.search(tail)
    if found is None:
        return url, None
    rest = tail[: found.start()] + (found.group(1) if tail[found.end() :] else "") + tail[found.end() :]
    return head + at + rest.rstrip("?&"), found.group(2)


def parse_postgres(dsn: str) -> dict[str, str] | None:
    """libpq's reading of ``dsn`` (a URL or a keyword string), or None where it cannot read it."""
    try:
        from psycopg.conninfo import conninfo_to_dict
    except ImportError:
        return None
    try:
        parsed = {str(k): str(v) for k, v in conninfo_to_dict(dsn).items() if v is not None}
    except Exception:  # psycopg.ProgrammingError: its message quotes the value
        return None
    plain = _plain_host(parsed.get("host", "")) and re.fullmatch(r"[0-9,]*", parsed.get("port", ""))
    return parsed if plain else None


def redis_port_zero(url: str) -> bool:
    """Whether a readable Redis URL names port 0, which its client reads as no port (6379)."""
    return re.search(r":0+$", _redis_netloc(url)) is not None


def _redis_netloc(url: str) -> str:
    """A Redis URL's host and port as written: after the last "@" (a password may hold anything),
    before its path or query."""
    return url.partition("://")[2].partition("/")[0].partition("?")[0].rpartition("@")[2]


def _plain_host(host: str) -> bool:
    """Whether a parsed host is one a user meant: a password's unencoded "@" or ":" read as the
    start of the host leaves the rest of the password in it (``u:pa@ss@h``: host ``ss@h``)."""
    return re.fullmatch(r"[A-Za-z0-9._~%\-:\[\],/]*", host) is not None


def shown(value: str) -> str:
    """``value`` as a message shows it (see the module's docstring)."""
    scheme, sep, rest = scheme_and_rest(value)
    if scheme in REDIS_SCHEMES:
        parsed = parse_redis(value)
        if parsed is not None:
            return _redis_shown(scheme, parsed)
        _remember_unreadable(value, rest)
        return f"{scheme}{sep}{HIDDEN}"
    if scheme in POSTGRES_SCHEMES or keyword_form(value):
        dsn, table = split_table(value)
        parsed = parse_postgres(dsn)
        if parsed is None:
            _remember_unreadable(value, rest)
            return f"{scheme}{sep}{HIDDEN}" if scheme else HIDDEN
        return _postgres_shown(scheme, parsed, table)
    if sep != "://":  # "me:PW@host" is user and password, not a scheme "me"
        scheme, sep, rest = "", "", value
    if _remember_before_at(rest):
        return redact(f"{scheme}{sep}{MASK}@{rest.rpartition('@')[2]}")
    return redact(value)


def _remember_unreadable(value: str, rest: str) -> None:
    """The secrets an address its library could not read may hold, remembered: before an "@", a
    query's password up to the next parameter (an unencoded "&" in it), a keyword's up to the next
    keyword (an unquoted space in it)."""
    _remember_before_at(rest)
    for pattern in (_QUERY_SECRET, _KEYWORD_SECRET):
        for found in pattern.finditer(value):
            remember_secret(found.group(2).strip("'"))


def _remember_before_at(rest: str) -> bool:
    """Whether ``rest`` (an address less its scheme) holds an "@": then what comes before it is
    user:password, or a password alone where the scheme is missing or mistyped (``:PW@host``,
    ``redis//:PW@host``), remembered as a secret."""
    head, at, _ = rest.rpartition("@")
    secret = head.partition(":")[2] if ":" in head else head
    if at and secret:
        remember_secret(secret)
    return bool(at)


def _redis_shown(scheme: str, parsed: dict[str, Any]) -> str:
    password, user = parsed.get("password"), parsed.get("username")
    if password:
        remember_secret(str(password))
    named = quote(str(user or ""), safe="")
    # A user name alone is no login Redis accepts (AUTH needs a password), and ``redis://PW@host`` is
    # the usual slip for ``redis://:PW@host``: the password, shown as a user name in every error.
    who = f"{named}:{MASK}@" if password else (f"{MASK}@" if user else "")
    if scheme == "unix":
        return f"unix://{who}{parsed.get('path', '')}" + (f"?db={parsed['db']}" if parsed.get("db") else "")
    host = str(parsed.get("host") or "localhost")
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{who}{host}:{parsed.get('port', 6379)}/{parsed.get('db', 0)}"


def _postgres_shown(scheme: str, parsed: dict[str, str], table: str | None) -> str:
    for key in _SECRET_KEYS:
        if parsed.get(key):
            remember_secret(parsed[key])
    masked = {k: (MASK if k in _SECRET_KEYS else v) for k, v in parsed.items()}
    if not scheme or "," in masked.get("host", ""):  # several hosts: libpq's own keyword form says it best
        from psycopg.conninfo import make_conninfo

        return str(make_conninfo("", **masked)) + (f" table={table}" if table is not None else "")
    user, host, port = masked.pop("user", ""), masked.pop("host", ""), masked.pop("port", "")
    dbname, password = masked.pop("dbname", ""), masked.pop("password", "")
    who = f"{quote(user, safe='')}{':' + MASK if password else ''}@" if user or password else ""
    netloc_host = "" if host.startswith("/") else (f"[{host}]" if ":" in host else host)
    if host.startswith("/"):
        masked = {"host": host, **masked}
    query = "&".join(f"{k}={v}" for k, v in masked.items())
    query += ("&" if query else "") + (f"table={table}" if table is not None else "")
    address = f"{netloc_host}{':' + port if port else ''}"
    return f"{scheme}://{who}{address}/{quote(dbname, safe='')}" + (f"?{query}" if query else "")


def secrets_in(text: str) -> list[str]:
    """The passwords the connecting libraries read in ``text``, where it is an address they read."""
    found: list[str] = []
    scheme, _, rest = scheme_and_rest(text)
    if scheme in REDIS_SCHEMES:
        parsed = parse_redis(text)
        found += [str(parsed["password"])] if parsed and parsed.get("password") else []
        if parsed and parsed.get("username") and not parsed.get("password"):  # _redis_shown: a slip
            found.append(str(parsed["username"]))
    elif scheme in POSTGRES_SCHEMES or keyword_form(text):
        parsed_pg = parse_postgres(split_table(text)[0])
        found += [parsed_pg[k] for k in _SECRET_KEYS if parsed_pg and parsed_pg.get(k)]
    if scheme and "@" in rest:  # what follows the user name, up to the host: however malformed
        found.append(rest.rpartition("@")[0].partition(":")[2])
    if scheme in REDIS_SCHEMES or scheme in POSTGRES_SCHEMES or keyword_form(text):  # as written
        found += [m.group(2).strip("'") for p in (_QUERY_SECRET, _KEYWORD_SECRET) for m in p.finditer(text)]
    return [s for s in found if s]
