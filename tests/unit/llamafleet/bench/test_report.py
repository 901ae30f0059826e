"""The benchmark report: the per-token fit recovers known parameters, and every file is written and well-formed."""

from __future__ import annotations

import csv
import json
import random
import struct
from pathlib import Path

import pytest

from llamafleet.bench import report
from llamafleet.bench.report import Point, Repetition, Spread, fit_line, fit_samples, fits, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def t_token(compute_s: float, k: float, hops: int, latency_ms: float) -> float:
    return compute_s + hops * (2 * latency_ms / 1000) * k


def matrix(compute_s: float = 0.020, k: float = 1.5, noise: float = 0.0, policy: str = "planner",
           nodes: tuple[int, ...] = (1, 2, 3), latencies: tuple[float, ...] = (0, 5, 10, 20),
           seed: int = 1) -> list[Point]:
    """Points whose median tok/s follows the model exactly (noise=0) or with multiplicative noise."""
    rnd = random.Random(seed)
    points = []
    for n in nodes:
        for lat in latencies:
            tok = 1 / t_token(compute_s, k, n, lat) * (1 + rnd.uniform(-noise, noise))
            reps = [Repetition(tok_s=tok * f, ttft_s=0.05 + n * lat / 1000 * f, total_s=64 / tok * f,
                               prompt_tok_s=500.0) for f in (0.98, 1.0, 1.03)]
            points.append(Point(nodes=n, latency_ms=lat, policy=policy, repetitions=reps, load_s=10.0 + n,
                                bytes_per_worker={"w%d" % i: 100_000_000 // n for i in range(1, n + 1)},
                                weights_per_worker={"w%d" % i: 6_000_000_000 // n for i in range(1, n + 1)},
                                sweep=[{"clients": c, "requests": 2 * c, "errors": 0, "wall_s": 2.0,
                                        "tokens": 128 * c, "aggregate_tok_s": 64.0 * c, "latency_p50_s": 1.0,
                                        "latency_p95_s": 1.5, "ttft_p50_s": 0.1, "ttft_p95_s": 0.2}
                                       for c in (1, 4)]))
    return points


@pytest.mark.parametrize(("compute_s", "k"), [(0.020, 1.5), (0.005, 1.0), (0.1, 3.0)])
def test_fit_recovers_exact_parameters(compute_s: float, k: float) -> None:
    fit = fits(matrix(compute_s, k))["all"]
    assert fit.compute_s == pytest.approx(compute_s, rel=1e-9)
    assert fit.k == pytest.approx(k, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0) and fit.n == 12


def test_fit_recovers_parameters_through_noise() -> None:
    fit = fits(matrix(0.030, 2.0, noise=0.02))["all"]
    assert fit.compute_s == pytest.approx(0.030, rel=0.05)
    assert fit.k == pytest.approx(2.0, rel=0.05)
    assert 0.9 < fit.r2 < 1.0


def test_fit_uses_hops_when_given() -> None:
    points = matrix(0.02, 1.0, nodes=(2,))
    for p in points:  # the same times, explained by one hop each: k doubles
        p.hops = 1
    assert fits(points)["all"].k == pytest.approx(2.0)


def test_fit_per_policy_when_several() -> None:
    points = matrix(0.02, 1.0, policy="balanced") + matrix(0.02, 0.5, policy="fewest_hops")
    got = fits(points)
    assert set(got) == {"all", "balanced", "fewest_hops"}
    assert got["balanced"].k == pytest.approx(1.0) and got["fewest_hops"].k == pytest.approx(0.5)


def test_fit_without_latency_spread_has_no_k() -> None:
    fit = fit_line([(0.0, 0.02), (0.0, 0.04)])
    assert fit.k is None and fit.compute_s == pytest.approx(0.03) and "does not vary" in fit.describe()
    assert fit_line([]) is None


def test_fit_samples_skip_points_without_figures() -> None:
    points = matrix(nodes=(1,), latencies=(0, 5))
    points.append(Point(nodes=3, latency_ms=5, policy="planner", status="does not fit: 3 workers hold 120 MiB"))
    points.append(Point(nodes=2, latency_ms=5, policy="planner", repetitions=[Repetition()]))
    assert len(fit_samples(points)) == 2


@pytest.mark.parametrize(("values", "text"), [([12.34, 11.9, 12.61], "12.3 (11.9–12.6)"), ([5.0], "5.0"),
                                              ([2.0, 2.0], "2.0"), ([None, 3.0, 1.0], "2.0 (1.0–3.0)"),
                                              ([55.01, 54.99, 55.02], "55.0")])
def test_spread_format(values: list, text: str) -> None:
    assert Spread.of(values).format() == text


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_write_report_writes_every_file_well_formed(tmp_path: Path) -> None:
    points = matrix()
    points.append(Point(nodes=4, latency_ms=0, policy="planner", status="does not fit: 4 workers, 1 GiB short"))
    echoed: list[str] = []
    paths = write_report(points, tmp_path / "run", echo=echoed.append)
    assert set(paths) == {"results.json", "points.csv", "sweep.csv", "report.md", *report.PLOTS}
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == sorted(paths)

    raw = json.loads(paths["results.json"].read_text())
    assert len(raw["points"]) == 13 and raw["baselines"] == {"planner": {"nodes": 1, "latency_ms": 0}}
    assert raw["fits"]["all"]["k"] == pytest.approx(1.5)

    rows = read_csv(paths["points.csv"])
    assert len(rows) == 13
    by_key = {(int(r["nodes"]), float(r["latency_ms"])): r for r in rows}
    assert float(by_key[(1, 0.0)]["x_baseline"]) == pytest.approx(1.0)
    expected = t_token(0.02, 1.5, 1, 0) / t_token(0.02, 1.5, 3, 20)
    assert float(by_key[(3, 20.0)]["x_baseline"]) == pytest.approx(expected)
    assert float(by_key[(3, 20.0)]["tok_s_median"]) == pytest.approx(1 / t_token(0.02, 1.5, 3, 20))
    assert by_key[(2, 5.0)]["bytes_per_worker"] == "w1=50000000;w2=50000000"
    assert by_key[(2, 5.0)]["bytes_total"] == "100000000" and by_key[(2, 5.0)]["hops"] == "2"
    assert by_key[(4, 0.0)]["status"].startswith("does not fit") and by_key[(4, 0.0)]["tok_s_median"] == ""

    sweep = read_csv(paths["sweep.csv"])
    assert len(sweep) == 24 and {r["clients"] for r in sweep} == {"1", "4"}
    assert float(sweep[1]["aggregate_tok_s"]) == 256.0

    md = paths["report.md"].read_text()
    assert "| nodes | latency | tok/s | × baseline | TTFT (ms) | total (s) |" in md
    assert "| 1 | 0 ms | 50.0 (49.0–51.5) | 1.00× |" in md
    assert md.count("\n| 3 | ") == 4 + 2 * 4  # main table and sweep rows
    assert "hops × RTT × 1.500" in md and "20.00 ms" in md
    assert "- 4 nodes, planner at 0 ms: does not fit: 4 workers, 1 GiB short" in md
    assert echoed == ["per-token model (all): " + report.fits(points)["all"].describe()]

    for name in report.PLOTS:
        width, height = png_size(paths[name])
        assert width > 600 and height > 400 and paths[name].stat().st_size > 10_000


def test_markdown_names_policies_when_they_vary(tmp_path: Path) -> None:
    points = matrix(policy="balanced", nodes=(1, 2), latencies=(0, 10)) + \
        matrix(policy="fewest_hops", nodes=(1, 2), latencies=(0, 10), k=0.5)
    md = report.markdown(points, fits(points))
    assert "| nodes | policy | latency | tok/s |" in md
    assert "| 2 | fewest_hops | 10 ms |" in md and "- fewest_hops: t_token ≈ 20.00 ms" in md


def test_bandwidth_caps_get_their_own_lines_and_an_auto_plan_shows_what_it_chose(tmp_path: Path) -> None:
    capped = matrix(policy="auto", nodes=(2,), latencies=(0, 10), k=0.5)
    for p in capped:
        p.bandwidth_mbit, p.plan_policy = 100.0, "fewest_hops"
    points = matrix(policy="auto", nodes=(2,), latencies=(0, 10)) + capped
    assert report.varying(points) == ["policy", "bandwidth"]  # the policy: auto turned into fewest_hops
    md = report.markdown(points, fits(points))
    assert "| nodes | policy | bandwidth | latency | tok/s |" in md
    assert "| 2 | auto | – | 10 ms |" in md and "| 2 | auto → fewest_hops | 100 Mbit/s | 10 ms |" in md
    assert "- auto 100 Mbit/s: t_token" in md  # a fit per cap
    lines = report._series(points, "tok_s", 1.0)
    assert set(lines) == {"2 nodes, auto", "2 nodes, auto, 100 Mbit/s"}
    rows = report.csv_rows(points)
    assert {(r["bandwidth_mbit"], r["plan_policy"]) for r in rows} == {(0.0, ""), (100.0, "fewest_hops")}
    # the policy cell says what an auto plan turned into, once policies vary
    other = matrix(policy="balanced", nodes=(2,), latencies=(10,))
    md = report.markdown(capped + other, {})
    assert "| 2 | auto → fewest_hops | 100 Mbit/s | 10 ms |" in md and "| 2 | balanced | – | 10 ms |" in md


def test_main_renders_a_report_again_from_its_json(tmp_path: Path, capsys) -> None:
    first = write_report(matrix(noise=0.01), tmp_path / "a")
    assert report.main([str(first["results.json"]), "--out", str(tmp_path / "b")]) == 0
    assert (tmp_path / "b" / "report.md").read_text() == first["report.md"].read_text()
    assert (tmp_path / "b" / "points.csv").read_text() == first["points.csv"].read_text()
    assert "| nodes | latency |" in capsys.readouterr().out


def test_main_refuses_what_is_not_a_results_file(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"no": "points"}')
    with pytest.raises(SystemExit) as exc:
        report.main([str(bad), "--out", str(tmp_path / "x")])
    assert exc.value.code == 2 and "bad.json" in capsys.readouterr().err


def test_repetition_from_a_stream_result() -> None:
    from dataclasses import asdict

    from llamafleet.bench.measure import StreamResult

    rep = Repetition.from_dict(asdict(StreamResult(ok=True, tok_s=10.0, ttft_s=0.1, total_s=2.0, prompt_tok_s=300.0)))
    assert rep == Repetition(tok_s=10.0, ttft_s=0.1, total_s=2.0, prompt_tok_s=300.0)


def test_a_run_where_nothing_was_measured_still_writes_every_file(tmp_path: Path) -> None:
    failed = Point(nodes=2, latency_ms=5, policy="even", status="failed: llama-server exited (status 134)")
    paths = write_report([failed], tmp_path)
    assert paths["report.md"].read_text() == ("No point was measured.\n\nNot measured:\n\n"
                                              "- 2 nodes, even at 5 ms: failed: llama-server exited (status 134)\n")
    assert [r["status"] for r in read_csv(paths["points.csv"])] == ["failed: llama-server exited (status 134)"]
    assert read_csv(paths["sweep.csv"]) == [] and paths["sweep.csv"].read_text().startswith("nodes,latency_ms")
    assert json.loads(paths["results.json"].read_text())["fits"] == {}
    assert all(paths[name].read_bytes()[:8] == PNG_MAGIC for name in report.PLOTS)


def test_bytes_label_reads_kb_and_gb() -> None:
    from llamafleet.bench.report import _bytes_label

    assert [_bytes_label(v) for v in (25_000, 2_300_000_000, 12, 5_500_000)] == ["25 kB", "2.3 GB", "12 B", "5.5 MB"]
