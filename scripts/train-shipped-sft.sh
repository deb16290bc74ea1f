#!/usr/bin/env bash
# Trains datasets/tiny-qwen3-sft from the shipped tiny model and SFT data (seeded, CPU,
# deterministic; about 11 minutes on 2 cores) and copies the model files next to the base model.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$TREETRAIN_ROOT"
bash scripts/setup-libtorch.sh
rm -rf target/sft-tiny
cargo run --release --quiet -- sft --config datasets/sft.toml
ckpt=$(ls -d target/sft-tiny/checkpoint-* | sort -t- -k2 -n | tail -1)
dest=datasets/tiny-qwen3-sft
rm -rf "$dest" && mkdir -p "$dest"
for f in config.json generation_config.json model.safetensors tokenizer.json tokenizer_config.json; do
    cp "$ckpt/$f" "$dest/"
done
cp "$ckpt/trainer_state.json" "$dest/training_log.json"
echo "wrote $dest from $ckpt"
