#!/usr/bin/env bash
# The GPU check: what treetrain does on one CUDA device, in one call, with binaries built on
# a CPU machine (the GPU machine has torch 2.11.0+cu130 in Python but no Rust toolchain and no
# network). Two steps:
#
#   scripts/gpu-check.sh prepare     # here: release binaries into target/gpu-check/ (~31 MB)
#   scripts/gpu-check.sh run OUT     # there, from the repo root: writes OUT/gpu-check.json + log
#
# `run` finds that torch's lib folder, loads its libtorch_cuda.so (TREETRAIN_TORCH_CUDA), and
# checks, each bounded in time:
#   1. `treetrain env`: CUDA found, the device named.
#   2. Parity with the CPU on the shipped SFT model: `score` log-probs (fp32, 1e-4), greedy
#      `generate` tokens (fp32), one SFT step's loss (fp32, 1e-4 relative); one GRPO step runs
#      with `dtype = "auto"` (bf16 mixed precision there, the CUDA policy).
#   3. Tree vs flat, TRL's release case: a random Qwen3-1.7B (benches/configs/qwen3-1.7b.json),
#      4 rollouts of L = 32768 tokens, bf16, forward + backward of the GRPO loss, activations
#      recomputed (gradient checkpointing), timed interleaved on the shared-prompt and
#      nested-fork scenarios.
#   4. Peak CUDA memory of one step of that case, one process per side (the caching allocator
#      keeps what it reserved): flat and tree with checkpointing, tree without.
#   5. Greedy decode, static cache, bf16, 8 prompts x 64 new tokens on the same random
#      Qwen3-1.7B: treetrain vs transformers' static cache (the transformers there), interleaved,
#      and against the bandwidth bound (weight bytes a step / a measured read rate there).
#   6. The decode step as a captured CUDA graph (libtreetrain_cuda_graph.so, carried beside the
#      binaries): `generate --cuda-graph` gives the tokens of `generate` on the shipped model,
#      and the generation bench times graph against no graph on a random SmolLM2-135M, fp32,
#      batch 8 (where a step is launch-bound), same tokens checked.
# Each step's status and seconds go into OUT/gpu-check.json, the benches' own JSON beside it.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin=$root/target/gpu-check

prepare() {
    cd "$root"
    cargo build --release --bin treetrain --bench tree_vs_flat --bench generation
    mkdir -p "$bin"
    cp target/release/treetrain "$bin/"
    for b in tree_vs_flat generation; do
        cp "$(ls -t target/release/deps/$b-* | grep -v '\.d$' | head -1)" "$bin/$b"
        strip "$bin/$b" 2>/dev/null || true
    done
    strip "$bin/treetrain" 2>/dev/null || true
    # The CUDA-graph and NCCL libraries build.rs made (loaded from beside the executable there).
    for lib in libtreetrain_cuda_graph.so libtreetrain_nccl.so; do
        cp "$(ls -t target/release/build/treetrain-*/out/$lib | head -1)" "$bin/"
    done
    du -sh "$bin"
}

# `check NAME SECONDS CMD...`: runs CMD within SECONDS, its output into the log, its status into
# the results.
check() {
    local name=$1 limit=$2
    shift 2
    local start status=0
    start=$(date +%s)
    echo "== $name: $*" >>"$log"
    timeout "$limit" "$@" >>"$log" 2>&1 || status=$?
    results+=("\"$name\": {\"status\": $status, \"seconds\": $(($(date +%s) - start))}")
    echo "$name: status $status ($(($(date +%s) - start)) s)"
}

