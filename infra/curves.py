"""A run's own curves: the signals docs/usage.md's "Reading a run" says to watch, drawn from its
metrics.jsonl into curves.png. train.py redraws it at each eval (report.Report.curves; not with
--no-plot).

    python comparison/plot.py runs/X          # the same figure, drawn again: runs/X/curves.png

The standard library only, plus matplotlib when drawing: without it each function prints how to
get it and returns None. Each figure is a plain matplotlib Figure on the Agg canvas (no pyplot
state is touched); it is saved as a PNG and returned, for a notebook to show or a test to inspect.
The drawing helpers here (new_figure, series, accuracy_axes, save) also draw comparison/plot.py's
figures of several runs.
"""
from __future__ import annotations

import json
import math
import os

HINT = "matplotlib is not installed: no {path} written (pip install matplotlib)"
HEALTHY = dict(color="tab:green", alpha=0.13)                     # a healthy range: a green band
REFERENCE = dict(color="0.35", lw=1.0, ls="--")                    # a reference value
DANGER = dict(color="tab:red", lw=1.0, ls=":")                     # where a run has gone wrong


def read_metrics(run_dir: str) -> tuple[list[dict], list[dict]]:
    """(steps, evals): the rows of run_dir/metrics.jsonl in file order, split into optimizer-step rows
    and eval rows (those with eval_accuracy). Every row carries the cumulative counters step, round,
    gen_tokens, gen_seconds and train_seconds. A last line cut short (a run killed mid-write) is skipped."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = f.read().rstrip("\n").split("\n")
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:                  # only the last line may be cut short
                raise ValueError(f"{run_dir}/metrics.jsonl: line {i + 1} is not JSON") from None
    # (step rows, eval rows); a round without an update has a row too (updates: 0), not a step's
    return ([r for r in rows if "eval_accuracy" not in r and r.get("updates") != 0],
            [r for r in rows if "eval_accuracy" in r])


def read_config(run_dir: str) -> dict:
    """run_dir/config.json (the run's flags), or {} when it is missing or unreadable."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def running_mean(ys: list[float], window: int) -> list[float]:
    """Centred running mean: each point averaged with its window//2 neighbours on each side (fewer at the ends)."""
    half = window // 2
    return [sum(ys[max(0, i - half):i + half + 1]) / len(ys[max(0, i - half):i + half + 1]) for i in range(len(ys))]


def smoothing_window(n: int) -> int:
    """Steps in the running mean of a per-step series of n points: n/20, between 1 (none) and 25."""
    return max(1, min(25, n // 20))


# ---- drawing helpers -------------------------------------------------------------------------
def new_figure(path: str, figsize: tuple[float, float]):
    """A Figure on the Agg canvas, or None (the hint printed) when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401             first: a submodule already imported would hide its absence
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print(HINT.format(path=path))
        return None
    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _x(row: dict, key: str):
    if key == "seconds":                            # time spent generating and training (evals excluded)
        if row.get("wall_seconds"):                 # the loop's wall clock, where it has one
            return row["wall_seconds"]
        g, t = row.get("gen_seconds"), row.get("train_seconds")
        return g + t if _finite(g) and _finite(t) else None
    return row.get(key)


def _points(rows: list[dict], x: str, y: str) -> tuple[list[float], list[float]]:
    pts = [(_x(r, x), r.get(y)) for r in rows]
    pts = [p for p in pts if _finite(p[0]) and _finite(p[1])]
    return [p[0] for p in pts], [p[1] for p in pts]


def series(ax, rows: list[dict], x: str, y: str, label: str, color: str, window: int = 1, **kw) -> list[float]:
    """Draw rows' y against x. window > 1: the raw series faint, its running mean bold (and labelled).
    The line's gid is the field name (the mean's: name + ':mean'). Returns the y values drawn (raw)."""
    xs, ys = _points(rows, x, y)
    if not xs:
        return []
    if window > 1 and len(ys) > window:
        ax.plot(xs, ys, color=color, alpha=0.25, lw=0.7, gid=y)
        ax.plot(xs, running_mean(ys, window), color=color, lw=1.8, label=label, gid=y + ":mean", **kw)
    else:
        style = {"marker": "o" if len(ys) < 30 else None, "ms": 3.5, **kw}
        ax.plot(xs, ys, color=color, lw=1.5, label=label, gid=y, **style)
    return ys


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, what, transform=ax.transAxes, ha="center", va="center", color="0.5", fontsize=10)
    ax.set_xticks([])
    ax.set_yticks([])


def _legend(ax, **kw) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, framealpha=0.85, **kw)


def count_axis(ax, label: str = "generated completion tokens") -> None:
    """An x axis of counts (tokens, rollouts): whole-number ticks, written 200k, 1.5M."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.xaxis.set_major_formatter(FuncFormatter(
        lambda v, _: f"{v / 1e6:g}M" if abs(v) >= 1e6 else f"{v / 1e3:g}k" if abs(v) >= 1e3 else f"{v:g}"))
    lo, hi = ax.get_xlim()
    if hi - lo < 2:                                 # a single point (the step-0 eval): no fractions of a token
        ax.set_xlim(lo - 1, hi + 1)
    ax.set_xlabel(label)


