# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The pure parts of the ``await_progress`` action plugin: its progress line, the phase read from a work's log or from
the progress file a job writes (a download's bytes and rate), the estimate from the records of earlier runs, and the
messages of a timeout and a failed job.

Stdlib only (``llamafleet.core.await_progress`` in the library).
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Mapping

# cmake's Makefile generator ("[ 45%] Building ...") and Ninja ("[123/456] Building ...").
_PERCENT = re.compile(r"^\[\s*(\d{1,3})%\]", re.M)
_STEPS = re.compile(r"^\[(\d+)/(\d+)\]", re.M)
# A timestamp at the end of a phase line, as build.sh.j2 writes it (date -u +%FT%TZ).
_STAMP = re.compile(r"\s+\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
# A glob of records on the host: it goes unquoted into a shell command, so only these characters.
SAFE_GLOB = re.compile(r"^[A-Za-z0-9_./*?@+-]+$")


def duration(seconds: float) -> str:
    """``45s``, ``3m20s``, ``1h02m``."""
    whole = max(int(round(seconds)), 0)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return "%dh%02dm" % (hours, minutes)
    if minutes:
        return "%dm%02ds" % (minutes, secs)
    return "%ds" % secs


def phase_of(log: str, marker: str = "==> ") -> str | None:
    """The work's phase from the tail of its log: the last line that starts with ``marker`` (without its trailing
    timestamp), with the build's progress after it (``45%`` or ``123/456``) when there is some; None if no marker."""
    lines = [line for line in log.splitlines() if line.startswith(marker)]
    if not lines:
        return None
    phase = _STAMP.sub("", lines[-1][len(marker):].strip())
    after = log[log.rindex(lines[-1]) + len(lines[-1]):]
    percent = _PERCENT.findall(after)
    steps = _STEPS.findall(after)
    if percent:
        phase += " %s%%" % percent[-1]
    elif steps:
        phase += " %s/%s" % steps[-1]
    return phase


def size_text(nbytes: float) -> str:
    """``512 B``, ``3.4 MiB``, ``1.2 GiB``."""
    value = float(max(nbytes, 0))
    if value < 1024:
        return "%d B" % value
    for unit in ("KiB", "MiB"):
        value /= 1024
        if value < 1024:
            return "%.1f %s" % (value, unit)
    return "%.1f GiB" % (value / 1024)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def transfer_of(text: str) -> str | None:
    """The phase from a job's progress file (JSON: ``phase``, ``done`` and ``total`` bytes, ``rate`` in bytes/s,
    ``index`` and ``count`` of the file, ``note``): ``1.2 GiB of 6.4 GiB (19%), 85 MB/s, file 2 of 3``; None when
    there is no such record (the job has not written one yet, or has removed it)."""
    records = parse_records(text)
    if not records:
        return None
    rec = records[-1]
    done, total, rate = rec.get("done"), rec.get("total"), rec.get("rate")
    parts = [str(rec["phase"])] if rec.get("phase") not in (None, "", "downloading") else []
    if _number(done):
        if _number(total) and total > 0:
            parts.append("%s of %s (%d%%)" % (size_text(done), size_text(total), min(100, int(100 * done / total))))
        else:
            parts.append(size_text(done))
        if _number(rate):
            parts.append(("%.0f MB/s" if rate >= 1e7 else "%.1f MB/s") % (rate / 1e6))
    if isinstance(rec.get("count"), int) and rec["count"] > 1 and isinstance(rec.get("index"), int):
        parts.append("file %d of %d" % (rec["index"], rec["count"]))
    if rec.get("note"):
        parts.append(str(rec["note"]))
    return ", ".join(parts) or None


def parse_records(text: str) -> list[dict[str, Any]]:
    """The JSON objects in ``text``, one after another (the host's records cat'ed together); others are skipped."""
    decoder = json.JSONDecoder()
    out: list[dict[str, Any]] = []
    pos = 0
    while True:
        start = text.find("{", pos)
        if start < 0:
            return out
        try:
            obj, end = decoder.raw_decode(text, start)
        except ValueError:
            pos = start + 1
            continue
        if isinstance(obj, dict):
            out.append(obj)
        pos = end


def pick_estimate(records: Iterable[Mapping[str, Any]], match: Mapping[str, Any], key: str,
                  order: str = "built_at") -> float | None:
    """The ``key`` (seconds) of the newest record (by ``order``) whose values equal ``match``'s, or None."""
    fits = [r for r in records
            if all(r.get(k) == v for k, v in match.items())
            and isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and r[key] > 0]
    if not fits:
        return None
    return float(max(fits, key=lambda r: str(r.get(order, "")))[key])


def answer_of(status: int, body: str = "", msg: str = "") -> str:
    """An HTTP answer in words: ``HTTP 503 (Loading model)`` with the message of an error in llama-server's shape
    (``{"error": {"message"}}``, the gate's too), or why there was none (``no answer: ...``)."""
    if not status or status < 0:
        why = msg.split("Request failed:", 1)[-1].strip() if msg else ""
        return ("no answer: %s" % why[:160]) if why else "no answer"
    reason = ""
    try:
        data = json.loads(body) if body else None
    except ValueError:
        data = None
    if isinstance(data, dict):
        error = data.get("error")
        reason = error.get("message", "") if isinstance(error, dict) else (error or data.get("message") or "")
    reason = str(reason).strip()[:160]
    return "HTTP %s (%s)" % (status, reason) if reason else "HTTP %s" % status


def progress_line(host: str, what: str, elapsed: float, phase: str | None = None,
                  estimate: float | None = None) -> str:
    """``HOST: WHAT: PHASE, 3m20s elapsed, about 4m20s left (the last run took 7m40s)``."""
    parts = ["%s: %s" % (host, what)]
    if phase:
        parts[0] += ": %s" % phase
    parts.append("%s elapsed" % duration(elapsed))
    if estimate:
        if elapsed < estimate:
            parts.append("about %s left (the last run took %s)" % (duration(estimate - elapsed), duration(estimate)))
        else:
            parts.append("longer than the last run (%s)" % duration(estimate))
    return ", ".join(parts)


def timeout_message(host: str, what: str, timeout: int, variable: str, last: str = "", hint: str = "",
                    diagnosis: str = "") -> str:
    """Why a wait gave up: the host, the work, the variable that sets the timeout and its value."""
    msg = "%s: %s did not finish within %s (%d s%s)" % (host, what, variable or "the timeout", timeout,
                                                        ", %s" % duration(timeout) if timeout >= 60 else "")
    if last:
        msg += "; last seen: %s" % last
    msg += "."
    if hint:
        msg += " %s" % hint
    if variable:
        msg += " Raise %s if it needs longer." % variable
    if diagnosis:
        msg += "\n%s" % diagnosis
    return msg


def failure_message(host: str, what: str, job: Mapping[str, Any], elapsed: float, hint: str = "",
                    diagnosis: str = "") -> str:
    """Why an async job failed: its return code and message, the end of its stderr, and the diagnosis."""
    rc = job.get("rc")
    msg = "%s: %s failed after %s" % (host, what, duration(elapsed))
    if rc is not None:
        msg += " (rc %s)" % rc
    detail = str(job.get("msg") or "").strip()
    if detail:
        msg += ": %s" % detail
    stderr = str(job.get("stderr") or "").strip()
    if stderr:
        msg += "\n" + "\n".join(stderr.splitlines()[-20:])
    if hint:
        msg += "\n%s" % hint
    if diagnosis:
        msg += "\n%s" % diagnosis
    return msg


def job_timed_out(job: Mapping[str, Any]) -> bool:
    """Whether Ansible's async wrapper killed the job at its time limit."""
    return bool(job.get("failed")) and job.get("msg") == "Timeout exceeded" and "child_pid" in job


def job_failed(job: Mapping[str, Any]) -> bool:
    """Whether a finished async job failed (as Ansible reports it, or by a non-zero return code)."""
    return bool(job.get("failed")) or (job.get("rc") not in (None, 0))
