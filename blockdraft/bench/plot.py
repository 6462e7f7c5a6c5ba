"""PNG of a benchmark report: tokens/s and ms per step against batch size, one line per engine.

Also a command, to redraw from a JSON written elsewhere (e.g. on a machine without matplotlib):

    python -m blockdraft.bench.plot bench-qwen3-8b.json bench-qwen3-8b.png
"""

from __future__ import annotations

import json
import sys

_STYLE = {  # (engine, mode) -> matplotlib style
    ("ours", "plain"): dict(color="tab:blue", marker="o", linestyle="-"),
    ("ours", "dflash"): dict(color="tab:red", marker="s", linestyle="-"),
    ("ours", "dflash-forced"): dict(color="tab:red", marker="s", linestyle=":"),
    ("hf", "plain"): dict(color="tab:gray", marker="^", linestyle="--"),
    ("zlab", "plain"): dict(color="tab:green", marker="v", linestyle="--"),
    ("zlab", "dflash"): dict(color="tab:olive", marker="D", linestyle="--"),
}


def plot_report(report: dict, path: str) -> None:
    """Write the two-panel PNG for `report` (a blockdraft-bench/1 document) to `path`.

    Raises:
        ValueError: matplotlib is not installed (pip install matplotlib); or redraw later with
            `python -m blockdraft.bench.plot REPORT.json OUT.png` where it is.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("the plot needs matplotlib (pip install matplotlib), or redraw it elsewhere with "
                         "python -m blockdraft.bench.plot REPORT.json OUT.png") from e
    series: dict[tuple[str, str], list[dict]] = {}
    for r in report["results"]:
        if r["status"] == "ok":
            series.setdefault((r["engine"], r["mode"]), []).append(r)
    fig, (ax_tps, ax_ms) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, rows in series.items():
        rows = sorted(rows, key=lambda r: r["batch_size"])
        xs = [r["batch_size"] for r in rows]
        style = _STYLE.get(key, {})
        label = f"{key[0]} {key[1]}"
        ax_tps.plot(xs, [r["tokens_per_s"] for r in rows], label=label, **style)
        ax_ms.plot(xs, [r["ms_per_step"] for r in rows], label=label, **style)
    floor = report["floor"].get("plain_step_floor_ms")
    if floor and report["device"].get("type") != "cpu":  # an HBM floor means nothing for a CPU run
        ax_ms.axhline(floor, color="black", linewidth=0.8, linestyle="-.", label="HBM floor (plain step)")
    batches = sorted({r["batch_size"] for r in report["results"]})
    for ax, ylabel in ((ax_tps, "output tokens/s (end to end)"), (ax_ms, "ms per target step")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_ms.legend(fontsize=8)
    w, d = report["workload"], report["device"]
    fig.suptitle(f"{w['name']} ({report['dtype']}) on {d['name']}, {report['settings']['max_tokens']} tokens/request")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """`python -m blockdraft.bench.plot REPORT.json OUT.png`."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m blockdraft.bench.plot REPORT.json OUT.png", file=sys.stderr)
        return 2
    with open(args[0]) as f:
        plot_report(json.load(f), args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
