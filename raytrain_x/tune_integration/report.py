"""`raytrain-x autotune-report`: a table of an autotune log and a plot of its progress."""

from __future__ import annotations

import os

from raytrain_x.common.autotune_log import SCORE_COLUMN, SCORED_KINDS, read_rows


def autotune_report(log_path: str | os.PathLike, plot_path: str | None = None) -> None:
    """Prints the samples and the chosen knobs; with `plot_path`, draws score per sample
    and the best-so-far curve."""
    import pandas as pd

    read_rows(log_path)  # validates the schema with a clear error
    frame = pd.read_csv(log_path)
    samples = frame[frame["kind"].isin(SCORED_KINDS)].copy()
    samples["MB/s"] = samples[SCORE_COLUMN] / 1e6
    samples["best so far MB/s"] = samples["MB/s"].cummax()
    columns = ["sample", "kind", "fusion_threshold_mb", "cycle_time_ms", "cache_capacity",
               "hierarchical_allreduce", "hierarchical_allgather", "MB/s", "best so far MB/s"]
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(samples[columns].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    best = frame[frame["kind"] == "best"]
    if len(samples):
        start = samples.iloc[0]["MB/s"]
        if len(best):
            row = best.iloc[-1]
            print(f"\nbest: fusion {row['fusion_threshold_mb']:g} MB, cycle "
                  f"{row['cycle_time_ms']:g} ms, cache {row['cache_capacity']}, hierarchical "
                  f"allreduce/allgather {row['hierarchical_allreduce']}/"
                  f"{row['hierarchical_allgather']}: {row[SCORE_COLUMN] / 1e6:.1f} MB/s, "
                  f"{row[SCORE_COLUMN] / 1e6 / start:.2f}x the start ({len(samples)} samples; "
                  "the best row's score is the mean of its measurements)")
        else:
            print(f"\ntuning did not finish: {len(samples)} samples, best so far "
                  f"{samples['MB/s'].max():.1f} MB/s ({samples['MB/s'].max() / start:.2f}x)")
    if plot_path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        warm = frame[frame["kind"] == "warmup"]
        ax.scatter(warm["sample"].astype(int), warm[SCORE_COLUMN] / 1e6, color="lightgray",
                   label="warmup (discarded)")
        search = samples[samples["kind"] == "sample"]
        again = samples[samples["kind"] == "confirm"]
        ax.plot(search["sample"].astype(int), search["MB/s"], "o", label="sample score")
        if len(again):
            ax.plot(again["sample"].astype(int), again["MB/s"], "s", color="tab:orange",
                    label="candidate measured again")
        ax.step(samples["sample"].astype(int), samples["best so far MB/s"], where="post",
                label="best so far")
        if len(samples):
            ax.axhline(samples.iloc[0]["MB/s"], color="gray", linestyle=":",
                       label="starting knobs")
        ax.set_xlabel("sample")
        ax.set_ylabel("bytes allreduced + allgathered per second (MB/s)")
        ax.set_title("raytrain-x autotune")
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot_path, dpi=110)
        print(f"plot written to {plot_path}")