run() {
    local out=$1
    mkdir -p "$out"
    log=$out/gpu-check.log
    : >"$log"
    results=()
    local torch_lib
    torch_lib=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
    export TREETRAIN_TORCH_CUDA=$torch_lib
    export LD_LIBRARY_PATH=$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    # The bench binaries were built elsewhere: their data, scripts and target/bench are here.
    export TREETRAIN_BENCH_ROOT=$root TREETRAIN_DATASETS=$root/datasets
    local tt=$bin/treetrain model=$root/datasets/tiny-qwen3-sft work=$out/work
    mkdir -p "$work"
    check env 60 "$tt" env --json
    "$tt" env --json >"$out/env.json" 2>>"$log" || true
    # 2. Parity: the same inputs on cpu and cuda.
    printf '{"input_ids": [1, 5, 9, 200, 31, 7, 8]}\n{"input_ids": [3, 4, 5, 6]}\n' >"$work/rows.jsonl"
    for device in cpu cuda; do
        check "score_$device" 120 "$tt" score --model "$model" --input "$work/rows.jsonl" --device "$device"
        "$tt" score --model "$model" --input "$work/rows.jsonl" --device "$device" >"$work/score_$device.jsonl" 2>>"$log" || true
        "$tt" generate --model "$model" --input "$work/rows.jsonl" --greedy --max-new-tokens 16 --device "$device" \
            >"$work/generate_$device.jsonl" 2>>"$log" || true
        [ "$device" = cuda ] && check generate_cuda_graph 120 sh -c "'$tt' generate --model '$model' \
            --input '$work/rows.jsonl' --greedy --max-new-tokens 16 --device cuda --cuda-graph >'$work/generate_graph.jsonl'"
        cat >"$work/sft_$device.toml" <<TOML
model = "$model"
dataset = "$root/datasets/sft/train.parquet"
output_dir = "$work/sft_$device"
device = "$device"
dtype = "fp32"
packing = "bfd"
batch_size = 8
max_steps = 1
learning_rate = 0.002
eval_fraction = 0.0
[tokenize]
max_length = 256
TOML
        check "sft_step_$device" 300 "$tt" sft --config "$work/sft_$device.toml"
    done
    python3 - "$work" >>"$log" 2>&1 <<'PY' || true
import json, sys
w = sys.argv[1]
rows = lambda f: [json.loads(l) for l in open(f"{w}/{f}") if l.strip()]
sc, sg = rows("score_cpu.jsonl"), rows("score_cuda.jsonl")
d = max(abs(a - b) for x, y in zip(sc, sg) for a, b in zip(x["logprobs"], y["logprobs"]))
gc, gg = rows("generate_cpu.jsonl"), rows("generate_cuda.jsonl")
try:
    gr = rows("generate_graph.jsonl")
except OSError:
    gr = None
loss = lambda d: json.loads(open(f"{w}/sft_{d}/log.jsonl").readline())["loss"]
out = {"score_max_abs_diff": d, "score_ok": d <= 1e-4,
       "generate_same_tokens": [a["output_ids"] for a in gc] == [b["output_ids"] for b in gg],
       "cuda_graph_same_tokens": gr is not None and [a["output_ids"] for a in gg] == [b["output_ids"] for b in gr],
       "sft_loss_cpu": loss("cpu"), "sft_loss_cuda": loss("cuda")}
out["sft_ok"] = abs(out["sft_loss_cpu"] - out["sft_loss_cuda"]) <= 1e-4 * abs(out["sft_loss_cpu"])
json.dump(out, open(f"{w}/parity.json", "w"))
print("parity:", out)
PY
    cat >"$work/grpo.toml" <<TOML
model = "$model"
dataset = "$root/datasets/grpo/train.parquet"
output_dir = "$work/grpo"
device = "cuda"
dtype = "auto"
num_generations = 8
prompts_per_step = 16
max_completion_length = 16
max_steps = 1
learning_rate = 0.001
[[rewards]]
name = "exact_answer"
weight = 1.0
TOML
    check grpo_step_cuda 300 "$tt" grpo --config "$work/grpo.toml"
    # 3. TRL's release case on the GPU.
    local qwen=$root/benches/configs/qwen3-1.7b.json release="shared prompt f=0.75"
    local case=(--config "$qwen" --len 32768 --device cuda --dtype bf16)
    check tree_vs_flat_qwen3_1.7b_l32768 240 "$bin/tree_vs_flat" --bench "${case[@]}" \
        --repeats 2 --warmup 1 --checkpointing --only "f=0.75" --json "$out/tree_vs_flat.json"
    # 4. Peak CUDA memory, one process per side.
    check peak_flat_checkpointing 90 "$bin/tree_vs_flat" --bench "${case[@]}" --only "$release" \
        --checkpointing --peak-only flat --json "$out/peak_flat_checkpointing.json"
    check peak_tree_checkpointing 90 "$bin/tree_vs_flat" --bench "${case[@]}" --only "$release" \
        --checkpointing --peak-only tree --json "$out/peak_tree_checkpointing.json"
    check peak_tree_kept 90 "$bin/tree_vs_flat" --bench "${case[@]}" --only "$release" \
        --peak-only tree --json "$out/peak_tree_kept.json"
    # 5. Decode vs transformers' static cache (a random Qwen3-1.7B checkpoint made once, fp32).
    check decode_qwen3_1.7b_bf16 240 "$bin/generation" --bench --config "$qwen" --device cuda \
        --dtype bf16 --prompts 8 --new 64 --pairs 2 --python python3
    cp "$root/target/bench/generation.json" "$out/generation.json" 2>/dev/null || true
    # 6. The decode step as a CUDA graph against the same steps without one.
    check decode_cuda_graph_smollm2 180 "$bin/generation" --bench --config "$root/benches/configs/smollm2-135m.json" \
        --device cuda --prompts 8 --new 64 --static-only --cuda-graph --python /nonexistent
    cp "$root/target/bench/generation.json" "$out/generation_cuda_graph.json" 2>/dev/null || true
    {
        echo "{"
        local IFS=,
        echo "${results[*]},"
        echo "\"parity\": $(cat "$work/parity.json" 2>/dev/null || echo null)"
        echo "}"
    } >"$out/gpu-check.json"
    echo "wrote $out/gpu-check.json and $log"
}

case "${1:-}" in
    prepare) prepare ;;
    run) run "${2:?usage: scripts/gpu-check.sh run OUT_DIR}" ;;
    *) echo "usage: scripts/gpu-check.sh prepare | run OUT_DIR" >&2; exit 2 ;;
esac
