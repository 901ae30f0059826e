# -*- coding: utf-8 -*-
# Copyright: llamafleet maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The fleet benchmark's report: raw JSON, CSV, a Markdown table, PNG plots and a per-token model.

    python -m llamafleet.bench.report results.json --out bench-results/2026-11-23T1200

A point is one cell of the matrix (active workers × injected latency × split
policy, optionally × build) with its repetitions. ``write_report(points, folder)``
writes:

- ``results.json``: every point as given, the baselines and the fits (``main``
  re-renders a report from it);
- ``points.csv``: one row per point, medians and min/max of each figure;
- ``sweep.csv``: one row per point and concurrency step;
- ``report.md``: the table ``nodes | latency | tok/s | × baseline | TTFT | total``
  (median and range of the repetitions), the sweep, the fitted model, the points
  that did not run;
- ``tok_s_vs_latency.png``, ``ttft_vs_latency.png`` (one line per node count),
  ``load_and_bytes.png`` (load time and bytes per worker for each split).

The per-token model: ``t_token ≈ compute + hops × RTT × k`` with ``t_token`` =
1 / generation tok/s, ``RTT`` = 2 × the injected one-way latency and ``hops``
the worker devices a token crosses (default: the point's node count).
``compute`` is the time of a token without network latency and ``k`` the
number of round trips per hop that latency adds to it (about 1 when llama.cpp
pipelines each device's input, compute and output in one exchange).

Matplotlib (Agg backend) is imported only to draw the plots.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable


PLOTS = ("tok_s_vs_latency.png", "ttft_vs_latency.png", "load_and_bytes.png")


@dataclass
class Repetition:
    """One measured completion of a point (the fields of measure.StreamResult that the report uses)."""

    tok_s: float | None = None
    ttft_s: float | None = None
    total_s: float | None = None
    prompt_tok_s: float | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Repetition:
        """From a dict holding at least these keys (``asdict(StreamResult)`` will do)."""
        return cls(**{f.name: data.get(f.name) for f in fields(cls)})


@dataclass
class Point:
    """One cell of the benchmark matrix. ``status`` other than ``ok`` says why it has no figures."""

    nodes: int
    latency_ms: float
    policy: str
    repetitions: list[Repetition] = field(default_factory=list)
    load_s: float | None = None
    bytes_per_worker: dict[str, int] = field(default_factory=dict)
    weights_per_worker: dict[str, int] = field(default_factory=dict)  # planned: what each worker's cache can supply
    hops: int | None = None
    build: str = ""
    status: str = "ok"
    sweep: list[dict[str, Any]] = field(default_factory=list)
    bandwidth_mbit: float = 0.0
    plan_policy: str = ""
    build_id: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Point:
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        values["repetitions"] = [Repetition.from_dict(r) for r in data.get("repetitions", [])]
        return cls(**values)

    @property
    def ok(self) -> bool:
        return self.status == "ok" and any(r.tok_s for r in self.repetitions)

    @property
    def bandwidth(self) -> str:
        """The link cap as a label: ``100 Mbit/s``, or empty when uncapped."""
        return "%g Mbit/s" % self.bandwidth_mbit if self.bandwidth_mbit else ""

    @property
    def switched(self) -> bool:
        """Whether the plan became another policy than the one asked (auto, or balanced, to fewest_hops)."""
        return bool(self.plan_policy) and self.plan_policy != self.policy

    @property
    def group(self) -> tuple[str, ...]:
        """What a baseline and a fit are taken within: its value of each VARIANTS."""
        return tuple(getattr(self, name) for name in VARIANTS)

    @property
    def hop_count(self) -> int:
        return self.nodes if self.hops is None else self.hops

    def label(self, varying: Iterable[str]) -> str:
        """``2 nodes``, followed by the point's value of each variant in ``varying``."""
        parts = ["%d node%s" % (self.nodes, "" if self.nodes == 1 else "s")]
        parts += [getattr(self, name) for name in varying if getattr(self, name)]
        return ", ".join(parts)


# The dimensions besides nodes and latency that make a point's line in tables and plots.
VARIANTS = ("policy", "bandwidth", "build")


@dataclass(frozen=True)
class Spread:
    """Median and range of a figure over repetitions."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Spread | None:
        got = [v for v in values if v is not None and math.isfinite(v)]
        if not got:
            return None
        return cls(statistics.median(got), min(got), max(got), len(got))

    def format(self, scale: float = 1.0, digits: int = 1) -> str:
        """``12.3 (11.9–12.6)``; just the median when there is one value or no spread."""
        med, low, high = ("%.*f" % (digits, v * scale) for v in (self.median, self.low, self.high))
        return med if self.n < 2 or low == high else "%s (%s–%s)" % (med, low, high)


def spread(point: Point, name: str) -> Spread | None:
    """The Spread of one Repetition field of a point."""
    return Spread.of(getattr(r, name) for r in point.repetitions)


@dataclass(frozen=True)
class Fit:
    """Least-squares fit of t_token = compute + k × hops × RTT (seconds)."""

    compute_s: float
    k: float | None
    r2: float | None
    n: int
    note: str = ""

    def describe(self) -> str:
        if self.k is None:
            return "t_token ≈ %.2f ms (%s; %d points)" % (self.compute_s * 1000, self.note, self.n)
        return ("t_token ≈ %.2f ms + hops × RTT × %.3f (R² %.3f, %d points)"
                % (self.compute_s * 1000, self.k, self.r2 if self.r2 is not None else float("nan"), self.n))


def fit_samples(points: Iterable[Point]) -> list[tuple[float, float]]:
    """(hops × RTT, t_token) in seconds, one per ok point, from the median generation tok/s."""
    out = []
    for p in points:
        tok = spread(p, "tok_s") if p.ok else None
        if tok and tok.median > 0:
            out.append((p.hop_count * 2 * p.latency_ms / 1000.0, 1.0 / tok.median))
    return out


def fit_line(samples: list[tuple[float, float]]) -> Fit | None:
    """Ordinary least squares y = a + k·x; k is None when x does not vary. None without samples."""
    if not samples:
        return None
    n = len(samples)
    mx = sum(x for x, _ in samples) / n
    my = sum(y for _, y in samples) / n
    sxx = sum((x - mx) ** 2 for x, _ in samples)
    if sxx <= 0:
        return Fit(my, None, None, n, "hops × RTT does not vary: no k")
    k = sum((x - mx) * (y - my) for x, y in samples) / sxx
    a = my - k * mx
    syy = sum((y - my) ** 2 for _, y in samples)
    sse = sum((y - a - k * x) ** 2 for x, y in samples)
    return Fit(a, k, 1.0 - sse / syy if syy > 0 else 1.0, n)


def fits(points: list[Point]) -> dict[str, Fit]:
    """The fit over all ok points (``all``), and per policy/build when there are several."""
    out: dict[str, Fit] = {}
    overall = fit_line(fit_samples(points))
    if overall:
        out["all"] = overall
    groups = sorted({p.group for p in points if p.ok})
    if len(groups) > 1:
        for group in groups:
            found = fit_line(fit_samples(p for p in points if p.group == group))
            if found:
                out[" ".join(g for g in group if g)] = found
    return out


def baselines(points: list[Point]) -> dict[tuple[str, ...], Point]:
    """Per policy/build, the ok point with the fewest nodes at the lowest latency."""
    out: dict[tuple[str, str], Point] = {}
    for p in sorted((p for p in points if p.ok), key=lambda p: (p.nodes, p.latency_ms)):
        out.setdefault(p.group, p)
    return out


def times_baseline(point: Point, base: dict[tuple[str, ...], Point]) -> float | None:
    """Median tok/s of a point over its baseline's."""
    ref = base.get(point.group)
    mine, theirs = spread(point, "tok_s"), spread(ref, "tok_s") if ref else None
    return mine.median / theirs.median if mine and theirs and theirs.median else None


def _varies(points: list[Point], attr: str) -> bool:
    return len({getattr(p, attr) for p in points}) > 1


def varying(points: list[Point]) -> list[str]:
    """The VARIANTS whose value differs between the points; the policy also when a plan turned into another one
    (auto, balanced with round trips, becoming fewest_hops), so tables show it."""
    switched = any(p.switched for p in points)
    return [name for name in VARIANTS if _varies(points, name) or (name == "policy" and switched)]


def variant_cell(point: Point, name: str) -> str:
    """A table cell for one of VARIANTS: ``–`` when the point has none (uncapped, the deployed build); the plan
    a policy turned into when that differs (``balanced → fewest_hops``)."""
    value = getattr(point, name) or "–"
    if name == "policy" and point.switched:
        value += " → " + point.plan_policy
    return value


def _cell(value: Spread | None, scale: float = 1.0, digits: int = 1) -> str:
    return value.format(scale, digits) if value else "–"


def markdown(points: list[Point], fitted: dict[str, Fit]) -> str:
    """The report's Markdown: main table, sweep table, fitted model, points without figures."""
    base = baselines(points)
    if not base:
        return "No point was measured.\n" + _not_measured(points)
    extra = varying(points)
    head = ["nodes", *extra, "latency", "tok/s", "× baseline", "TTFT (ms)", "total (s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in sorted(points, key=_order):
        if not p.ok:
            continue
        ratio = times_baseline(p, base)
        row = [str(p.nodes), *(variant_cell(p, a) for a in extra), "%g ms" % p.latency_ms, _cell(spread(p, "tok_s")),
               "%.2f×" % ratio if ratio is not None else "–", _cell(spread(p, "ttft_s"), 1000, 0),
               _cell(spread(p, "total_s"), 1, 2)]
        lines.append("| " + " | ".join(row) + " |")
    reps = sorted({len(p.repetitions) for p in points if p.ok})
    lines += ["", "Median (min–max) of %s repetitions; × baseline: median tok/s over that of %s."
              % ("/".join(map(str, reps)) or "0",
                 "; ".join("%s at %g ms%s" % (b.label(()), b.latency_ms,
                                              " (%s)" % " ".join(g for g in b.group if g) if extra else "")
                           for b in base.values()) or "no baseline")]
    sweep_rows = [(p, s) for p in sorted(points, key=_order) for s in p.sweep]
    if sweep_rows:
        lines += ["", "| nodes | %slatency | clients | aggregate tok/s | p50 (s) | p95 (s) | errors |"
                  % "".join(a + " | " for a in extra), "|" + "---|" * (7 + len(extra))]
        for p, s in sweep_rows:
            lines.append("| %d | %s%g ms | %d | %.1f | %s | %s | %d/%d |" % (
                p.nodes, "".join(variant_cell(p, a) + " | " for a in extra), p.latency_ms, s["clients"],
                s["aggregate_tok_s"], _num(s.get("latency_p50_s")), _num(s.get("latency_p95_s")),
                s["errors"], s["requests"]))
    if fitted:
        lines += ["", "Per-token model, t_token ≈ compute + hops × RTT × k (RTT = 2 × latency):", ""]
        lines += ["- %s: %s" % (name, fit.describe()) for name, fit in fitted.items()]
    return "\n".join(lines) + "\n" + _not_measured(points)


def _not_measured(points: list[Point]) -> str:
    """The Markdown list of points without figures, and why (empty when every point has them)."""
    skipped = sorted((p for p in points if not p.ok), key=_order)
    if not skipped:
        return ""
    return "\nNot measured:\n\n" + "".join(
        "- %s at %g ms: %s\n" % (p.label(VARIANTS), p.latency_ms,
                                 p.status if p.status != "ok" else "no successful repetition") for p in skipped)


def _num(value: float | None) -> str:
    return "%.2f" % value if value is not None else "–"


def _order(p: Point) -> tuple:
    return p.build, p.policy, p.bandwidth_mbit, p.nodes, p.latency_ms


CSV_FIGURES = ("tok_s", "ttft_s", "total_s", "prompt_tok_s")
POINT_COLUMNS = ("nodes", "latency_ms", "policy", "plan_policy", "bandwidth_mbit", "build", "build_id", "status",
                 "hops",
                 "repetitions",
                 *("%s_%s" % (name, stat) for name in CSV_FIGURES for stat in ("median", "min", "max")),
                 "x_baseline", "load_s", "bytes_total", "bytes_per_worker")


def csv_rows(points: list[Point]) -> list[dict[str, Any]]:
    """points.csv: one row per point; ``bytes_per_worker`` as ``name=bytes`` pairs joined by ``;``."""
    base = baselines(points)
    rows = []
    for p in sorted(points, key=_order):
        row: dict[str, Any] = {"nodes": p.nodes, "latency_ms": p.latency_ms, "policy": p.policy,
                               "plan_policy": p.plan_policy, "bandwidth_mbit": p.bandwidth_mbit, "build": p.build,
                               "build_id": p.build_id,
                               "status": p.status, "hops": p.hop_count, "repetitions": len(p.repetitions)}
        for name in CSV_FIGURES:
            got = spread(p, name)
            row.update({name + "_median": got.median if got else "", name + "_min": got.low if got else "",
                        name + "_max": got.high if got else ""})
        ratio = times_baseline(p, base) if p.ok else None
        row["x_baseline"] = ratio if ratio is not None else ""
        row["load_s"] = p.load_s if p.load_s is not None else ""
        row["bytes_total"] = sum(p.bytes_per_worker.values())
        row["bytes_per_worker"] = ";".join("%s=%d" % kv for kv in sorted(p.bytes_per_worker.items()))
        rows.append(row)
    return rows


SWEEP_COLUMNS = ("clients", "requests", "errors", "wall_s", "tokens", "aggregate_tok_s", "latency_p50_s",
                 "latency_p95_s", "ttft_p50_s", "ttft_p95_s")


def sweep_rows(points: list[Point]) -> list[dict[str, Any]]:
    """sweep.csv: one row per point and concurrency step."""
    return [{"nodes": p.nodes, "latency_ms": p.latency_ms, "policy": p.policy, "bandwidth_mbit": p.bandwidth_mbit,
             "build": p.build,
             **{c: s.get(c, "") if s.get(c) is not None else "" for c in SWEEP_COLUMNS}}
            for p in sorted(points, key=_order) for s in p.sweep]


def write_csv(path: Path, rows: list[dict[str, Any]], columns: Iterable[str]) -> None:
    with path.open("w", newline="", encoding="utf-8") as out:
        writer = csv.DictWriter(out, fieldnames=list(columns))
        writer.writeheader()
        writer.writerows(rows)


def _series(points: list[Point], name: str, scale: float) -> dict[str, list[tuple[float, Spread]]]:
    """Per line label (node count, and the variants that vary): (latency, Spread) sorted by latency."""
    extra = varying(points)
    lines: dict[str, list[tuple[float, Spread]]] = {}
    for p in sorted((p for p in points if p.ok), key=_order):
        got = spread(p, name)
        if got:
            scaled = Spread(got.median * scale, got.low * scale, got.high * scale, got.n)
            lines.setdefault(p.label(extra), []).append((p.latency_ms, scaled))
    return lines


def plot_vs_latency(path: Path, points: list[Point], name: str, scale: float, ylabel: str, title: str) -> None:
    """One line per node count: median of ``name`` against injected latency, bars from min to max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, values in _series(points, name, scale).items():
        xs = [x for x, _ in values]
        ys = [s.median for _, s in values]
        err = [[s.median - s.low for _, s in values], [s.high - s.median for _, s in values]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label)
    ax.set_xlabel("injected latency per worker link (ms, one way)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_load_and_bytes(path: Path, points: list[Point]) -> None:
    """Per split (nodes, policy, build): median load time; and per worker, the bytes sent to it at load beside the
    weights the plan gives it, on a log scale, so a seeded worker's kilobytes and an unseeded one's gigabytes both
    read (the gap between the two bars is what its cache supplied)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    extra = varying(points)
    splits: dict[str, list[Point]] = {}
    for p in sorted((p for p in points if p.status == "ok"), key=_order):
        splits.setdefault(p.label(extra), []).append(p)
    labels = list(splits)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    loads = [Spread.of(p.load_s for p in splits[label]) for label in labels]
    left.bar(range(len(labels)), [s.median if s else 0 for s in loads], color="tab:blue",
             yerr=[[s.median - s.low if s else 0 for s in loads], [s.high - s.median if s else 0 for s in loads]],
             capsize=3)
    left.set_ylabel("load time (s)")
    left.set_title("load time per split")
    left.set_xticks(range(len(labels)))
    left.set_xticklabels(labels, rotation=20, ha="right")
    bars = [(label, worker) for label in labels
            for worker in sorted({w for p in splits[label] for w in {**p.weights_per_worker, **p.bytes_per_worker}})]
    sent = [statistics.median([p.bytes_per_worker.get(w, 0) for p in splits[label]]) for label, w in bars]
    planned = [statistics.median([p.weights_per_worker.get(w, 0) for p in splits[label]]) for label, w in bars]
    where = range(len(bars))
    right.bar([i - 0.2 for i in where], [max(b, 1) for b in planned], width=0.4, color="tab:gray",
              label="planned weights")
    right.bar([i + 0.2 for i in where], [max(b, 1) for b in sent], width=0.4, color="tab:orange",
              label="sent at load")
    for i, value in zip(where, sent):
        right.annotate(_bytes_label(value), (i + 0.2, max(value, 1)), ha="center", va="bottom", fontsize="x-small")
    right.set_yscale("log")
    right.set_ylabel("bytes (log scale)")
    right.set_title("per worker: sent at load against its planned weights")
    right.set_xticks(list(where))
    right.set_xticklabels([f"{w}\n{label}" for label, w in bars], rotation=20, ha="right", fontsize="small")
    if bars:
        right.legend(fontsize="small")
    for ax in (left, right):
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bytes_label(value: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return "%.3g %s" % (value / size, unit)
    return "%d B" % value


def write_report(points: list[Point], folder: Path, echo: Callable[[str], None] | None = None) -> dict[str, Path]:
    """Write every file of the report into ``folder`` (created); their paths by name.

    ``echo`` gets the fitted model's lines (print, or a progress logger).
    """
    folder.mkdir(parents=True, exist_ok=True)
    fitted = fits(points)
    base = baselines(points)
    paths = {name: folder / name for name in ("results.json", "points.csv", "sweep.csv", "report.md", *PLOTS)}
    raw = {"points": [asdict(p) for p in points],
           "baselines": {" ".join(g for g in k if g) or "all": {"nodes": b.nodes, "latency_ms": b.latency_ms}
                         for k, b in base.items()},
           "fits": {name: asdict(fit) for name, fit in fitted.items()}}
    paths["results.json"].write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    write_csv(paths["points.csv"], csv_rows(points), POINT_COLUMNS)
    write_csv(paths["sweep.csv"], sweep_rows(points),
              ("nodes", "latency_ms", "policy", "bandwidth_mbit", "build", *SWEEP_COLUMNS))
    paths["report.md"].write_text(markdown(points, fitted), encoding="utf-8")
    plot_vs_latency(paths["tok_s_vs_latency.png"], points, "tok_s", 1.0, "generation tok/s (client)",
                    "Generation speed against link latency")
    plot_vs_latency(paths["ttft_vs_latency.png"], points, "ttft_s", 1000.0, "time to first token (ms)",
                    "Time to first token against link latency")
    plot_load_and_bytes(paths["load_and_bytes.png"], points)
    for name, fit in fitted.items():
        (echo or (lambda line: None))("per-token model (%s): %s" % (name, fit.describe()))
    return paths


def load_points(path: Path) -> list[Point]:
    """Points from a results.json (or a bare JSON list of points)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    return [Point.from_dict(p) for p in (data["points"] if isinstance(data, dict) else data)]


def main(argv: list[str] | None = None) -> int:
    """``python -m llamafleet.bench.report RESULTS.json --out DIR``: write the report again from raw points."""
    parser = argparse.ArgumentParser(prog="python -m llamafleet.bench.report",
                                     description="Write the benchmark report (JSON, CSV, Markdown, PNG) from points.")
    parser.add_argument("results", type=Path, help="results.json of a run, or a JSON list of points")
    parser.add_argument("--out", type=Path, required=True, help="folder for the report")
    args = parser.parse_args(argv)
    try:
        points = load_points(args.results)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        parser.error("%s: %s" % (args.results, exc))
    paths = write_report(points, args.out, echo=print)
    print((args.out / "report.md").read_text(encoding="utf-8"), end="")
    print("report: %s" % ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
