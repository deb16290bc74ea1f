#!/usr/bin/env bash
# The GPU check: what treetrain does on one CUDA device, in one call of the device tool. That
# machine has torch 2.11.0+cu130 in Python (the ABI treetrain links) and no Rust toolchain or
# network, runs one command for at most 600 s, takes the working tree plus carried folders up to
# 64 MiB and returns at most 8 files of at most 16 MiB, no more than two folders down. So the
# binaries and CPU references are made here, and the plan is checked against those limits here.
#
#   scripts/gpu-check.sh prepare             # here: release binaries and libraries, packed, and
#                                            # the CPU references as numbers, in target/gpu-check
#                                            # (carry that folder); fails past 60 MiB carried
#   scripts/gpu-check.sh run OUT [--only S]  # there, from the repo root
#   scripts/gpu-check.sh rehearse OUT [--only S]
#                                            # here: every step on the CPU at small sizes (the same
#                                            # binaries, flags, JSON, archive and checks), then
#                                            # what came back against the limits; CI runs it
#   scripts/gpu-check.sh dry-run OUT [--only S]
#                                            # here: the GPU plan on the CPU, where every CUDA step
#                                            # fails with status 1 (tests/gpu_check.rs)
#   scripts/gpu-check.sh size                # the carried-size check alone
#   scripts/gpu-check.sh references DIR      # DIR/ref.json from the binaries in
#                                            # TREETRAIN_GPU_CHECK_BIN (the test's debug builds)
# --only takes step names separated by commas, to repeat what failed within the same lease.
# PYTHON names the Python (default python3); TREETRAIN_GPU_CHECK_BIN a folder of unpacked
# binaries with a ref.json to use instead of target/gpu-check's.
#
# OUT receives three files, whatever happens: gpu-check.json (rewritten after every step: the
# plan, each step's status and seconds, the environment, the parity verdicts and the release
# table), gpu-check.log and details.tar.gz (the steps' JSON and JSONL, no checkpoint). Steps,
# most valuable first, each under `timeout` (limits in `plan` below):
#   1. environment: `treetrain env`; GPU, driver, torch, CUDA, cuDNN and NCCL versions.
#   2. parity with the CPU references (fp32, shipped SFT model): `score` log-probs (1e-4),
#      greedy `generate` tokens, one SFT step's loss (1e-4 relative).
#   3. TRL's release case, tree vs flat: random Qwen3-1.7B drawn on the GPU, 4 rollouts x 32,768
#      tokens at f = 0.9375, bf16, checkpointing, one scenario a step (shared prompt, nested
#      fork): one warm-up step of each packing, one timed pair, peaks read around the timed
#      steps. Then the tree without checkpointing at 8,192 tokens a rollout (32,768 does not
#      fit without recomputation).
#   4. bf16 on the device: tree vs flat at L = 2,048 (stated tolerances) and the first step at
#      new lengths; `score` in bf16 against the CPU's fp32 (0.15); greedy tokens in bf16, eager
#      against the CUDA graph.
#   5. one GRPO step in bf16 mixed precision (`dtype = "auto"`).
#   6. one SFT step on NCCL (world size 1 on cuda:0), and one of 2 processes over Gloo sharing
#      cuda:0.
#   7. the decode step as a CUDA graph (fp32): the tokens of step 2's.
#   8. greedy decode against transformers' static cache (compilation off; SmolLM2-135M), last.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
prepared=$root/target/gpu-check
py=${PYTHON:-python3}
# The device tool's limits, and the share of them this plan takes.
carry_limit_mib=${TREETRAIN_GPU_CHECK_CARRY_MIB:-60}
budget=450
call_limit=600
file_limit=$((16 * 1024 * 1024))
# The plan: every step and its limit in seconds, in order (their sum is checked against the
# budget before any step runs).
plan=(env:10 versions:15 score:15 generate:15 sft_step:20 release_shared_prompt:60
    release_nested_fork:60 release_tree_kept:30 bf16_tree_vs_flat:25 score_bf16:10 generate_bf16:20
    grpo_step_bf16:25 nccl_sft_step:20 gloo_2proc_sft_step:25 generate_cuda_graph:15
    decode_vs_transformers:80)

