"""await_progress: the progress line, the phase from a build log, the estimate from earlier records, the messages."""

from __future__ import annotations

import json

import pytest

from llamafleet.core import await_progress as ap


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (44.6, "45s"), (60, "1m00s"), (200, "3m20s"),
                                           (3599, "59m59s"), (3720, "1h02m"), (-3, "0s")])
def test_duration(seconds: float, text: str) -> None:
    assert ap.duration(seconds) == text


BUILD_LOG = """\
-- Configuring done
==> configure 2026-11-26T10:00:00Z
-- Build files have been written
==> build rpc-server llama-server llama-bench with 2 jobs 2026-11-26T10:00:20Z
[  3%] Building C object ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o
[ 45%] Building CXX object src/CMakeFiles/llama.dir/llama.cpp.o
"""


@pytest.mark.parametrize("log, phase", [
    (BUILD_LOG, "build rpc-server llama-server llama-bench with 2 jobs 45%"),
    ("==> configure 2026-11-26T10:00:00Z\n-- The C compiler\n", "configure"),
    ("==> build x 2026-11-26T10:00:20Z\n[12/345] Building CXX\n[13/345] Linking\n", "build x 13/345"),
    # a percentage before the last marker belongs to an earlier phase
    ("==> build 2026-11-26T10:00:20Z\n[100%] Built\n==> done 2026-11-26T10:09:00Z\n", "done"),
    ("no markers at all\n[ 50%] x\n", None),
    ("", None),
])
def test_phase_of(log: str, phase: str | None) -> None:
    assert ap.phase_of(log) == phase


def test_phase_of_other_marker() -> None:
    assert ap.phase_of("## fetch\n## unpack\n", marker="## ") == "unpack"


RECORDS = [
    {"backend": "cpu", "cmake_args": ["-DA"], "built_at": "2026-11-01T10:00:00Z", "build_seconds": 500},
    {"backend": "cpu", "cmake_args": ["-DA"], "built_at": "2026-11-20T10:00:00Z", "build_seconds": 460},
    {"backend": "cpu", "cmake_args": ["-DB"], "built_at": "2026-11-25T10:00:00Z", "build_seconds": 900},
    {"backend": "vulkan", "cmake_args": ["-DA"], "built_at": "2026-11-26T10:00:00Z", "build_seconds": 1200},
    # an older recipe's record: no duration
    {"backend": "cpu", "cmake_args": ["-DA"], "built_at": "2026-11-26T11:00:00Z"},
]


@pytest.mark.parametrize("match, seconds", [
    ({"backend": "cpu", "cmake_args": ["-DA"]}, 460.0),
    ({"backend": "cpu"}, 900.0),
    ({"backend": "vulkan"}, 1200.0),
    ({"backend": "cuda"}, None),
    ({}, 1200.0),
])
def test_pick_estimate(match: dict, seconds: float | None) -> None:
    assert ap.pick_estimate(RECORDS, match, "build_seconds") == seconds


def test_pick_estimate_ignores_what_is_not_a_duration() -> None:
    odd = [{"build_seconds": True}, {"build_seconds": "400"}, {"build_seconds": 0}, {"build_seconds": -5}]
    assert ap.pick_estimate(odd, {}, "build_seconds") is None


def test_parse_records_of_files_cat_together() -> None:
    text = json.dumps(RECORDS[0], indent=1) + "\n" + json.dumps(RECORDS[1]) + "\n{broken\n[1, 2]\n" + \
        json.dumps(RECORDS[2])
    assert ap.parse_records(text) == [RECORDS[0], RECORDS[1], RECORDS[2]]
    assert ap.parse_records("") == []


@pytest.mark.parametrize("status, body, msg, words", [
    (503, '{"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}', "",
     "HTTP 503 (Loading model)"),
    (503, '{"error": "the gate is stopping"}', "", "HTTP 503 (the gate is stopping)"),
    (502, "<html>bad gateway</html>", "", "HTTP 502"),
    (500, "", "", "HTTP 500"),
    (-1, "", "Status code was -1 and not [200]: Request failed: <urlopen error [Errno 111] Connection refused>",
     "no answer: <urlopen error [Errno 111] Connection refused>"),
    (-1, "", "", "no answer"),
])
def test_answer_of(status: int, body: str, msg: str, words: str) -> None:
    assert ap.answer_of(status, body, msg) == words


