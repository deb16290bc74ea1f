//! Shared by the integration tests that train on the shipped data.

#[allow(dead_code)]
pub mod fixture_models;

use std::path::{Path, PathBuf};

use tch::{Kind, Tensor};
use treetrain::grpo::{BuiltinReward, GrpoConfig, RewardSpec};
use treetrain::model::{AttentionLayout, Model};
use treetrain::sft::{PackingStrategy, SftConfig, TokenizeOptions};
use treetrain::train::{DataSettings, OptimizerSettings, OutputSettings, TrainConfig};

/// The repository root.
#[allow(dead_code)]
pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `dir`, into `out` (the readers of `src/` in `tests/layers.rs` and
/// `tests/public_names.rs`).
#[allow(dead_code)]
pub fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// SFT of the shipped tiny model on the shipped conversations at test size: bfd rows of 128
/// tokens, 4 a step, lr 3e-3 with 10% warmup, `steps` steps, writing to `out` when given.
#[allow(dead_code)]
pub fn shipped_sft(out: Option<PathBuf>, steps: u64) -> SftConfig {
    SftConfig {
        train: TrainConfig {
            model: treetrain::shipped::tiny_model_dir().unwrap().display().to_string(),
            data: DataSettings {
                dataset: root().join("datasets/sft/train.parquet"),
                ..Default::default()
            },
            optimizer: OptimizerSettings {
                learning_rate: 3e-3,
                warmup_ratio: 0.1,
                ..Default::default()
            },
            output: OutputSettings {
                output_dir: out,
                ..Default::default()
            },
            ..Default::default()
        },
        tokenize: TokenizeOptions {
            max_length: 128,
            ..Default::default()
        },
        packing: Some(PackingStrategy::Bfd),
        batch_size: 4,
        max_steps: Some(steps),
        ..Default::default()
    }
}

/// The shipped GRPO recipe (datasets/grpo.toml) at test size: the shipped SFT model on the
/// shipped prompts, exact-answer and format rewards, 16 prompts x 8 completions of at most 16
/// tokens a step, lr 1e-3, 40 steps.
#[allow(dead_code)]
pub fn shipped_grpo() -> GrpoConfig {
    let mut c = GrpoConfig {
        train: TrainConfig {
            model: root().join("datasets/tiny-qwen3-sft").display().to_string(),
            seed: 7,
            data: DataSettings {
                dataset: root().join("datasets/grpo/train.parquet"),
                ..Default::default()
            },
            optimizer: OptimizerSettings {
                learning_rate: 1e-3,
                lr_scheduler: treetrain::train::ScheduleKind::Linear,
                ..Default::default()
            },
            ..Default::default()
        },
        rewards: vec![
            RewardSpec {
                name: BuiltinReward::ExactAnswer,
                weight: 1.0,
            },
            RewardSpec {
                name: BuiltinReward::AnswerFormat,
                weight: 0.5,
            },
        ],
        max_steps: 40,
        ..Default::default()
    };
    c.rollouts.num_generations = 8;
    c.rollouts.prompts_per_step = 16;
    c.rollouts.max_completion_length = 16;
    c.update.token_budget = 2048;
    c
}

/// Logits `[len, vocab]` of one row forwarded alone (causal, no gradient).
#[allow(dead_code)]
pub fn row_logits(model: &Model, row: &[i64]) -> Tensor {
    let n = row.len() as i64;
    let ids = Tensor::from_slice(row).view([1, n]);
    let pos = Tensor::arange(n, (Kind::Int64, tch::Device::Cpu)).view([1, n]);
    tch::no_grad(|| {
        model
            .lm
            .forward(&ids, &pos, &AttentionLayout::Causal)
            .unwrap()
            .squeeze_dim(0)
    })
}

/// The `logprobs` of each JSON line `treetrain score` printed.
#[allow(dead_code)]
pub fn score_lines(out: &str) -> Vec<Vec<f64>> {
    out.lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect()
        })
        .collect()
}

/// The stand-in PrivateUse1 backend (tests/standin), built by scripts/build-standin.sh into
/// target/standin when missing or older than its source: `with_fallback` picks the library
/// with a CPU fallback for every op, else the one without (most ops then missing).
#[allow(dead_code)]
pub fn standin_library(with_fallback: bool) -> PathBuf {
    standin_variant(match with_fallback {
        true => "libtreetrain_standin.so",
        false => "libtreetrain_standin_nofallback.so",
    })
}

/// The stand-in built without its `view` kernel (`view` then goes through the CPU fallback).
#[allow(dead_code)]
pub fn standin_without_view() -> PathBuf {
    standin_variant("libtreetrain_standin_noview.so")
}

/// One of the libraries scripts/build-standin.sh builds, built when missing or stale.
#[allow(dead_code)]
fn standin_variant(name: &str) -> PathBuf {
    static BUILT: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_build_at_a_time = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    let dir = root().join("target/standin");
    let lib = dir.join(name);
    let source = root().join("tests/standin/standin_backend.cpp");
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    if modified(&lib).is_none() || modified(&lib) < modified(&source) {
        let status = std::process::Command::new("bash")
            .arg(root().join("scripts/build-standin.sh"))
            .arg(&dir)
            .env("LIBTORCH", env!("TREETRAIN_LIBTORCH_DIR"))
            .status()
            .expect("run scripts/build-standin.sh");
        assert!(status.success(), "building the stand-in backend failed");
    }
    lib
}

/// Child processes a test started, killed and reaped on drop (a failed assertion leaves none
/// running).
#[allow(dead_code)]
pub struct Workers(pub Vec<std::process::Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `torch.quantile`'s linear interpolation of `values` at `q` in [0, 1] (how TRL takes the
/// entropy floor of `top_entropy_quantile`).
#[allow(dead_code)]
pub fn quantile(values: &[f64], q: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let at = q * (v.len() - 1) as f64;
    let (lo, hi) = (at.floor() as usize, at.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (at - lo as f64)
}

/// The gradients left in `m`'s variables, by name, which are then cleared.
#[allow(dead_code)]
pub fn take_grads(m: &Model) -> Vec<(String, Tensor)> {
    let mut grads: Vec<(String, Tensor)> =
        m.vs.variables()
            .into_iter()
            .filter(|(_, v)| v.requires_grad())
            .map(|(k, v)| (k, v.grad().copy()))
            .collect();
    grads.sort_by(|a, b| a.0.cmp(&b.0));
    for (_, mut v) in m.vs.variables() {
        v.zero_grad();
    }
    grads
}

/// torch/lib of the torchrun venv (scripts/setup-torchrun.sh), from `TREETRAIN_TORCHRUN`: a
/// CUDA libtorch (torch 2.11.0 from PyPI) to load without a GPU.
#[allow(dead_code)]
pub fn cuda_torch_lib() -> Option<PathBuf> {
    let torchrun = PathBuf::from(std::env::var_os("TREETRAIN_TORCHRUN")?);
    let lib = torchrun.parent()?.parent()?.join("lib");
    std::fs::read_dir(&lib)
        .ok()?
        .flatten()
        .map(|e| e.path().join("site-packages/torch/lib"))
        .find(|p| p.join("libtorch_cuda.so").exists())
}

/// The shipped tiny Qwen3-MoE (`datasets/tiny-qwen3-moe`: the tiny model's tokenizer and seed,
/// 8 experts, top 2, in layers 1 to 3), its weights made once.
#[allow(dead_code)]
pub fn tiny_mixture() -> PathBuf {
    treetrain::shipped::tiny_mixture_dir().unwrap()
}