def accuracy_axes(ax, xlabel: str, title: str, counts: bool = False) -> None:
    """The axes of an accuracy curve, shared by plot_run, plot_runs and plot_arms; counts: x counts tokens or
    rollouts."""
    if counts:
        count_axis(ax, xlabel)
    else:
        ax.set_xlabel(xlabel)
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(title, fontsize=11)
    ax.grid(alpha=0.3)


# ---- one run ---------------------------------------------------------------------------------
def save(fig, path: str, dpi: int) -> None:
    """The figure at path, whole or not at all (written beside it, then renamed): a full disk never
    leaves half a PNG in place of the last good one."""
    tmp = path + ".tmp"
    try:
        fig.savefig(tmp, dpi=dpi, format=os.path.splitext(path)[1][1:] or "png")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def plot_run(run_dir: str, path: str | None = None):
    """Write the health panels of one run to path (default run_dir/curves.png); return the Figure,
    or None without matplotlib. Panels: accuracy and reward against generated tokens; accuracy against
    seconds; entropy; importance ratios; truncation and KL; rollout age and uses; zero-advantage
    groups; a summary of the run. Per-step series: faint raw, bold running mean."""
    path = path or os.path.join(run_dir, "curves.png")
    steps, evals = read_metrics(run_dir)
    asynchronous = any("trainer_wait_frac" in r for r in steps)    # --generators: one panel more
    fig = new_figure(path, (25 if asynchronous else 20, 9.5))
    if fig is None:
        return None
    cfg = read_config(run_dir)
    window = smoothing_window(len(steps))
    panels = list(fig.subplots(2, 5 if asynchronous else 4).flat)
    if asynchronous:
        async_panels(panels.pop(4), panels.pop(8), steps)
    acc_tokens, acc_seconds, ent, ratio, trunc, age, zero, info = panels
    no_steps = "not logged in this run" if steps else "no optimizer step logged yet"

    # accuracy (and the sampled reward) against generated tokens, then accuracy against seconds
    for ax, x in ((acc_tokens, "gen_tokens"), (acc_seconds, "seconds")):
        series(ax, evals, x, "eval_accuracy", "held-out accuracy (greedy)", "C0", marker="o", ms=4)
        series(ax, evals, x, "eval_strict", "held-out, strict format", "C9", ls="--")
        series(ax, evals, x, "eval_lenient", "held-out, lenient (last number)", "C4", ls=":")
        if not evals:
            _no_data(ax, "no eval logged yet")
    series(acc_tokens, steps, "gen_tokens", "reward", "sampled reward of the newest round", "C1", window)
    accuracy_axes(acc_tokens, "generated completion tokens", "accuracy and reward (healthy: rising)", counts=True)
    acc_tokens.set_ylabel("accuracy / mean reward")
    walled = any(r.get("wall_seconds") for r in steps)
    accuracy_axes(acc_seconds, "wall seconds, evals excluded" if walled else
                  "seconds generating + training (evals excluded)", "accuracy against time")
    for ax in (acc_tokens, acc_seconds):
        _legend(ax, loc="best")

    # policy entropy: falls slowly; a crash to ~0 is a collapse
    drawn = series(ent, steps, "step", "entropy", "on the update batch", "C2", window)
    drawn += series(ent, steps, "step", "rollout_entropy", "on the fresh rollouts", "C6", window, ls="--")
    if drawn:
        ent.axhline(0, label="collapse: a crash to ~0", **DANGER)
        ent.set_ylim(-0.04 * max(drawn), 1.1 * max(max(drawn), 1e-9))
    else:
        _no_data(ent, no_steps)
    ent.set_title("policy entropy (healthy: falls slowly, not to ~0)", fontsize=11)
    ent.set_ylabel("nats per token")

    # importance ratios rho = pi/mu over the batch's tokens, on a log axis
    drawn = series(ratio, steps, "step", "is_ratio_max", "max rho (healthy: a few at most)", "C3", window)
    drawn += series(ratio, steps, "step", "is_ratio_mean", "mean rho", "C0", window)     # on top of max
    if drawn:
        ratio.set_yscale("log")
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
        ratio.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ratio.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ratio.yaxis.set_minor_formatter(NullFormatter())
        ratio.axhline(1, label="healthy mean: 1 (fresh data)", **REFERENCE)
        top = 2.0
        if cfg.get("loss", "tis") == "tis" and _finite(cfg.get("is_cap")):
            top = cfg["is_cap"]
            ratio.axhline(top, label=f"cap C = {top:g}: weights cut above", **DANGER)
        elif cfg.get("loss") == "ppo" and _finite(cfg.get("epsilon")):
            ratio.axhspan(1 - cfg["epsilon"], 1 + cfg["epsilon"], label=f"ppo clip range 1 +/- {cfg['epsilon']:g}",
                          **HEALTHY)
        positive = [v for v in drawn if v > 0]
        ratio.set_ylim(min([0.5] + [v / 1.3 for v in positive]), max([1.5 * top] + [v * 1.3 for v in positive]))
    else:
        _no_data(ratio, no_steps)
    ratio.set_title("importance ratio rho = pi / mu (healthy: mean ~1)", fontsize=11)
    ratio.set_ylabel("rho (log scale)")

    # staleness: truncated tokens and the KL estimate, both healthy below 0.05
    drawn = series(trunc, steps, "step", "is_truncated_frac", "tokens truncated / clipped", "C3", window)
    drawn += series(trunc, steps, "step", "approx_kl", "approx KL(mu, pi)", "C5", window)
    if drawn:
        trunc.axhspan(min(0.0, min(drawn)), 0.05, label="healthy: < 0.05", **HEALTHY)
        trunc.set_ylim(min(0.0, min(drawn)) - 0.005, max(0.1, 1.1 * max(drawn)))
    else:
        _no_data(trunc, no_steps)
    trunc.set_title("staleness: truncation and KL (healthy: < 0.05)", fontsize=11)
    trunc.set_ylabel("fraction of tokens / nats")

    # how old the replayed rollouts are, and how often they were used
    drawn = series(age, steps, "step", "age_mean", "age, mean (steps)", "C0", window)
    drawn += series(age, steps, "step", "age_max", "age, max (steps)", "C0", window, ls="--")
    drawn += series(age, steps, "step", "uses_mean", "uses, mean (this one included)", "C1", window)
    expected = expected_age_uses(cfg)
    if drawn and expected:
        age.axhline(expected[0], label=f"expected mean age {expected[0]:g}", color="C0", lw=0.9, ls=":")
        age.axhline(expected[1], label=f"expected mean uses {expected[1]:g}", color="C1", lw=0.9, ls=":")
    if not drawn:
        _no_data(age, no_steps)
    age.set_title("replay: rollout age and uses" + (" (dotted: expected)" if drawn and expected else ""), fontsize=11)
    age.set_ylabel("optimizer steps / uses")

    # groups whose rewards were all equal: they train nothing
    drawn = series(zero, steps, "step", "zero_adv_frac", "groups with all-equal rewards", "C7", window)
    if drawn:
        zero.axhline(1, label="1: no group carries a signal", **DANGER)
        zero.set_ylim(-0.03, 1.08)
    else:
        _no_data(zero, no_steps)
    zero.set_title("zero-advantage groups (healthy: below 1)", fontsize=11)
    zero.set_ylabel("fraction of the newest round's groups")

    for ax in (ent, ratio, trunc, age, zero):
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        _legend(ax, loc="best")
    info.axis("off")
    info.text(0.0, 1.0, run_summary(steps, evals, cfg), transform=info.transAxes, va="top", family="monospace",
              fontsize=9)
    smoothing = f"faint: every step; bold: running mean of {window} steps; " if window > 1 else ""
    fig.suptitle(f"{os.path.normpath(run_dir)}: {smoothing}green: healthy range", fontsize=13)
    save(fig, path, dpi=100)
    return fig


