"""Reads a treetrain run's logs with TensorBoard's own reader (EventAccumulator) and pandas, and
checks them against the run's log.jsonl (tests/run_logs.rs runs it; scripts/setup-peft.sh's
venv has both packages, scripts/setup-run-log-readers.sh installs them).

    python check_run_logs.py OUTPUT_DIR LOGGING_DIR sft|grpo

Checks, exiting 1 on the first failure:
- log.jsonl holds each step once, in order;
- every number of every log.jsonl line is a TensorBoard scalar under the tag transformers or
  TRL logs it as, at that step, equal to 1e-6 relative (TensorBoard stores float32), and no
  tag holds a step twice (after a resume, TensorBoard's purge of the orphaned steps);
- the settings (`args`) and, for GRPO, the completions table are text summaries;
- the evaluations are scalars under `eval/`;
- pandas reads metrics.csv and gets the same numbers for every training step and evaluation.

The tag names are written out here on their own (from TRL's GRPOTrainer and transformers'
TensorBoardCallback), not read from treetrain, so a renamed metric fails this check.
"""

import json
import math
import sys

import pandas as pd
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

# log.jsonl key -> the metric name TRL / transformers log.
RENAMES = {
    "lr": "learning_rate",
    "reward_mean": "reward",
    "completion_length": "completions/mean_length",
    "completion_length_max": "completions/max_length",
    "completion_length_min": "completions/min_length",
    "truncated_ratio": "completions/clipped_ratio",
    "clip_ratio": "clip_ratio/region_mean",
    "clip_ratio_low": "clip_ratio/low_mean",
    "clip_ratio_high": "clip_ratio/high_mean",
    "sampling_correction": "sampling/importance_sampling_ratio/mean",
    # TRL's async GRPO (`experimental/async_grpo`): the multi-turn drift tally.
    "realign_frac": "rollout/realign_frac",
    "fork_frac": "rollout/fork_frac",
    "drift_tokens_mean": "rollout/drift_tokens_mean",
    "drift_tokens_max": "rollout/drift_tokens_max",
}


def fail(message):
    print(f"check_run_logs: {message}", file=sys.stderr)
    sys.exit(1)


def expected_scalars(line):
    """The tags and values one log.jsonl line must appear as."""
    out = {}
    for key, value in line.items():
        if key == "step":
            continue
        tag = "train/" + RENAMES.get(key, key)
        if isinstance(value, bool):
            out[tag] = float(value)
        elif isinstance(value, (int, float)):
            out[tag] = float(value)
        elif isinstance(value, list):
            for entry in value:
                for field, x in entry.items():
                    if field != "name":
                        out[f"{tag}/{entry['name']}/{field}"] = float(x)
    return out


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-30)


def main(out_dir, logging_dir, kind):
    lines = [json.loads(l) for l in open(f"{out_dir}/log.jsonl")]
    steps = [l["step"] for l in lines]
    if steps != list(range(1, len(steps) + 1)):
        fail(f"log.jsonl steps are {steps}, not 1..{len(steps)} once each")

    acc = EventAccumulator(logging_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalar_tags = set(acc.Tags()["scalars"])
    events = {tag: acc.Scalars(tag) for tag in scalar_tags}
    for tag, evs in events.items():
        seen = [e.step for e in evs]
        if len(seen) != len(set(seen)):
            fail(f"TensorBoard tag {tag} holds a step twice: {seen}")
    checked = 0
    for line in lines:
        for tag, value in expected_scalars(line).items():
            at = [e.value for e in events.get(tag, []) if e.step == line["step"]]
            if len(at) != 1 or not close(at[0], value):
                fail(f"step {line['step']}: {tag} is {at} in TensorBoard, {value} in log.jsonl")
            checked += 1

    text_tags = set(acc.PluginTagToContent("text"))
    wanted_text = {"args"} | ({"completions"} if kind == "grpo" else set())
    if not wanted_text <= text_tags:
        fail(f"text summaries {sorted(text_tags)} lack {sorted(wanted_text - text_tags)}")
    if kind == "grpo":
        table = acc.Tensors("completions")[-1].tensor_proto.string_val[0].decode()
        if not table.startswith("| prompt | completion |"):
            fail(f"the completions text is not TRL's table: {table[:80]!r}")
    eval_tags = sorted(t for t in scalar_tags if t.startswith("eval/"))
    wanted_eval = "eval/loss" if kind == "sft" else "eval/reward"
    if wanted_eval not in eval_tags:
        fail(f"no {wanted_eval} scalar among {eval_tags}")

    csv = pd.read_csv(f"{out_dir}/metrics.csv")
    for line in lines:
        row = csv[(csv["step"] == line["step"]) & csv["train/loss"].notna()]
        if len(row) != 1:
            fail(f"metrics.csv has {len(row)} training rows for step {line['step']}")
        for tag, value in expected_scalars(line).items():
            if not close(float(row[tag].iloc[0]), value):
                fail(f"step {line['step']}: {tag} is {row[tag].iloc[0]} in metrics.csv, {value} in log.jsonl")
    evals = csv[csv[wanted_eval].notna()]
    tb_evals = {e.step: e.value for e in events[wanted_eval]}
    if sorted(evals["step"]) != sorted(tb_evals) or not all(
        close(v, tb_evals[s]) for s, v in zip(evals["step"], evals[wanted_eval])
    ):
        fail(f"{wanted_eval}: metrics.csv {list(zip(evals['step'], evals[wanted_eval]))}, TensorBoard {tb_evals}")
    print(json.dumps({"steps": len(lines), "scalars_checked": checked, "tags": len(scalar_tags),
                      "text": sorted(text_tags), "evaluations": len(evals)}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