@pytest.mark.parametrize("elapsed, phase, estimate, line", [
    (200, "build 45%", 460, "lab1: compiling: build 45%, 3m20s elapsed, about 4m20s left (the last run took 7m40s)"),
    (200, None, None, "lab1: compiling, 3m20s elapsed"),
    (500, "build 99%", 460, "lab1: compiling: build 99%, 8m20s elapsed, longer than the last run (7m40s)"),
])
def test_progress_line(elapsed: float, phase: str | None, estimate: float | None, line: str) -> None:
    assert ap.progress_line("lab1", "compiling", elapsed, phase, estimate) == line


def test_timeout_message_names_host_and_variable() -> None:
    msg = ap.timeout_message("lab2", "llama-server loading the model", 900, "llama_server_health_timeout",
                             "HTTP 503", "A hint.", "journalctl:\nline")
    assert msg == ("lab2: llama-server loading the model did not finish within llama_server_health_timeout "
                   "(900 s, 15m00s); last seen: HTTP 503. A hint. Raise llama_server_health_timeout if it needs "
                   "longer.\njournalctl:\nline")
    assert ap.timeout_message("h", "x", 5, "") == "h: x did not finish within the timeout (5 s)."


def test_failure_message() -> None:
    job = {"rc": 2, "msg": "non-zero return code", "stderr": "\n".join("e%d" % i for i in range(30))}
    msg = ap.failure_message("lab1", "compiling", job, 95, "The running version is untouched.", "tail:\nerror: x")
    first, *rest = msg.splitlines()
    assert first == "lab1: compiling failed after 1m35s (rc 2): non-zero return code"
    assert rest[:20] == ["e%d" % i for i in range(10, 30)]
    assert rest[20:] == ["The running version is untouched.", "tail:", "error: x"]


@pytest.mark.parametrize("job, failed, timed_out", [
    ({"finished": True, "rc": 0, "changed": True}, False, False),
    ({"finished": True, "rc": 3, "failed": True}, True, False),
    ({"finished": True, "rc": 1}, True, False),
    ({"finished": True, "failed": True, "msg": "could not find job"}, True, False),
    ({"msg": "Timeout exceeded", "failed": True, "child_pid": 42}, True, True),
])
def test_job_outcome(job: dict, failed: bool, timed_out: bool) -> None:
    assert ap.job_failed(job) is failed and ap.job_timed_out(job) is timed_out


# --- a download's progress file (written by fetch_progress.ProgressFile, read on the controller) ----------------

@pytest.mark.parametrize("nbytes, text", [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (3 * 2**20, "3.0 MiB"),
                                          (int(1.2 * 2**30), "1.2 GiB"), (int(6.4 * 2**30), "6.4 GiB"),
                                          (3 * 2**40, "3072.0 GiB"), (-5, "0 B")])
def test_size_text(nbytes: int, text: str) -> None:
    assert ap.size_text(nbytes) == text


@pytest.mark.parametrize("record, text", [
    ({"phase": "downloading", "done": int(1.2 * 2**30), "total": int(6.4 * 2**30), "rate": 85e6, "index": 1,
      "count": 1}, "1.2 GiB of 6.4 GiB (18%), 85 MB/s"),
    ({"phase": "downloading", "done": 5 * 2**20, "total": 10 * 2**20, "rate": 2.45e6, "index": 2, "count": 3},
     "5.0 MiB of 10.0 MiB (50%), 2.5 MB/s, file 2 of 3"),
    # no rate yet (under half a second of samples), no total (a server without Content-Length)
    ({"phase": "downloading", "done": 2048, "total": None, "rate": None, "index": 1, "count": 1}, "2.0 KiB"),
    ({"phase": "resuming", "done": 3 * 2**30, "total": 6 * 2**30, "rate": None, "index": 1, "count": 1},
     "resuming, 3.0 GiB of 6.0 GiB (50%)"),
    ({"phase": "downloading", "done": 2**20, "total": 2**21, "rate": 0, "index": 1, "count": 1,
      "note": "retrying in 5 s"}, "1.0 MiB of 2.0 MiB (50%), 0.0 MB/s, retrying in 5 s"),
    ({"phase": "checking"}, "checking"),
    ({"done": True, "total": "x", "count": "2"}, None),
])
def test_transfer_of(record: dict, text: str | None) -> None:
    assert ap.transfer_of(json.dumps(record, indent=1)) == text


@pytest.mark.parametrize("text", ["", "cat: /x/.model_fetch-progress.json: No such file or directory", '{"done": 1'])
def test_transfer_of_no_record(text: str) -> None:
    assert ap.transfer_of(text) is None
