"""PNG figures of simulator runs (matplotlib, imported on use, Agg backend)."""

from collections.abc import Sequence


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values: Sequence[float], label: str, scale: float = 1.0) -> None:
    import numpy as np

    v = np.sort(np.asarray(values, dtype=float)) * scale
    if len(v):
        ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label)


def run_figure(sim, path: str) -> None:
    """One run: TTFT and TBT distributions, and the pools' SLO-relative load over time."""
    plt = _plt()
    done = [r for r in sim.requests if r.state == "DONE"]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    _cdf(ax[0], [r.ttft_s for r in done], "TTFT")
    ax[0].set_xscale("log")
    ax[0].set_xlabel("TTFT (s)")
    ax[0].set_ylabel("fraction of completed requests")
    ax[0].axvline(sim.cfg.ttft_slo_s, color="r", ls="--", lw=0.8)
    _cdf(ax[1], [r.tbt_s for r in done if r.tbt_s >= 0], "TBT", 1e3)
    ax[1].set_xlabel("TBT, mean of longest 10% gaps (ms)")
    ax[1].axvline(sim.cfg.tbt_slo_s * 1e3, color="r", ls="--", lw=0.8)
    t = [s["t"] / 60 for s in sim.samples]
    ax[2].plot(t, [s["prefill_load"] for s in sim.samples], label="prefill load (queue / TTFT SLO)")
    ax[2].plot(t, [s["decode_load"] for s in sim.samples], label="decode load (step / TBT SLO)")
    ax[2].set_xlabel("sim time (min)")
    ax[2].legend(fontsize=8)
    if any(s["prefill"] != sim.cfg.prefill for s in sim.samples):
        tw = ax[2].twinx()
        tw.step(t, [s["prefill"] for s in sim.samples], "g:", where="post", label="prefill nodes")
        tw.set_ylabel("prefill nodes")
    c = sim.cfg
    fig.suptitle(
        f"{c.prefill}P{c.decode}D {c.policy}/{c.admission} speed x{c.speed:g}: "
        f"{len(done)}/{len(sim.requests)} completed"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bars(
    path: str,
    labels: Sequence[str],
    series: dict[str, Sequence[float]],
    ylabel: str,
    title: str,
    fmt: str = "{:.2f}",
) -> None:
    """Grouped bars: one group per label, one bar per series."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(1.6 * len(labels) + 3, 4))
    k = len(series)
    w = 0.8 / k
    for j, (name, vals) in enumerate(series.items()):
        xs = [i + (j - (k - 1) / 2) * w for i in range(len(labels))]
        b = ax.bar(xs, vals, w, label=name)
        ax.bar_label(b, labels=[fmt.format(v) for v in vals], fontsize=8)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if k > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def lines(
    path: str,
    x: Sequence[float],
    series: dict[str, Sequence[float]],
    xlabel: str,
    ylabel: str,
    title: str,
    xlog: bool = False,
    vline: float | None = None,
    secondary: dict[str, Sequence[float]] | None = None,
    ylabel2: str = "",
) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, ys in series.items():
        ax.plot(x, ys, marker="o", ms=3, label=name)
    if xlog:
        ax.set_xscale("log")
    if vline is not None:
        ax.axvline(vline, color="gray", ls="--", lw=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    handles, names = ax.get_legend_handles_labels()
    if secondary:
        tw = ax.twinx()
        for name, ys in secondary.items():
            (h,) = tw.plot(x, ys, marker="s", ms=3, ls="--", label=name, color="tab:red")
            handles.append(h)
            names.append(name)
        tw.set_ylabel(ylabel2)
    ax.legend(handles, names, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def xticks_lines(
    path: str,
    labels: Sequence[str],
    series: dict[str, Sequence[float]],
    ylabel: str,
    title: str,
    secondary: dict[str, Sequence[float]] | None = None,
    ylabel2: str = "",
    log2: bool = False,
) -> None:
    """Lines over categorical x (e.g. P/D splits)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    xs = list(range(len(labels)))
    for name, ys in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xticks(xs, labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    handles, names = ax.get_legend_handles_labels()
    if secondary:
        tw = ax.twinx()
        colors = ["tab:red", "tab:purple", "tab:brown"]
        for i, (name, ys) in enumerate(secondary.items()):
            (h,) = tw.plot(xs, ys, marker="s", ls="--", label=name, color=colors[i % 3])
            handles.append(h)
            names.append(name)
        tw.set_ylabel(ylabel2)
        if log2:
            tw.set_yscale("log")
    ax.legend(handles, names, fontsize=8, loc="center left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