usage() {
    echo "usage: scripts/gpu-check.sh prepare | size | references DIR | run|rehearse|dry-run OUT [--only STEP,...]" >&2
    exit 2
}

prepare() {
    cd "$root"
    local stage
    stage=$(mktemp -d "${TMPDIR:-/tmp}/treetrain-gpu-prepare.XXXXXX")
    trap 'rm -rf "$stage"' RETURN
    # Cargo names the executables it built (an integration test may share a bench's name).
    cargo build --release --bin treetrain --bench tree_vs_flat --bench generation \
        --message-format=json-render-diagnostics >"$stage/build.jsonl"
    mkdir -p "$stage/bin"
    "$py" - "$stage/build.jsonl" "$stage/bin" <<'PY'
import json, shutil, sys
wanted = {("bin", "treetrain"), ("bench", "tree_vs_flat"), ("bench", "generation")}
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        for kind in m["target"]["kind"]:
            if (kind, m["target"]["name"]) in wanted:
                shutil.copy(m["executable"], f"{sys.argv[2]}/{m['target']['name']}")
                wanted.discard((kind, m["target"]["name"]))
if wanted:
    sys.exit(f"cargo built no {sorted(wanted)}")
PY
    strip "$stage/bin"/treetrain "$stage/bin"/tree_vs_flat "$stage/bin"/generation 2>/dev/null || true
    # The CUDA-graph, allocator-statistics and NCCL libraries build.rs made (loaded from beside
    # the executable there).
    for lib in libtreetrain_cuda_graph.so libtreetrain_cuda_memory.so libtreetrain_nccl.so; do
        cp "$(ls -t target/release/build/treetrain-*/out/$lib | head -1)" "$stage/bin/"
    done
    bin=$stage/bin references "$stage/bin"
    rm -rf "$prepared"
    mkdir -p "$prepared"
    "$py" - "$stage/bin/ref.json" "$(built_from)" >"$prepared/ref.json" <<'PY'
import json, sys
ref = json.load(open(sys.argv[1]))
ref["built_from"] = json.loads(sys.argv[2])
print(json.dumps(ref))
PY
    tar -czf "$prepared/bin.tar.gz" -C "$stage" bin
    size
}

# The bytes that travel: the tracked and untracked-not-ignored files, and the prepared folder
# (a list, biggest first, in FILE.list). Fails outside a git checkout, where they are unknown.
carried_bytes() {
    local files
    files=$(mktemp)
    (cd "$root" && git ls-files -z --cached --others --exclude-standard) >"$files" || { rm -f "$files"; return 1; }
    {
        (cd "$root" && xargs -0 -r stat -c '%s %n' <"$files" 2>/dev/null) || true
        [ ! -d "$prepared" ] || find "$prepared" -type f -printf '%s %p\n'
    } | sort -rn >"$1.list"
    rm -f "$files"
    awk '{ s += $1 } END { print s + 0 }' "$1.list"
}

# What the binaries were built from: the commit and whether the tree had changes.
built_from() {
    (cd "$root" && printf '{"commit": "%s", "changed_files": %s}' "$(git rev-parse HEAD)" \
        "$(git status --porcelain --untracked-files=no | wc -l)")
}

# Fails, naming the biggest files, when what travels would pass the limit.
size() {
    local list bytes limit=$((carry_limit_mib * 1024 * 1024))
    list=$(mktemp)
    bytes=$(carried_bytes "$list") || { echo "cannot list what travels: not a git checkout at $root" >&2; return 1; }
    awk -v b="$bytes" -v l="$carry_limit_mib" 'BEGIN { printf "carried: %d bytes (%.1f MiB; limit %d MiB)\n", b, b / 1048576, l }'
    if [ "$bytes" -gt "$limit" ]; then
        echo "what travels is over $carry_limit_mib MiB; the biggest files:" >&2
        head -8 "$list.list" >&2
        rm -f "$list" "$list.list"
        return 1
    fi
    rm -f "$list" "$list.list"
}

