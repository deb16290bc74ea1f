#!/usr/bin/env bash
# The GPU check: what treetrain does on one CUDA device, in one call whose step limits sum to
# 350 s, under its 355 s budget (checked before any step runs), so the whole call stays under 6
# minutes; binaries and CPU references are made on a CPU machine, because the GPU machine needs
# only torch 2.11.0+cu130 in Python (the ABI treetrain links): no Rust toolchain, no network.
#
#   scripts/gpu-check.sh prepare        # here: release binaries, libraries, CPU references
#                                       # into target/gpu-check/ (carried with the tree)
#   scripts/gpu-check.sh run OUT        # there, from the repo root
#   scripts/gpu-check.sh dry-run OUT    # here: the same plan on the CPU (CUDA steps fail with
#                                       # "no driver" within their limits): plumbing, budget
#                                       # and files, checked by tests/gpu_check.rs
#   scripts/gpu-check.sh references     # (part of prepare) the CPU references alone
# TREETRAIN_GPU_CHECK_BIN names another folder of binaries (the test's debug builds).
#
# OUT receives three files, whatever happens: gpu-check.json (rewritten after every step: the
# plan, each step's status and seconds, the environment, the parity verdicts), gpu-check.log and
# details.tar.gz (the benches' JSON and the outputs compared); the work folder is outside OUT.
# Steps, most valuable first, each under `timeout`:
#   1. environment: `treetrain env`; GPU, driver, torch, CUDA, cuDNN and NCCL versions.
#   2. parity with the CPU references carried from `prepare` (fp32, shipped SFT model): `score`
#      log-probs (1e-4), greedy `generate` tokens, one SFT step's loss (1e-4 relative).
#   3. TRL's release case, tree vs flat: random Qwen3-1.7B drawn on the GPU, 4 rollouts x 32,768
#      tokens at f = 0.9375 (shared prompt and nested fork), bf16, checkpointing; peaks are the
#      caching allocator's peak allocated bytes (weights included) in the timing process, and
#      the SDPA kernel of each call kind is recorded. Then the tree alone without checkpointing
#      (where it fits).
#   4. bf16 on the device: tree vs flat at L = 2,048 (per-term log-probs, loss, gradient norm,
#      stated tolerances) and the first step at new lengths (cuDNN plan builds); `score` in bf16
#      against the CPU's fp32 (0.15); greedy tokens in bf16, eager against the CUDA graph.
#   5. one GRPO step in bf16 mixed precision (`dtype = "auto"`).
#   6. one SFT step on NCCL (world size 1 on cuda:0), and one of 2 processes over Gloo sharing
#      cuda:0.
#   7. the decode step as a CUDA graph (fp32): the tokens of step 2's.
#   8. greedy decode against transformers' static cache (compilation off; SmolLM2-135M), last.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin=${TREETRAIN_GPU_CHECK_BIN:-$root/target/gpu-check}
# The sum of the steps' limits: under 6 minutes.
budget=355

prepare() {
    cd "$root"
    cargo build --release --bin treetrain --bench tree_vs_flat --bench generation
    mkdir -p "$bin"
    cp target/release/treetrain "$bin/"
    for b in tree_vs_flat generation; do
        cp "$(ls -t target/release/deps/$b-* | grep -v '\.d$' | head -1)" "$bin/$b"
    done
    strip "$bin"/treetrain "$bin"/tree_vs_flat "$bin"/generation 2>/dev/null || true
    # The CUDA-graph, allocator-statistics and NCCL libraries build.rs made (loaded from beside the executable there).
    for lib in libtreetrain_cuda_graph.so libtreetrain_cuda_memory.so libtreetrain_nccl.so; do
        cp "$(ls -t target/release/build/treetrain-*/out/$lib | head -1)" "$bin/"
    done
    references "$bin/ref"
    du -sh "$bin"
}

# The shipped model's inputs and CPU outputs the GPU's are compared with.
references() {
    local ref=$1 tt=$bin/treetrain model=$root/datasets/tiny-qwen3-sft
    mkdir -p "$ref"
    printf '{"input_ids": [1, 5, 9, 200, 31, 7, 8]}\n{"input_ids": [3, 4, 5, 6]}\n' >"$ref/rows.jsonl"
    "$tt" score --model "$model" --input "$ref/rows.jsonl" --device cpu >"$ref/score.jsonl"
    "$tt" generate --model "$model" --input "$ref/rows.jsonl" --greedy --max-new-tokens 16 --device cpu \
        >"$ref/generate.jsonl"
    sft_toml "$ref/sft.toml" cpu "$ref/sft" gloo
    "$tt" sft --config "$ref/sft.toml" >/dev/null
}

