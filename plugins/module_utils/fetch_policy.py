# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""How model downloads talk HTTP: credentials, redirects, retries and what an error says.

Pure functions, no I/O; ``fetch`` makes the requests.

- **Credentials**: :func:`credential_headers` turns a bearer token (``Authorization: Bearer ...``, what
  Hugging Face takes) and extra headers into the headers of every request (HEAD, the header check's
  ranges, the download and its resumes), refusing what would break a request or leak a value into
  an error (a line break, a header the download sets itself). Messages name headers, never values.
- **Redirects**: :func:`sends_credentials` says whether a hop of a redirect chain gets them: only the
  configured URL's origin (scheme, host, port; an http to https upgrade of the same host included) and
  the hosts the user lists, never over a downgrade to plain http. Hugging Face answers a resolve URL
  with a redirect to a CDN whose signed URL needs no token, so the token stays with huggingface.co.
  :func:`redirect_target` refuses a redirect to anything but http(s).
- **Retries**: :func:`is_transient_status` and :func:`is_transient_error` decide what is worth another
  attempt (connection errors, timeouts, a dropped connection, HTTP 429 and 5xx); :func:`wait_before_retry`
  gives the wait (exponential backoff from the configured delay, or the server's ``Retry-After``,
  parsed by :func:`parse_retry_after`, up to :data:`RETRY_AFTER_MAX_S`) or refuses with the reason.
- **Messages**: :func:`status_problem` says what an HTTP error means and which setting to fix
  (:class:`Names` holds how settings are called: the module's options or the model role's variables);
  :func:`redact_url` prints a URL without its password or query string (signed URLs carry secrets there).
"""

from __future__ import annotations

import email.utils
import http.client
import re
import socket
import ssl
import urllib.error
import urllib.parse
from dataclasses import dataclass, fields
from datetime import timezone
from typing import Iterable, Mapping

# The longest Retry-After honoured; a server asking for more fails the download with its wish.
RETRY_AFTER_MAX_S = 300.0
# The longest wait of the exponential backoff (unless the configured delay is longer).
BACKOFF_MAX_S = 60.0
# An attempt that fetched this much before failing resets the count of failures in a row.
PROGRESS_RESETS_RETRIES = 1024 * 1024
MAX_REDIRECTS = 10
REDIRECT_STATUSES = (301, 302, 303, 307, 308)
# Headers the download sets itself (Range for resumes and header checks) or that only the client may set.
RESERVED_HEADERS = ("range", "host", "content-length", "transfer-encoding", "connection")
_FIELD_NAME_RE = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # RFC 9110 token
_DEFAULT_PORTS = {"http": 80, "https": 443}
_BEARER_RE = re.compile(r"^bearer(?:\s+|$)", re.IGNORECASE)


class RetryRefused(Exception):
    """No further attempt; the message says why (the retries are spent, the server asks to wait too long)."""


@dataclass(frozen=True)
class Names:
    """How messages name the settings to fix: the module's options by default, the model role's variables
    when it passes them (``files`` names the list, ``files[0].url`` one URL)."""

    files: str = "files"
    token: str = "token"
    headers: str = "headers"
    auth_redirect_hosts: str = "auth_redirect_hosts"
    retries: str = "retries"

    @classmethod
    def of(cls, files: str, labels: Mapping[str, str] | None) -> "Names":
        """Names from the module's ``label`` (for ``files``) and ``labels`` (the others); ValueError on an unknown key."""
        known = [f.name for f in fields(cls) if f.name != "files"]
        unknown = sorted(set(labels or {}) - set(known))
        if unknown:
            raise ValueError("labels: unknown key(s) %s; known: %s" % (", ".join(unknown), ", ".join(known)))
        return cls(files=files, **{key: str(value) for key, value in (labels or {}).items()})


# --- credentials and redirects ----------------------------------------------------------------------


