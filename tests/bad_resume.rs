//! Resume verifies what it reads: a checkpoint whose files were corrupted, hand-edited or
//! mixed with another run's is refused, naming the file and the tensor or field, instead of
//! training on from garbage.

use std::path::{Path, PathBuf};

use tch::{Kind, Tensor};
use treetrain::sft::{SftConfig, SftTrainer};
use treetrain::train::Trainer;

mod common;

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("treetrain-badresume-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A two-step checkpoint of the shipped SFT in `out`, and the config that resumes it.
fn checkpoint(out: &Path, lora: bool) -> (SftConfig, PathBuf) {
    let mut config = common::shipped_sft(Some(out.into()), 4);
    if lora {
        config.train.lora = Some(Default::default());
    }
    let mut t = SftTrainer::new(config.clone()).unwrap();
    t.train_for(2).unwrap();
    (config, t.save_checkpoint().unwrap())
}

fn resume_error(config: &SftConfig, ckpt: &Path) -> String {
    SftTrainer::from_config(config.clone(), Some(ckpt))
        .unwrap_err()
        .to_string()
}

/// Rewrites `optimizer.safetensors` with `edit` applied to its tensors.
fn edit_moments(ckpt: &Path, edit: impl FnOnce(&mut Vec<(String, Tensor)>)) {
    let file = ckpt.join("optimizer.safetensors");
    let mut tensors = Tensor::read_safetensors(&file).unwrap();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    edit(&mut tensors);
    Tensor::write_safetensors(&tensors, &file).unwrap();
}

/// Sets `key` of `file` (JSON) inside `ckpt` to `value`.
fn edit_json(ckpt: &Path, file: &str, key: &str, value: serde_json::Value) {
    let path = ckpt.join(file);
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    v[key] = value;
    std::fs::write(&path, v.to_string()).unwrap();
}

#[test]
fn corrupt_optimizer_tensors_are_refused_by_name() {
    let out = scratch("moments");
    let (config, ckpt) = checkpoint(&out, false);
    let pristine = std::fs::read(ckpt.join("optimizer.safetensors")).unwrap();
    let moment = "exp_avg.model.layers.0.mlp.up_proj.weight";
    type Edit = Box<dyn Fn(&mut Vec<(String, Tensor)>)>;
    let cases: [(&str, Edit); 5] = [
        (
            "has shape [4]",
            Box::new(|t| map(t, moment, |_| Tensor::zeros([4], (Kind::Float, tch::Device::Cpu)))),
        ),
        ("is I32", Box::new(|t| map(t, moment, |x| x.to_kind(Kind::Int)))),
        ("holds NaN or infinite", Box::new(|t| map(t, moment, |x| x * f64::NAN))),
        (
            "holds negative values",
            Box::new(|t| {
                let key = moment.replace("exp_avg.", "exp_avg_sq.");
                map(t, &key, |x| x - 1.0)
            }),
        ),
        (
            "holds `exp_avg.model.layers.9.extra`",
            Box::new(|t| {
                t.push((
                    "exp_avg.model.layers.9.extra".into(),
                    Tensor::zeros([2], (Kind::Float, tch::Device::Cpu)),
                ))
            }),
        ),
    ];
    for (want, edit) in cases {
        std::fs::write(ckpt.join("optimizer.safetensors"), &pristine).unwrap();
        edit_moments(&ckpt, edit);
        let err = resume_error(&config, &ckpt);
        assert!(
            err.contains(want) && err.contains("optimizer.safetensors"),
            "{want}: {err}"
        );
        if !want.starts_with("holds `") {
            assert!(err.contains(moment.split_once('.').unwrap().1), "{err}");
        }
    }
    std::fs::write(ckpt.join("optimizer.safetensors"), &pristine).unwrap();
    assert!(
        SftTrainer::from_config(config, Some(&ckpt)).is_ok(),
        "the untouched checkpoint resumes"
    );
    let _ = std::fs::remove_dir_all(&out);
}

/// Replaces tensor `key` of `t` by `f` of it.
fn map(t: &mut [(String, Tensor)], key: &str, f: impl FnOnce(&Tensor) -> Tensor) {
    let entry = t.iter_mut().find(|(k, _)| k == key).unwrap();
    entry.1 = f(&entry.1);
}

#[test]
fn state_fields_must_be_typed_and_agree_with_each_other() {
    let out = scratch("state");
    let (config, ckpt) = checkpoint(&out, false);
    let state = std::fs::read_to_string(ckpt.join("trainer_state.json")).unwrap();
    let optimizer = std::fs::read_to_string(ckpt.join("optimizer.json")).unwrap();
    let cases = [
        (
            "trainer_state.json",
            "global_step",
            serde_json::json!(0),
            "says 0 steps",
        ),
        ("optimizer.json", "step", serde_json::json!(0), "counts 0 updates"),
        ("optimizer.json", "step", serde_json::json!("2"), "`step` is \"2\""),
        (
            "trainer_state.json",
            "world_size",
            serde_json::json!("2"),
            "`world_size` is \"2\"",
        ),
        (
            "trainer_state.json",
            "world_size",
            serde_json::json!(-2),
            "`world_size` is -2",
        ),
    ];
    for (file, key, value, want) in cases {
        std::fs::write(ckpt.join("trainer_state.json"), &state).unwrap();
        std::fs::write(ckpt.join("optimizer.json"), &optimizer).unwrap();
        edit_json(&ckpt, file, key, value);
        let err = resume_error(&config, &ckpt);
        assert!(err.contains(want) && err.contains(file), "{file} {key}: {err}");
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_lora_checkpoint_resumes_only_onto_its_base_model() {
    let out = scratch("lora-base");
    let (mut config, ckpt) = checkpoint(&out, true);
    assert!(SftTrainer::from_config(config.clone(), Some(&ckpt)).is_ok());
    config.train.model = common::root().join("datasets/tiny-qwen3-sft").display().to_string();
    let err = resume_error(&config, &ckpt);
    assert!(
        err.contains("trained on base model") && err.contains("resume with the run's base model"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_grpo_data_position_past_the_steps_taken_is_refused() {
    let out = scratch("grpo-position");
    let mut config = common::shipped_grpo();
    config.train.output.output_dir = Some(out.clone());
    config.max_steps = 3;
    config.rollouts.prompts_per_step = 2;
    config.rollouts.num_generations = 2;
    config.rollouts.max_completion_length = 4;
    let mut t = treetrain::grpo::GrpoTrainer::new(config.clone()).unwrap();
    t.train_for(1).unwrap();
    let ckpt = t.save_checkpoint().unwrap();
    drop(t);
    edit_json(
        &ckpt,
        "trainer_state.json",
        "batches_consumed",
        serde_json::json!(u64::MAX / 2),
    );
    let started = std::time::Instant::now();
    let err = treetrain::grpo::GrpoTrainer::from_config(config, Some(&ckpt))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`batches_consumed` is") && err.contains("more than the 1 steps taken"),
        "{err}"
    );
    assert!(started.elapsed().as_secs() < 30, "refused, not replayed");
    let _ = std::fs::remove_dir_all(&out);
}

/// `--resume-from latest` says which checkpoint it took and which newer one it passed over
/// and why; resuming a finished run trains nothing, writes nothing and says so.
#[test]
fn a_resume_names_what_it_took_and_skipped_and_a_finished_run_does_nothing() {
    let dir = scratch("latest");
    let out = dir.join("out");
    let cfg = dir.join("sft.toml");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        &cfg,
        format!(
            "model = {:?}\ndataset = {:?}\noutput_dir = {out:?}\nmax_steps = 3\nsave_steps = 1\nbatch_size = 2\neval_fraction = 0.0\n[tokenize]\nmax_length = 64\n",
            common::root().join("datasets/tiny-qwen3-sft"),
            common::root().join("datasets/sft/train.parquet"),
        ),
    )
    .unwrap();
    let sft = || {
        std::process::Command::new(env!("CARGO_BIN_EXE_treetrain"))
            .args(["sft", "--config", cfg.to_str().unwrap(), "--resume-from", "latest"])
            .output()
            .unwrap()
    };
    let fresh = std::process::Command::new(env!("CARGO_BIN_EXE_treetrain"))
        .args(["sft", "--config", cfg.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(fresh.status.success(), "{}", String::from_utf8_lossy(&fresh.stderr));
    // The newest checkpoint loses its optimizer step file: it can no longer be resumed.
    std::fs::remove_file(out.join("checkpoint-3/optimizer.json")).unwrap();
    let resumed = sft();
    let err = String::from_utf8_lossy(&resumed.stderr);
    assert!(resumed.status.success(), "{err}");
    assert!(
        err.contains(&format!("resumed from {} (step 2)", out.join("checkpoint-2").display())),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "passed over {}: it cannot be resumed (no optimizer.json)",
            out.join("checkpoint-3").display()
        )),
        "{err}"
    );
    let state = out.join("checkpoint-3/trainer_state.json");
    let written = std::fs::metadata(&state).unwrap().modified().unwrap();
    let again = sft();
    let said = String::from_utf8_lossy(&again.stdout);
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    assert!(
        said.contains("the run is finished (step 3 of 3): nothing to do"),
        "{said}"
    );
    assert_eq!(
        std::fs::metadata(&state).unwrap().modified().unwrap(),
        written,
        "the last checkpoint was written again"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