# `sft_toml FILE DEVICE OUTPUT BACKEND`: one fp32 SFT step of the shipped model.
sft_toml() {
    cat >"$1" <<TOML
model = "$root/datasets/tiny-qwen3-sft"
dataset = "$root/datasets/sft/train.parquet"
output_dir = "$3"
device = "$2"
dtype = "fp32"
distributed_backend = "$4"
packing = "bfd"
batch_size = 8
max_steps = 1
learning_rate = 0.002
eval_fraction = 0.0
[tokenize]
max_length = 256
TOML
}

# `check NAME SECONDS CMD...`: runs CMD within SECONDS (output into the log), records its status
# and seconds, and rewrites the results.
check() {
    local name=$1 limit=$2
    shift 2
    local start status=0
    start=$(date +%s)
    echo "== $name (limit $limit s): $*" >>"$log"
    timeout "$limit" "$@" >>"$log" 2>&1 || status=$?
    steps+=("{\"name\": \"$name\", \"limit\": $limit, \"status\": $status, \"seconds\": $(($(date +%s) - start))}")
    echo "$name: status $status ($(($(date +%s) - start)) s of $limit)"
    write_results
}

write_results() {
    local IFS=,
    {
        echo "{\"mode\": \"$mode\", \"budget_seconds\": $budget, \"planned_seconds\": $planned,"
        echo "\"steps\": [${steps[*]}],"
        echo "\"environment\": $(cat "$work/versions.json" 2>/dev/null || echo null),"
        echo "\"parity\": $(cat "$work/parity.json" 2>/dev/null || echo null)}"
    } >"$out/gpu-check.json"
}

# The limits of the plan below, in order; their sum is checked against the budget first.
limits=(10 10 15 15 20 95 25 25 10 15 25 20 20 15 30)