def credential_headers(token: str | None, headers: Mapping[str, object] | None, names: Names = Names()) -> dict[str, str]:
    """The headers every request of a download carries: ``Authorization: Bearer <token>`` and ``headers``.

    A token given as ``Bearer <token>`` is taken as is. Raises ValueError naming the setting and the
    header (never a value) for a name that is not an HTTP field name, a value with a line break, a
    header the download sets itself, a list or mapping as a value, and an Authorization header
    given both ways.
    """
    result: dict[str, str] = {}
    for name, value in (headers or {}).items():
        where = "%s[%r]" % (names.headers, name)
        if not isinstance(name, str) or not _FIELD_NAME_RE.match(name):
            raise ValueError("%s: not an HTTP header name" % where)
        if name.lower() in RESERVED_HEADERS:
            raise ValueError("%s: the download sets this header itself; remove it" % where)
        if value is None or isinstance(value, (list, tuple, dict)):
            raise ValueError("%s: the value must be a string" % where)
        text = str(value).strip()
        if any(c in text for c in "\r\n\0"):
            raise ValueError("%s: the value has a line break" % where)
        result[name] = text
    token = (token or "").strip()
    if token:
        if any(name.lower() == "authorization" for name in result):
            raise ValueError("%s and %s['Authorization'] both set the Authorization header: keep one"
                             % (names.token, names.headers))
        token = _BEARER_RE.sub("", token)
        if not token or any(c.isspace() or c == "\0" for c in token):
            raise ValueError("%s: a token has no spaces or line breaks" % names.token)
        result["Authorization"] = "Bearer " + token
    return result


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        port = None
    return scheme, (parts.hostname or "").lower(), port or _DEFAULT_PORTS.get(scheme)


def sends_credentials(first_url: str, url: str, auth_redirect_hosts: Iterable[str] = ()) -> bool:
    """Whether a request to ``url``, reached by redirects from ``first_url`` (the configured URL), carries the
    token and the extra headers.

    Yes for ``first_url``'s origin (an upgrade from http to https on the same host and default ports included)
    and for a host named in ``auth_redirect_hosts`` (any port); never from https down to http.
    """
    first, target = _origin(first_url), _origin(url)
    if first[0] == "https" and target[0] != "https":
        return False
    if target == first or (first[1] == target[1] and first[0] == "http" and target[0] == "https"
                           and first[2] == 80 and target[2] == 443):
        return True
    return target[1] in {host.strip().lower() for host in auth_redirect_hosts if host.strip()}


def redirect_target(current: str, location: str) -> str:
    """The absolute URL a redirect from ``current`` to ``location`` (its Location header) leads to;
    ValueError for anything but http and https (file:, ftp:, ...)."""
    target = urllib.parse.urljoin(current, location.strip().replace(" ", "%20"))
    if urllib.parse.urlsplit(target).scheme.lower() not in _DEFAULT_PORTS:
        raise ValueError("a redirect to a URL that is not http or https (%s)" % redact_url(target))
    return target


def host_of(url: str) -> str:
    """The ``host`` or ``host:port`` of a URL, as messages name the server."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "?"
    if ":" in host:
        host = "[%s]" % host
    try:
        port = parts.port
    except ValueError:
        port = None
    return "%s:%d" % (host, port) if port else host


def redact_url(url: str) -> str:
    """``url`` fit for a message: a password in it as ``***``, a query string as ``?...``, no fragment."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        userinfo, host = netloc.rsplit("@", 1)
        netloc = "%s:***@%s" % (userinfo.partition(":")[0], host)
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "..." if parts.query else "", ""))


# --- retries ------------------------------------------------------------------------------------------


def is_transient_status(code: int) -> bool:
    """Whether an HTTP status is worth another attempt: 429 and 5xx, but not 501 (Not Implemented),
    505 (HTTP Version Not Supported) or 511 (Network Authentication Required: a captive portal)."""
    return code == 429 or (500 <= code <= 599 and code not in (501, 505, 511))


def is_transient_error(exc: BaseException) -> bool:
    """Whether a failed request (not an HTTP status) is worth another attempt: a refused, reset or dropped
    connection, a timeout, a temporary name resolution failure, a TLS error other than the certificate's.

    Not: a certificate that does not verify, an unknown host name, a URL urllib cannot open, and a
    plain OSError (the disk: a full file system will not heal by waiting).
    """
    if isinstance(exc, urllib.error.HTTPError):
        return is_transient_status(exc.code)
    if isinstance(exc, urllib.error.URLError):
        reason = exc.reason
        if isinstance(reason, BaseException):
            return is_transient_error(reason)
        return "timed out" in str(reason)
    if isinstance(exc, (ssl.SSLCertVerificationError, ssl.CertificateError)):
        return False
    if isinstance(exc, socket.gaierror):
        return exc.errno == socket.EAI_AGAIN
    return isinstance(exc, (TimeoutError, ConnectionError, http.client.HTTPException, ssl.SSLError))


