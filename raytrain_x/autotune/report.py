"""`raytrain-x autotune-report`: a table of an autotune log and a plot of its progress."""

from __future__ import annotations

import os

from raytrain_x.common.autotune_log import SCORE_COLUMN, SCORED_KINDS, read_rows
from raytrain_x.common.extras import import_extra

_SCALE = {"bytes/s": (1e6, "MB/s")}  # unit -> (divisor, shown unit); others shown as is


def autotune_report(log_path: str | os.PathLike, plot_path: str | None = None) -> None:
    """Prints the samples, the searched knobs, the chosen knobs and the cost of tuning;
    with `plot_path`, draws score per sample and the best-so-far curve."""
    pd = import_extra("pandas", "tune", "autotune-report")
    read_rows(log_path)  # validates the schema with a clear error
    frame = pd.read_csv(log_path, keep_default_na=False, na_values={SCORE_COLUMN: [""]})
    if "unit" not in frame:  # a log written before scores had units
        frame = frame.rename(columns={"score_bytes_per_s": SCORE_COLUMN}).assign(unit="bytes/s")
    samples = frame[frame["kind"].isin(SCORED_KINDS)].copy()
    if not len(samples):
        warm = int((frame["kind"] == "warmup").sum())
        print(f"no scored samples in {log_path} ({warm} warmup samples): the job ended "
              "before tuning got going; tune a longer run, or lower --autotune-warmup-samples "
              "and --autotune-steps-per-sample")
        return
    unit = samples["unit"].iloc[-1]
    divisor, shown = _SCALE.get(unit, (1.0, unit))
    samples[shown] = samples[SCORE_COLUMN].astype(float) / divisor
    samples[f"best so far {shown}"] = samples[shown].cummax()
    columns = ["sample", "kind", "fusion_threshold_mb", "cycle_time_ms", "cache_capacity",
               "hierarchical_allreduce", "hierarchical_allgather", shown,
               f"best so far {shown}"]
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(samples[columns].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    searched = samples["searched"].iloc[-1] if "searched" in samples else ""
    if searched:
        print(f"\nsearched: {searched.replace('+', ', ')} (the other knobs cannot matter in "
              "this job or were fixed)")
    best = frame[frame["kind"] == "best"]
    start = samples.iloc[0][shown]
    if len(best):
        row = best.iloc[-1]
        score = float(row[SCORE_COLUMN]) / divisor
        print(f"\nbest: bucket/fusion {float(row['fusion_threshold_mb']):g} MB, cycle "
              f"{float(row['cycle_time_ms']):g} ms, cache {row['cache_capacity']}, "
              f"hierarchical allreduce/allgather {row['hierarchical_allreduce']}/"
              f"{row['hierarchical_allgather']}: {score:.4g} {shown}, "
              f"{score / start:.2f}x the start ({len(samples)} samples; the best row's "
              "score is the mean of its measurements)")
    else:
        print(f"\ntuning did not finish: {len(samples)} samples, best so far "
              f"{samples[shown].max():.4g} {shown} ({samples[shown].max() / start:.2f}x)")
    after = frame[frame["kind"] == "after"]
    if len(after):
        row = after.iloc[-1]
        print(f"cost of tuning: {float(row['tuning_s']):.1f} s for {row['tuning_steps']} steps, "
              f"{float(row['cost']):.2f}x the same steps at the chosen knobs (measured after "
              f"tuning); chosen knobs {float(row['gain']):.2f}x the start")
    if plot_path:
        _plot(frame, samples, shown, divisor, plot_path)


def _plot(frame, samples, shown: str, divisor: float, plot_path: str) -> None:
    import_extra("matplotlib", "tune", "autotune-report --plot").use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    warm = frame[frame["kind"] == "warmup"]
    ax.scatter(warm["sample"].astype(int), warm[SCORE_COLUMN].astype(float) / divisor,
               color="lightgray", label="warmup (discarded)")
    search = samples[samples["kind"] == "sample"]
    again = samples[samples["kind"] == "confirm"]
    ax.plot(search["sample"].astype(int), search[shown], "o", label="sample score")
    if len(again):
        ax.plot(again["sample"].astype(int), again[shown], "s", color="tab:orange",
                label="candidate measured again")
    ax.step(samples["sample"].astype(int), samples[f"best so far {shown}"], where="post",
            label="best so far")
    ax.axhline(samples.iloc[0][shown], color="gray", linestyle=":", label="starting knobs")
    ax.set_xlabel("sample")
    ax.set_ylabel(shown)
    ax.set_title("raytrain-x autotune")
    ax.legend()
    fig.tight_layout()
    fig.savefig(plot_path, dpi=110)
    print(f"plot written to {plot_path}")