run() {
    mode=$1 out=$2
    mkdir -p "$out"
    out=$(cd "$out" && pwd)
    log=$out/gpu-check.log
    work=$(mktemp -d "${TMPDIR:-/tmp}/treetrain-gpu-check.XXXXXX")
    trap 'tar -czf "$out/details.tar.gz" -C "$work" . 2>/dev/null; rm -rf "$work"' EXIT
    : >"$log"
    steps=()
    planned=0
    for l in "${limits[@]}"; do planned=$((planned + l)); done
    [ "$planned" -le "$budget" ] || { echo "plan of $planned s over the $budget s budget" >&2; exit 2; }
    write_results
    local py=python3 torch_lib=""
    if [ "$mode" = run ]; then
        torch_lib=$($py -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
        export TREETRAIN_TORCH_CUDA=$torch_lib
        export LD_LIBRARY_PATH=$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    fi
    # The bench binaries were built elsewhere: their data, scripts and target/bench are here.
    export TREETRAIN_BENCH_ROOT=$root TREETRAIN_DATASETS=$root/datasets
    local tt=$bin/treetrain model=$root/datasets/tiny-qwen3-sft ref=$bin/ref q17=$root/benches/configs/qwen3-1.7b.json
    local rows=$ref/rows.jsonl
    # 1. The environment.
    check env "${limits[0]}" sh -c "'$tt' env --json >'$work/env.json'"
    check versions "${limits[1]}" "$py" "$root/scripts/gpu_versions.py" "$work/versions.json"
    # 2. Parity with the CPU references.
    check score "${limits[2]}" sh -c "'$tt' score --model '$model' --input '$rows' --device cuda >'$work/score.jsonl'"
    check generate "${limits[3]}" sh -c "'$tt' generate --model '$model' --input '$rows' --greedy \
        --max-new-tokens 16 --device cuda >'$work/generate.jsonl'"
    sft_toml "$work/sft.toml" cuda "$work/sft" gloo
    check sft_step "${limits[4]}" "$tt" sft --config "$work/sft.toml"
    # 3. TRL's release case at f = 0.9375, both scenarios; then the tree without checkpointing.
    check release_tree_vs_flat "${limits[5]}" "$bin/tree_vs_flat" --bench --config "$q17" --len 32768 \
        --device cuda --dtype bf16 --repeats 1 --warmup 1 --checkpointing --only "f=0.9375" \
        --json "$work/tree_vs_flat.json"
    check release_tree_kept "${limits[6]}" "$bin/tree_vs_flat" --bench --config "$q17" --len 32768 \
        --device cuda --dtype bf16 --peak-only tree --only "f=0.9375" --json "$work/tree_kept.json"
    # 4. bf16 on the device.
    check bf16_tree_vs_flat "${limits[7]}" "$bin/tree_vs_flat" --bench --config "$q17" --len 2048 \
        --device cuda --dtype bf16 --parity --only "f=0.9375" --json "$work/bf16_parity.json"
    check score_bf16 "${limits[8]}" sh -c "'$tt' score --model '$model' --input '$rows' --device cuda \
        --dtype bf16 >'$work/score_bf16.jsonl'"
    check generate_bf16 "${limits[9]}" sh -c "'$tt' generate --model '$model' --input '$rows' --greedy \
        --max-new-tokens 16 --device cuda --dtype bf16 >'$work/generate_bf16.jsonl' && '$tt' generate \
        --model '$model' --input '$rows' --greedy --max-new-tokens 16 --device cuda --dtype bf16 \
        --cuda-graph >'$work/generate_bf16_graph.jsonl'"
    # 5. One GRPO step in bf16 mixed precision.
    sed -e "s#^model = .*#model = \"$model\"#" -e "s#^dataset = .*#dataset = \"$root/datasets/grpo/train.parquet\"#" \
        -e "s#^output_dir = .*#output_dir = \"$work/grpo\"#" -e "s#^max_steps = .*#max_steps = 1#" \
        -e "/^eval_/d" "$root/datasets/grpo.toml" >"$work/grpo.toml"
    printf 'device = "cuda"\ndtype = "auto"\n' | cat - "$work/grpo.toml" >"$work/grpo_cuda.toml"
    check grpo_step_bf16 "${limits[10]}" "$tt" grpo --config "$work/grpo_cuda.toml"
    # 6. NCCL, world size 1 on cuda:0; Gloo, 2 processes sharing cuda:0.
    sft_toml "$work/sft_nccl.toml" cuda "$work/sft_nccl" nccl
    check nccl_sft_step "${limits[11]}" "$tt" launch --nproc-per-node 1 -- sft --config "$work/sft_nccl.toml"
    sft_toml "$work/sft_gloo2.toml" cuda "$work/sft_gloo2" gloo
    check gloo_2proc_sft_step "${limits[12]}" "$tt" launch --nproc-per-node 2 -- sft --config "$work/sft_gloo2.toml"
    # 7. The decode step as a CUDA graph.
    check generate_cuda_graph "${limits[13]}" sh -c "'$tt' generate --model '$model' --input '$rows' \
        --greedy --max-new-tokens 16 --device cuda --cuda-graph >'$work/generate_graph.jsonl'"
    parity
    # 8. Decode against transformers (a random SmolLM2-135M drawn on the GPU, bf16), last.
    check decode_vs_transformers "${limits[14]}" "$bin/generation" --bench \
        --config "$root/benches/configs/smollm2-135m.json" --device cuda --dtype bf16 --prompts 8 --new 64 \
        --pairs 2 --python "$py"
    cp "$root/target/bench/generation.json" "$work/" 2>/dev/null || true
    write_results
    echo "wrote $out/gpu-check.json, $log and $out/details.tar.gz"
}

# The parity verdicts of step 2 and the graph's tokens, from the outputs at hand.
parity() {
    python3 - "$work" "$bin/ref" >"$work/parity.json" 2>>"$log" <<'PY' || echo null >"$work/parity.json"
import json, sys
w, ref = sys.argv[1], sys.argv[2]
def rows(path):
    try:
        return [json.loads(l) for l in open(path) if l.strip()]
    except OSError:
        return None
def first_loss(folder):
    try:
        return json.loads(open(f"{folder}/log.jsonl").readline())["loss"]
    except (OSError, ValueError, KeyError):
        return None
def max_diff(a, b):
    return max(abs(p - q) for x, y in zip(a, b) for p, q in zip(x["logprobs"], y["logprobs"])) if a and b else None
sc = rows(f"{ref}/score.jsonl")
d, d16 = max_diff(sc, rows(f"{w}/score.jsonl")), max_diff(sc, rows(f"{w}/score_bf16.jsonl"))
tokens = lambda r: r and [x["output_ids"] for x in r]
gc, gg, gr = tokens(rows(f"{ref}/generate.jsonl")), tokens(rows(f"{w}/generate.jsonl")), tokens(rows(f"{w}/generate_graph.jsonl"))
g16, g16r = tokens(rows(f"{w}/generate_bf16.jsonl")), tokens(rows(f"{w}/generate_bf16_graph.jsonl"))
lc, lg = first_loss(f"{ref}/sft"), first_loss(f"{w}/sft")
print(json.dumps({
    "score_max_abs_diff": d, "score_ok": d is not None and d <= 1e-4,
    # bf16 weights and activations against the CPU's fp32: log-probs within 0.15 nats.
    "score_bf16_max_abs_diff": d16, "score_bf16_ok": d16 is not None and d16 <= 0.15,
    "generate_same_tokens": bool(gg) and gc == gg,
    "cuda_graph_same_tokens": bool(gr) and gr == gg,
    "bf16_cuda_graph_same_tokens": bool(g16r) and g16r == g16,
    "sft_loss_cpu": lc, "sft_loss_cuda": lg,
    "sft_ok": lc is not None and lg is not None and abs(lc - lg) <= 1e-4 * abs(lc),
}))
PY
    write_results
}

case "${1:-}" in
    prepare) prepare ;;
    references) references "$bin/ref" ;;
    run | dry-run) run "$1" "${2:?usage: scripts/gpu-check.sh $1 OUT_DIR}" ;;
    *) echo "usage: scripts/gpu-check.sh prepare | run OUT_DIR | dry-run OUT_DIR" >&2; exit 2 ;;
esac