def describe_error(exc: BaseException) -> str:
    """A failed request (not an HTTP status) in a few words: ``unreachable ([Errno 111] Connection refused)``,
    ``timed out``, ``dropped the connection (IncompleteRead ...)``; messages put the server's name before it."""
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    if isinstance(reason, (TimeoutError, socket.timeout)) or "timed out" in str(reason):
        return "timed out"
    if isinstance(exc, urllib.error.URLError):
        return "unreachable (%s)" % (reason,)
    return "dropped the connection (%s)" % (str(reason) or type(reason).__name__)


def parse_retry_after(value: str | None, now: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP-date, relative to ``now``,
    epoch seconds), at least 0; None when there is none or it does not parse."""
    text = (value or "").strip()
    if not text:
        return None
    if text.isdigit():
        return float(text)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, when.timestamp() - now)


def backoff_delay(failures: int, base: float, cap: float = BACKOFF_MAX_S) -> float:
    """The wait after ``failures`` failures in a row (1 for the first): ``base``, doubled after each, at most
    ``cap`` (or ``base`` if that is longer)."""
    if failures < 1:
        raise ValueError("failures counts from 1")
    base = max(0.0, base)
    return min(max(cap, base), base * 2 ** (failures - 1))


def wait_before_retry(failures: int, retries: int, base: float, retry_after: float | None,
                      names: Names = Names(), max_retry_after: float = RETRY_AFTER_MAX_S) -> float:
    """Seconds to wait before the next attempt after ``failures`` failures in a row, with ``retries`` allowed:
    the server's ``retry_after`` when it gave one, else :func:`backoff_delay`.

    Raises RetryRefused (its text ends the error) when the retries are spent or the server asks to wait
    longer than ``max_retry_after``.
    """
    if failures > retries:
        if retries <= 0:
            raise RetryRefused("")
        raise RetryRefused("gave up after %d attempts (%s=%d)" % (failures, names.retries, retries))
    if retry_after is not None:
        if retry_after > max_retry_after:
            raise RetryRefused("the server asks to retry in %.0f s, longer than the %.0f s this waits at most"
                               % (retry_after, max_retry_after))
        return retry_after
    return backoff_delay(failures, base)


# --- messages ------------------------------------------------------------------------------------------


def status_problem(code: int, reason: str, url: str, label: str, credentials: str, first_url: str = "",
                   names: Names = Names()) -> str:
    """What HTTP ``code`` from ``url`` (the request's, after redirects) means for a model file and which setting to fix.

    :param label: names the file (``model_files[0]``); its ``.url`` is the setting for a 404.
    :param credentials: ``"none"`` (none configured), ``"sent"`` or ``"withheld"`` (configured, but not sent to
        ``url``, a redirect target away from ``first_url``, the configured URL).
    """
    said = ("%s answered HTTP %d %s" % (host_of(url), code, reason or "")).rstrip()
    if code in (401, 403, 407):
        if credentials == "withheld":
            origin = host_of(first_url)
            return ("%s after a redirect from %s; the token and headers go only to %s: add %s to %s if it needs them"
                    % (said, origin, origin, urllib.parse.urlsplit(url).hostname, names.auth_redirect_hosts))
        if credentials == "sent":
            return ("%s to the credentials sent: check that %s (or %s) may read it (on Hugging Face: a token of an "
                    "account that accepted a gated model's conditions)" % (said, names.token, names.headers))
        return "%s: it needs credentials: set %s (or %s)" % (said, names.token, names.headers)
    if code in (404, 410):
        return "%s: no such file, check %s.url" % (said, label)
    if 400 <= code < 500 and code != 429:
        return "%s: check %s.url and %s" % (said, label, names.headers)
    return said
