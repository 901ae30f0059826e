"""The hostile suite's own logic: the cases it builds and how it judges an answer."""

from __future__ import annotations

import pytest

from llamafleet.bench import hostile

KEY = "k3y-Of-The-Edge-0123456789"


def test_over_100_cases_with_unique_names_and_controls() -> None:
    cases = hostile.cases("example:8080", KEY, 1024, 2.0)
    names = [c.name for c in cases]
    assert len(cases) >= 100 and len(set(names)) == len(names)
    served = [c for c in cases if c.expect == hostile.SERVED]
    # the controls carry the key, or ask for /health, and are the only cases that may reach the backend
    assert served and all(c.backend for c in served) and not any(c.backend for c in cases if c not in served)
    assert all(KEY.encode() in c.chunks[0] or b"/health " in c.chunks[0] for c in served)


@pytest.mark.parametrize(("expect", "status", "outcome", "ok"), [
    (hostile.REFUSED, 400, "answered", True), (hostile.REFUSED, 431, "answered", True),
    (hostile.REFUSED, 200, "answered", False), (hostile.REFUSED, 503, "answered", False),
    (hostile.REFUSED, None, "reset", False), (hostile.REFUSED, None, "closed", False),
    (hostile.CLOSED, None, "closed", True), (hostile.CLOSED, 408, "answered", True),
    (hostile.CLOSED, None, "reset", False), (hostile.SERVED, 200, "answered", True),
    (hostile.SERVED, 401, "answered", False), (hostile.SERVED, None, "timeout", False)])
def test_judge(expect: str, status: int | None, outcome: str, ok: bool) -> None:
    assert hostile.judge(expect, status, outcome) is ok


def test_status_of() -> None:
    assert hostile.status_of(b"HTTP/1.1 413 Payload Too Large\r\n") == 413
    assert hostile.status_of(b"HTTP/1.0 200 OK\r\n\r\n") == 200
    assert hostile.status_of(b"\x15\x03\x03\x00\x02") is None
    assert hostile.status_of(b"HTTP/1.1 2000 x\r\n") is None


def test_endpoint_from_url() -> None:
    assert hostile.Endpoint.from_url("https://10.0.0.5:8443") == hostile.Endpoint("10.0.0.5", 8443, True)
    assert hostile.Endpoint.from_url("http://h").port == 80
    with pytest.raises(ValueError):
        hostile.Endpoint.from_url("ftp://h")