def async_panels(waits, rates, steps: list[dict]) -> None:
    """--generators: against wall seconds, the shares of the wall time so far that the trainer
    waited for rollouts and the workers for room or for weights; rollouts per wall second."""
    for key, label, color in (("trainer_wait_frac", "trainer waiting for rollouts", "C3"),
                              ("worker_room_wait_frac", "workers waiting for room", "C1"),
                              ("worker_weights_wait_frac", "workers waiting for weights", "C5")):
        series(waits, steps, "wall_seconds", key, label, color)
    waits.set_ylim(-0.03, 1.03)
    waits.set_title("async: who waited (share of the wall time so far)", fontsize=11)
    for key, label, color in (("generated_per_s", "generated", "C0"),
                              ("stored_per_s", "stored", "C2"),
                              ("trained_per_s", "trained on (uses)", "C1")):
        series(rates, steps, "wall_seconds", key, label, color)
    rates.set_title("async: rollouts per wall second", fontsize=11)
    for ax in (waits, rates):
        ax.set_xlabel("wall seconds")
        ax.grid(alpha=0.3)
        _legend(ax, loc="best")


def expected_age_uses(cfg: dict) -> tuple[float, float] | None:
    """The expected (mean age, mean uses) of a batch's rollouts for plain FIFO replay with K = 1:
    age ~ (N/R - 1)/2, uses ~ (1 + B/R)/2. None for other settings, or without the config."""
    try:
        R, N, B = cfg["prompts_per_round"] * cfg["num_generations"], cfg["buffer_size"], cfg["batch_size"]
        plain = (cfg["updates_per_round"] == 1 and cfg.get("reuse", True) and not cfg.get("keep_correct_frac")
                 and not cfg.get("skip_zero_advantage") and not cfg.get("max_age"))
    except (KeyError, TypeError):
        return None
    return ((N / R - 1) / 2, (1 + B / R) / 2) if plain and R > 0 else None