# `references DIR`: the shipped model's CPU outputs the GPU's are compared with, as numbers
# (DIR/ref.json); no checkpoint is kept.
references() {
    local dir=$1 tt=$bin/treetrain model=$root/datasets/tiny-qwen3-sft tmp
    tmp=$(mktemp -d "${TMPDIR:-/tmp}/treetrain-gpu-ref.XXXXXX")
    rows "$tmp/rows.jsonl"
    "$tt" score --model "$model" --input "$tmp/rows.jsonl" --device cpu >"$tmp/score.jsonl"
    "$tt" generate --model "$model" --input "$tmp/rows.jsonl" --greedy --max-new-tokens 16 --device cpu \
        >"$tmp/generate.jsonl"
    sft_toml "$tmp/sft.toml" cpu "$tmp/sft" gloo
    "$tt" sft --config "$tmp/sft.toml" >/dev/null
    mkdir -p "$dir"
    "$py" - "$tmp" "$dir/ref.json" <<'PY'
import json, sys
t = sys.argv[1]
rows = lambda p: [json.loads(l) for l in open(f"{t}/{p}") if l.strip()]
json.dump({"score": [r["logprobs"] for r in rows("score.jsonl")],
           "generate": [r["output_ids"] for r in rows("generate.jsonl")],
           "sft_loss": json.loads(open(f"{t}/sft/log.jsonl").readline())["loss"]}, open(sys.argv[2], "w"))
PY
    rm -rf "$tmp"
}

