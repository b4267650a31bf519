"""PNG plots (Agg): latency CDFs with several runs overlaid, per-replica load over time,
capacity searches probe by probe."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.harness.workload import results_rate_unit  # noqa: E402

DPI = 100


def _cdf(ax, values, label):
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")


def cdf_plot(path: Path, runs: dict[str, object], metrics=("ttft", "tbt", "e2e"), title: str = "") -> Path:
    """runs: label -> list of loadgen.Result; one panel per metric, one line per run."""
    getters = {
        "ttft": ("TTFT (s)", lambda rs: [r.ttft for r in rs if r.ok]),
        "tbt": ("time between tokens (s)", lambda rs: [g for r in rs if r.ok for g in r.tbts]),
        "e2e": ("end-to-end (s)", lambda rs: [r.e2e for r in rs if r.ok]),
        "e2e_norm": ("end-to-end per output token (s)",
                     lambda rs: [r.e2e / r.output_tokens for r in rs if r.ok and r.output_tokens]),
    }
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.4), squeeze=False)
    for ax, m in zip(axes[0], metrics):
        xlabel, get = getters[m]
        for label, rs in runs.items():
            _cdf(ax, get(rs), label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
        if m == "tbt":
            ax.set_xscale("log")
    axes[0][0].legend(fontsize=7, loc="lower right")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def load_plot(path: Path, timeline, scrapes=None, title: str = "") -> Path:
    """timeline: (times, {replica: counts}) from metrics.inflight_timeline; scrapes: the
    router's quadriga_inflight_requests samples [(t, {replica: value})], drawn dashed."""
    times, series = timeline
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for rep, counts in series.items():
        ax.step(times, counts, where="post", label=f"{rep} (client view)")
    if scrapes:
        reps = sorted({k for _, v in scrapes for k in v})
        for rep in reps:
            ax.plot([t for t, _ in scrapes], [v.get(rep, 0) for _, v in scrapes], "--",
                    label=f"{rep} (router metric)", alpha=0.7)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("requests in flight")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def bar_plot(path: Path, rows: list[tuple[str, dict[str, float]]], ylabel: str, title: str = "",
             spread: list[dict[str, tuple[float, float]]] | None = None) -> Path:
    """rows: (group label, {series: value}); grouped bars, e.g. p99 TTFT per load per policy.
    spread: per row, {series: (low, high)} drawn as an error bar (the range of repeats)."""
    import numpy as np

    series = sorted({k for _, d in rows for k in d})
    fig, ax = plt.subplots(figsize=(7, 3.4))
    width = 0.8 / max(1, len(series))
    x = np.arange(len(rows))
    for i, s in enumerate(series):
        values = [d.get(s, 0) or 0 for _, d in rows]
        err = None
        if spread is not None:
            lows = [v - (sp.get(s, (v, v))[0] or 0) for v, sp in zip(values, spread)]
            highs = [(sp.get(s, (v, v))[1] or 0) - v for v, sp in zip(values, spread)]
            err = [lows, highs]
        ax.bar(x + i * width, values, width, label=s, yerr=err, capsize=2)
    ax.set_xticks(x + width * (len(series) - 1) / 2)
    ax.set_xticklabels([g for g, _ in rows], fontsize=8)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def capacity_plot(path: Path, searches: dict[str, dict], tbt_slo: float, keep_up: float,
                  title: str = "") -> Path:
    """searches: label -> a capacity result (its "probes" and "capacity_req_s"), one colour each.
    Left: every probe's p99 time between tokens against its rate, the SLO dashed. Right: the
    share of the offered rate it admitted (first tokens over the arrival window), the keep-up
    line dashed. Filled markers passed, hollow ones failed; a dotted line marks each capacity."""
    rows = -(-len(searches) // 3)  # legend rows under the panels
    fig, (tbt_ax, adm_ax) = plt.subplots(1, 2, figsize=(10, 3.8 + 0.2 * rows))
    panels = ((tbt_ax, lambda s: s["tbt_s"]["p99"]),
              (adm_ax, lambda s: (s["admitted_req_s"] / s["offered_req_s"]
                                  if s.get("admitted_req_s") and s.get("offered_req_s") else None)))
    unit = results_rate_unit(searches.values())
    for i, (label, result) in enumerate(searches.items()):
        color = f"C{i % 10}"
        probes = sorted(result.get("probes", []), key=lambda p: p["rate"])
        capacity = result.get("capacity_req_s")
        name = f"{label}: {capacity:.3g} {unit}" if capacity else f"{label}: none passed"
        for ax, value in panels:
            points = [(p["rate"], value(p["summary"]), p["passed"]) for p in probes]
            points = [pt for pt in points if pt[1] is not None]
            ax.plot([x for x, _, _ in points], [y for _, y, _ in points], "-", color=color, alpha=0.5,
                    label=name if ax is tbt_ax else None)
            for x, y, passed in points:
                ax.plot(x, y, "o", color=color, markerfacecolor=color if passed else "white")
            if capacity:
                ax.axvline(capacity, color=color, linestyle=":", alpha=0.7)
    handles, labels = tbt_ax.get_legend_handles_labels()
    tbt_ax.axhline(tbt_slo, color="black", linestyle="--", linewidth=1)
    tbt_ax.set_ylabel("p99 time between tokens (s)")
    tbt_ax.set_title(f"token gaps (SLO {tbt_slo * 1000:.0f} ms dashed)", fontsize=9)
    adm_ax.axhline(keep_up, color="black", linestyle="--", linewidth=1)
    adm_ax.set_ylabel("admitted / offered")
    adm_ax.set_title(f"keeping up over the arrival window ({keep_up:.0%} dashed)", fontsize=9)
    for ax in (tbt_ax, adm_ax):
        ax.set_xlabel(f"offered rate ({unit})")
        ax.grid(alpha=0.3)
    fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)) or 1, fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.045 * rows + 0.02, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