def run_summary(steps: list[dict], evals: list[dict], cfg: dict) -> str:
    """A few lines on what the run was and what it did, for the figure's last panel."""
    lines = ["the run"]
    if cfg:
        P, G = cfg.get("prompts_per_round", 0), cfg.get("num_generations", 0)
        R, B, N, K = P * G, cfg.get("batch_size"), cfg.get("buffer_size"), cfg.get("updates_per_round")
        lines += [f"model {cfg.get('model')}, task {cfg.get('task')}",
                  f"R = {R} new rollouts per round ({P} prompts x {G})",
                  f"B = {B} rollouts per update, K = {K} per round", f"buffer N = {N} rollouts (FIFO)"]
        if R and B and K:
            lines.append(f"replay ratio K*B/R = {K * B / R:.2f} uses per rollout")
        lines.append(f"loss {cfg.get('loss')}, lr {cfg.get('lr')}, seed {cfg.get('seed')}")
        if cfg.get("generators"):
            S = cfg.get("new_per_update")
            lines.append(f"async: {cfg['generators']} worker(s); steps "
                         + (f"once S = {S} new are stored" if S else
                            "whenever B are in (--step-when-held)" if cfg.get("step_when_held")
                            else "K for each round that arrives"))
    else:
        lines.append("(no config.json)")
    last = max(steps + evals, key=lambda r: (r.get("step", 0), r.get("gen_tokens", 0)), default={})
    lines += ["", "what it did",
              f"{last.get('step', 0)} optimizer steps in {last.get('round', 0)} rounds",
              f"{last.get('gen_tokens', 0):,} completion tokens generated",
              f"seconds: generation {last.get('gen_seconds', 0):.1f}, training {last.get('train_seconds', 0):.1f}"]
    if evals:
        first, end = evals[0], evals[-1]
        lines.append(f"held-out accuracy {first['eval_accuracy']:.3f} (step {first.get('step', 0)})"
                     f" -> {end['eval_accuracy']:.3f} (step {end.get('step', 0)})")
    lines.append(f"skipped steps {last.get('skipped_steps', 0)}, reward errors {last.get('reward_errors', 0)}")
    return "\n".join(lines)