rows() {
    printf '{"input_ids": [1, 5, 9, 200, 31, 7, 8]}\n{"input_ids": [3, 4, 5, 6]}\n' >"$1"
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

selected() {
    [[ -z "$only" || ",$only," == *",$1,"* ]]
}

# `check NAME CMD...`: runs CMD within NAME's limit (output into the log) when NAME is
# selected, records its status and seconds, and rewrites the results.
check() {
    local name=$1 limit=${limits[$1]}
    shift
    selected "$name" || return 0
    local start status=0
    start=$(date +%s)
    echo "== $name (limit $limit s): $*" >>"$log"
    # A step that ignores SIGTERM is killed 10 s later, so the call's own limit is never hit.
    # The rehearsal's CPU is slower than the GPU at its small sizes: three times the limit.
    timeout -k 10 "$((limit * slack))" "$@" >>"$log" 2>&1 || status=$?
    [ "$status" -eq 0 ] || failed=$((failed + 1))
    steps+=("{\"name\": \"$name\", \"limit\": $limit, \"status\": $status, \"seconds\": $(($(date +%s) - start))}")
    echo "$name: status $status ($(($(date +%s) - start)) s of $limit)"
    write_results
}

write_results() {
    local IFS=,
    {
        echo "{\"mode\": \"$mode\", \"device\": \"$dev\", \"only\": \"$only\", \"budget_seconds\": $budget,"
        echo "\"call_limit_seconds\": $call_limit, \"planned_seconds\": $planned, \"carried_bytes\": $carried,"
        echo "\"built_from\": $("$py" -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1])).get("built_from")))' "${bin:-}/ref.json" 2>/dev/null || echo null),"
        echo "\"steps\": [${steps[*]}],"
        echo "\"environment\": $(cat "$work/versions.json" 2>/dev/null || echo null),"
        echo "\"verdicts\": $(cat "$work/verdicts.json" 2>/dev/null || echo null),"
        echo "\"returns\": $(cat "$work/returns.json" 2>/dev/null || echo null)}"
    } >"$out/gpu-check.json"
}

run() {
    mode=$1 out=$2 only=${3:-}
    declare -gA limits=()
    local p names=()
    for p in "${plan[@]}"; do
        limits[${p%%:*}]=${p##*:}
        names+=("${p%%:*}")
    done
    planned=0
    [[ -z "$only" || "$only" =~ ^[a-z0-9_]+(,[a-z0-9_]+)*$ ]] ||
        { echo "--only '$only': step names separated by commas; the steps: ${names[*]}" >&2; exit 2; }
    for p in ${only//,/ }; do
        [ -n "${limits[$p]:-}" ] || { echo "--only: no step '$p'; the steps: ${names[*]}" >&2; exit 2; }
    done
    for p in "${names[@]}"; do
        if selected "$p"; then planned=$((planned + limits[$p])); fi
    done
    [ "$planned" -le "$budget" ] || { echo "plan of $planned s over the $budget s budget" >&2; exit 2; }
    mkdir -p "$out"
    out=$(cd "$out" && pwd)
    log=$out/gpu-check.log
    work=$(mktemp -d "${TMPDIR:-/tmp}/treetrain-gpu-check.XXXXXX")
    trap finish EXIT
    : >"$log"
    steps=()
    failed=0
    carried=$(carried_bytes "$work/carried" 2>/dev/null || echo null)
    dev=cuda slack=1
    [ "$mode" = rehearse ] && dev=cpu slack=3
    write_results
    # The binaries: unpacked from what `prepare` packed, or a folder named to use as it is.
    if [ -n "${TREETRAIN_GPU_CHECK_BIN:-}" ]; then
        bin=$TREETRAIN_GPU_CHECK_BIN
    else
        [ -f "$prepared/bin.tar.gz" ] || { echo "no $prepared/bin.tar.gz: run 'scripts/gpu-check.sh prepare' here first" >&2; exit 2; }
        tar -xzf "$prepared/bin.tar.gz" -C "$work"
        cp "$prepared/ref.json" "$work/bin/"
        bin=$work/bin
    fi
    chmod +x "$bin"/treetrain "$bin"/tree_vs_flat "$bin"/generation
    if [ "$mode" = run ]; then
        local torch_lib
        # Without torch the steps still run, and `env` and `versions` say what is missing.
        torch_lib=$("$py" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' || true)
        if [ -n "$torch_lib" ]; then
            export TREETRAIN_TORCH_CUDA=$torch_lib
            export LD_LIBRARY_PATH=$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
        fi
    fi
    # The bench binaries were built elsewhere: their data, scripts and target/bench are here.
    export TREETRAIN_BENCH_ROOT=$root TREETRAIN_DATASETS=$root/datasets
    # No network there: transformers must not try the hub.
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    steps_of_plan
    verdicts
    # On the GPU a failed step or a false verdict fails the call (the dry run's CUDA steps fail
    # by design); either way the verdicts are printed.
    local falses
    falses=$(false_verdicts || echo "the verdicts could not be read")
    [ -z "$falses" ] || echo "$falses"
    if [ "$mode" = run ] && { [ "$failed" -gt 0 ] || [ -n "$falses" ]; }; then
        echo "$failed step(s) failed; see $out/gpu-check.json and the log" >&2
        exit 1
    fi
}

# The steps, in plan order; the GPU's sizes, or the rehearsal's small ones on the CPU.
steps_of_plan() {
    local tt=$bin/treetrain model=$root/datasets/tiny-qwen3-sft rows_in=$work/rows.jsonl
    local release=$root/benches/configs/qwen3-1.7b.json len=32768 kept_len=8192 parity_len=2048
    local graph=--cuda-graph nccl=nccl decode=$root/benches/configs/smollm2-135m.json
    local decode_size=(--prompts 8 --new 64 --pairs 2)
    if [ "$dev" = cpu ]; then
        release=$root/datasets/tiny-qwen3/config.json len=256 kept_len=128 parity_len=256
        # No CUDA graph or NCCL on the CPU: the same steps without them.
        graph="" nccl=gloo decode=$work/tiny-qwen3-decode.json decode_size=(--prompts 2 --new 8 --pairs 1)
        # The bench names its random model after the config's file name: not `config`.
        cp "$root/datasets/tiny-qwen3/config.json" "$decode"
    fi
    rows "$rows_in"
    local versions_flag=()
    [ "$mode" = rehearse ] && versions_flag=(--no-gpu-ok)
    # 1. The environment.
    check env sh -c "'$tt' env --json >'$work/env.json'"
    check versions "$py" "$root/scripts/gpu_versions.py" "$work/versions.json" "${versions_flag[@]}"
    # 2. Parity with the CPU references.
    check score sh -c "'$tt' score --model '$model' --input '$rows_in' --device $dev >'$work/score.jsonl'"
    check generate sh -c "'$tt' generate --model '$model' --input '$rows_in' --greedy \
        --max-new-tokens 16 --device $dev >'$work/generate.jsonl'"
    sft_toml "$work/sft.toml" "$dev" "$work/sft" gloo
    check sft_step "$tt" sft --config "$work/sft.toml"
    # 3. TRL's release case at f = 0.9375, a scenario a step; then the tree without checkpointing.
    local scenario
    for scenario in shared_prompt nested_fork; do
        check "release_$scenario" "$bin/tree_vs_flat" --bench --config "$release" --len "$len" --device "$dev" \
            --dtype bf16 --repeats 1 --warmup 1 --checkpointing --only "${scenario/_/ } f=0.9375" \
            --json "$work/release_$scenario.json"
    done
    check release_tree_kept "$bin/tree_vs_flat" --bench --config "$release" --len "$kept_len" --device "$dev" \
        --dtype bf16 --peak-only tree --only "f=0.9375" --json "$work/release_tree_kept.json"
    # 4. bf16 on the device.
    check bf16_tree_vs_flat "$bin/tree_vs_flat" --bench --config "$release" --len "$parity_len" --device "$dev" \
        --dtype bf16 --parity --only "f=0.9375" --json "$work/bf16_parity.json"
    check score_bf16 sh -c "'$tt' score --model '$model' --input '$rows_in' --device $dev \
        --dtype bf16 >'$work/score_bf16.jsonl'"
    check generate_bf16 sh -c "'$tt' generate --model '$model' --input '$rows_in' --greedy \
        --max-new-tokens 16 --device $dev --dtype bf16 >'$work/generate_bf16.jsonl' && '$tt' generate \
        --model '$model' --input '$rows_in' --greedy --max-new-tokens 16 --device $dev --dtype bf16 \
        $graph >'$work/generate_bf16_graph.jsonl'"
    # 5. One GRPO step in bf16 mixed precision.
    sed -e "s#^model = .*#model = \"$model\"#" -e "s#^dataset = .*#dataset = \"$root/datasets/grpo/train.parquet\"#" \
        -e "s#^output_dir = .*#output_dir = \"$work/grpo\"#" -e "s#^max_steps = .*#max_steps = 1#" \
        -e "/^eval_/d" "$root/datasets/grpo.toml" >"$work/grpo.toml"
    printf 'device = "%s"\ndtype = "auto"\n' "$dev" | cat - "$work/grpo.toml" >"$work/grpo_device.toml"
    check grpo_step_bf16 "$tt" grpo --config "$work/grpo_device.toml"
    # 6. NCCL, world size 1; Gloo, 2 processes sharing the device.
    sft_toml "$work/sft_nccl.toml" "$dev" "$work/sft_nccl" "$nccl"
    check nccl_sft_step "$tt" launch --nproc-per-node 1 -- sft --config "$work/sft_nccl.toml"
    sft_toml "$work/sft_gloo2.toml" "$dev" "$work/sft_gloo2" gloo
    check gloo_2proc_sft_step "$tt" launch --nproc-per-node 2 -- sft --config "$work/sft_gloo2.toml"
    # 7. The decode step as a CUDA graph.
    check generate_cuda_graph sh -c "'$tt' generate --model '$model' --input '$rows_in' \
        --greedy --max-new-tokens 16 --device $dev $graph >'$work/generate_graph.jsonl'"
    verdicts
    # 8. Decode against transformers (a random model drawn on the device, bf16), last.
    if selected decode_vs_transformers; then
        rm -f "$root/target/bench/generation.json"
        check decode_vs_transformers "$bin/generation" --bench --config "$decode" --device "$dev" --dtype bf16 \
            "${decode_size[@]}" --python "$py"
        cp "$root/target/bench/generation.json" "$work/decode_vs_transformers.json" 2>/dev/null || true
    fi
}

# The parity verdicts from the outputs at hand, and the release table (ours beside TRL's). Each
# verdict is computed on its own: a missing or malformed output makes that verdict null.
verdicts() {
    "$py" - "$work" "${bin:-}/ref.json" >"$work/verdicts.json" 2>>"$log" <<'PY' || echo null >"$work/verdicts.json"
import json, sys
w = sys.argv[1]
try:
    ref = json.load(open(sys.argv[2]))
except (OSError, ValueError):
    ref = {}
def rows(path):
    return [json.loads(l) for l in open(f"{w}/{path}") if l.strip()]
def load(path):
    return json.load(open(f"{w}/{path}"))
def guarded(f):
    try:
        return f()
    except Exception as e:  # a missing file, a null where a number belongs, a missing key
        print(f"verdict: {e!r}", file=sys.stderr)
        return None
def max_diff(a, b):
    # Every row and every position present on both sides, or no verdict.
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
        raise ValueError(f"shapes differ: {[len(x) for x in a]} vs {[len(y) for y in b]}")
    return max(abs(p - q) for x, y in zip(a, b) for p, q in zip(x, y))
logprobs = lambda path: [r["logprobs"] for r in rows(path)]
tokens = lambda path: [r["output_ids"] for r in rows(path)]
first_loss = lambda folder: json.loads(open(f"{w}/{folder}/log.jsonl").readline())["loss"]
v = {}
v["score_max_abs_diff"] = guarded(lambda: max_diff(ref["score"], logprobs("score.jsonl")))
v["score_ok"] = v["score_max_abs_diff"] is not None and v["score_max_abs_diff"] <= 1e-4
# bf16 weights and activations against the CPU's fp32: log-probs within 0.15 nats.
v["score_bf16_max_abs_diff"] = guarded(lambda: max_diff(ref["score"], logprobs("score_bf16.jsonl")))
v["score_bf16_ok"] = v["score_bf16_max_abs_diff"] is not None and v["score_bf16_max_abs_diff"] <= 0.15
v["generate_same_tokens"] = guarded(lambda: ref["generate"] == tokens("generate.jsonl")) is True
v["cuda_graph_same_tokens"] = guarded(lambda: tokens("generate_graph.jsonl") == tokens("generate.jsonl")) is True
v["bf16_cuda_graph_same_tokens"] = guarded(lambda: tokens("generate_bf16_graph.jsonl") == tokens("generate_bf16.jsonl")) is True
v["sft_loss_cpu"], v["sft_loss_device"] = ref.get("sft_loss"), guarded(lambda: first_loss("sft"))
v["sft_ok"] = guarded(lambda: abs(v["sft_loss_cpu"] - v["sft_loss_device"]) <= 1e-4 * abs(v["sft_loss_cpu"])) is True
v["bf16_tree_vs_flat_ok"] = guarded(lambda: all(s["ok"] is True for s in load("bf16_parity.json")["scenarios"])
                                    and len(load("bf16_parity.json")["scenarios"]) == 2) is True
v["decode_same_tokens"] = guarded(lambda: load("decode_vs_transformers.json")["same_tokens_as_transformers"]) is True
def release_rows():
    out = []
    for name in ["release_shared_prompt", "release_nested_fork"]:
        try:
            run = load(f"{name}.json")
        except (OSError, ValueError):
            continue
        gib = lambda mib: None if mib is None or mib != mib else round(mib / 1024, 2)
        for s in run["scenarios"]:
            out.append({"scenario": s.get("scenario"), "len": run.get("len"), "flat_ms": s.get("flat_ms"),
                        "tree_ms": s.get("tree_ms"), "speedup": s.get("speedup"), "token_ratio": s.get("packing_ratio"),
                        "ideal": s.get("ideal_speedup"), "fraction_of_ideal": s.get("speedup_over_ideal"),
                        "tree_peak_gib": gib(s.get("tree_peak_mib")), "flat_peak_gib": gib(s.get("flat_peak_mib")),
                        "trl_speedup": s.get("trl_speedup"), "trl_token_ratio": s.get("trl_token_ratio"),
                        "trl_tree_peak_gib": s.get("trl_tree_peak_gib"), "trl_flat_peak_gib": s.get("trl_flat_peak_gib")})
    return out
v["release"] = guarded(release_rows) or []
print(json.dumps(v))
PY
    write_results
}

# The verdicts that are false although their steps ran (one line each), or nothing.
false_verdicts() {
    "$py" - "$out/gpu-check.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
v, ran = r["verdicts"] or {}, {s["name"] for s in r["steps"]}
# Each verdict and the steps whose outputs it compares.
needs = {"score_ok": ["score"], "score_bf16_ok": ["score_bf16"], "generate_same_tokens": ["generate"],
         "cuda_graph_same_tokens": ["generate", "generate_cuda_graph"], "bf16_cuda_graph_same_tokens": ["generate_bf16"],
         "sft_ok": ["sft_step"], "bf16_tree_vs_flat_ok": ["bf16_tree_vs_flat"],
         "decode_same_tokens": ["decode_vs_transformers"]}
for k, steps in needs.items():
    if ran.issuperset(steps) and v.get(k) is not True:
        print(f"verdict {k} is not true")
PY
}

# On exit, whatever happened: the details archive (the steps' JSON, JSONL and TOML; no
# checkpoint folder), the log bounded, and what comes back checked against the tool's limits.
finish() {
    local status=$?
    (cd "$work" && find . \( -path ./bin -o -name 'checkpoint-*' \) -prune -o -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.toml' \) \
        -size -4M -print | tar -czf "$out/details.tar.gz" -T - 2>/dev/null) || true
    if [ "$(stat -c %s "$out/details.tar.gz" 2>/dev/null || echo 0)" -gt "$file_limit" ]; then
        echo "details.tar.gz over 16 MiB: left out" >>"$log"
        rm -f "$out/details.tar.gz"
    fi
    if [ "$(stat -c %s "$log")" -gt $((file_limit - 1024 * 1024)) ]; then
        { head -c 7M "$log"; echo; echo "[... cut to fit 16 MiB ...]"; tail -c 7M "$log"; } >"$log.cut"
        mv "$log.cut" "$log"
    fi
    write_results
    returns >"$work/returns.json" || echo null >"$work/returns.json"
    write_results
    rm -rf "$work"
    [ "$mode" = rehearse ] && rehearsal_verdict
    exit "$status"
}

# What OUT holds against what the device tool returns: at most 8 files, each at most 16 MiB,
# at most two folders down, named in letters, digits, '.', '_' and '-'.
returns() {
    "$py" - "$out" "$file_limit" <<'PY'
import json, os, re, sys
out, limit = sys.argv[1], int(sys.argv[2])
files = []
for d, _, names in os.walk(out):
    for n in names:
        p = os.path.join(d, n)
        files.append({"path": os.path.relpath(p, out), "bytes": os.path.getsize(p)})
ok = len(files) <= 8 and all(
    f["bytes"] <= limit and f["path"].count("/") <= 2 and all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in f["path"].split("/"))
    for f in files)
print(json.dumps({"files": files, "ok": ok}))
PY
}

# The rehearsal passes when every step passed, the parity verdicts and the release table are
# there, what came back fits, what travels fits, and the plan fits the budget and the call.
rehearsal_verdict() {
    local falses
    falses=$(false_verdicts || echo "the verdicts could not be read")
    "$py" - "$out/gpu-check.json" "$((carry_limit_mib * 1024 * 1024))" "$falses" "$(built_from)" <<'PY' || exit 1
import json, sys
r, carry_limit = json.load(open(sys.argv[1])), int(sys.argv[2])
v = r["verdicts"] or {}
problems = [f"step {s['name']} ended with status {s['status']}" for s in r["steps"] if s["status"] != 0]
ran = {s["name"] for s in r["steps"]}
problems += [line for line in sys.argv[3].splitlines() if line]
if r["built_from"] != json.loads(sys.argv[4]):
    problems.append(f"the packed binaries were built from {r['built_from']}, the tree is at {sys.argv[4]}: run prepare again")
if len(v.get("release", [])) != len(ran & {"release_shared_prompt", "release_nested_fork"}):
    problems.append("the release table lacks a scenario")
if not (r["returns"] or {}).get("ok"):
    problems.append(f"what comes back does not fit the tool's limits: {r['returns']}")
if r["carried_bytes"] is None or r["carried_bytes"] > carry_limit:
    problems.append(f"carried {r['carried_bytes']} bytes, over {carry_limit}")
if r["planned_seconds"] > r["budget_seconds"] or r["planned_seconds"] > r["call_limit_seconds"]:
    problems.append(f"the plan's {r['planned_seconds']} s is over the budget")
print("rehearsal: " + ("; ".join(problems) if problems else "every step passed, and what travels and comes back fits"))
sys.exit(1 if problems else 0)
PY
}

case "${1:-}" in
    prepare) [ $# -eq 1 ] || usage; prepare ;;
    size) [ $# -eq 1 ] || usage; size ;;
    references)
        [ $# -eq 2 ] || usage
        bin=${TREETRAIN_GPU_CHECK_BIN:?references needs TREETRAIN_GPU_CHECK_BIN}
        references "$2"
        ;;
    run | dry-run | rehearse)
        [ $# -eq 2 ] || { [ $# -eq 4 ] && [ "$3" = --only ]; } || usage
        run "$1" "$2" "${4:-}"
        ;;
    *) usage ;;
esac
