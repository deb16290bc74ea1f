//! Runs people watch and manage: TensorBoard and CSV logs read back by their own readers,
//! checkpoint rotation, resuming from the latest checkpoint, and the settings' bad values.

use std::path::{Path, PathBuf};
use std::process::Command;

use treetrain::grpo::{GrpoConfig, GrpoTrainer};
use treetrain::sft::{SftConfig, SftTrainer};
use treetrain::train::{EventScalars, ReportTo, ResumeFrom, TrainConfig, TrainError, Trainer, checkpoints};

mod common;

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("treetrain-runlogs-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Every report target on, evaluations and a held-out split.
fn all_reports(train: &mut TrainConfig, out: &Path) {
    train.output.output_dir = Some(out.into());
    train.output.report_to = vec![ReportTo::Jsonl, ReportTo::Tensorboard, ReportTo::Csv];
}

fn sft(out: &Path, steps: u64) -> SftConfig {
    let mut c = common::shipped_sft(None, steps);
    all_reports(&mut c.train, out);
    c.eval_fraction = 0.1;
    c
}

fn grpo(out: &Path, steps: u64) -> GrpoConfig {
    let mut c = common::shipped_grpo();
    all_reports(&mut c.train, out);
    c.max_steps = steps;
    c.rollouts.prompts_per_step = 4;
    c.rollouts.num_generations = 4;
    c.rollouts.max_completion_length = 8;
    c.eval.eval_dataset = Some(common::root().join("datasets/grpo/test.parquet"));
    c.eval.eval_samples = 0;
    c
}

/// `log.jsonl`'s steps, in file order.
fn logged_steps(out: &Path) -> Vec<u64> {
    std::fs::read_to_string(out.join("log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect()
}

/// Trains 2 steps, evaluates, checkpoints, trains 2 more that no checkpoint keeps (a run
/// killed there), then resumes from the latest checkpoint to the end and evaluates: the logs
/// must hold every step once, the lost steps replaced.
fn run_killed_and_resumed<T: Trainer>(make: impl Fn(bool) -> Result<T, TrainError>) -> (T, PathBuf) {
    let mut first = make(false).unwrap();
    first.train_for(2).unwrap();
    first.evaluate_held_out().unwrap().expect("held-out data");
    first.save_checkpoint().unwrap();
    first.train_for(2).unwrap();
    let dir = first.core().logging_dir().unwrap().to_path_buf();
    drop(first);
    let mut resumed = make(true).unwrap();
    assert_eq!(resumed.progress().done, 2);
    assert_eq!(
        resumed.core().logging_dir(),
        Some(dir.as_path()),
        "a resume continues the folder"
    );
    resumed.train_for(u64::MAX).unwrap();
    resumed.evaluate_held_out().unwrap();
    (resumed, dir)
}

/// The same numbers in TensorBoard as in `log.jsonl`, read back by treetrain's reader.
fn assert_events_match_the_jsonl(out: &Path, dir: &Path, loss_tag: &str, loss_key: &str) {
    let events = EventScalars::read(dir).unwrap();
    let log: Vec<serde_json::Value> = std::fs::read_to_string(out.join("log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let want: Vec<(u64, f64)> = log
        .iter()
        .map(|l| (l["step"].as_u64().unwrap(), l[loss_key].as_f64().unwrap()))
        .collect();
    let got = events.series(loss_tag);
    assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
    for (g, w) in got.iter().zip(&want) {
        assert!(
            g.0 == w.0 && (g.1 - w.1).abs() <= 1e-6 * w.1.abs().max(1e-12),
            "{g:?} vs {w:?}"
        );
    }
}

/// TensorBoard's own reader and pandas, when the test run provides them.
fn check_with_python_readers(out: &Path, dir: &Path, kind: &str) {
    let python = std::env::var("TREETRAIN_LOG_READERS_PYTHON")
        .expect("set TREETRAIN_LOG_READERS_PYTHON (scripts/setup-run-log-readers.sh prints it)");
    let script = common::root().join("scripts/check_run_logs.py");
    let run = Command::new(python)
        .arg(script)
        .arg(out)
        .arg(dir)
        .arg(kind)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr),
    );
    assert!(run.status.success(), "{stdout}{stderr}");
    eprintln!("{kind}: {stdout}");
}

/// [`run_killed_and_resumed`] of 6 SFT steps into `out`, resuming the latest checkpoint.
fn sft_killed_and_resumed(out: &Path) -> (SftTrainer, PathBuf) {
    run_killed_and_resumed(|resume| {
        let mut c = sft(out, 6);
        c.train.output.resume_from_checkpoint = resume.then_some(ResumeFrom::Latest);
        SftTrainer::from_config(c, None)
    })
}

#[test]
fn an_sft_run_killed_and_resumed_logs_each_step_once_everywhere() {
    let out = scratch("sft");
    let (t, dir) = sft_killed_and_resumed(&out);
    assert_eq!(logged_steps(&out), [1, 2, 3, 4, 5, 6]);
    assert_events_match_the_jsonl(&out, &dir, "train/loss", "loss");
    let csv = std::fs::read_to_string(out.join("metrics.csv")).unwrap();
    assert!(
        csv.starts_with("step,train/epoch,train/loss,train/learning_rate,"),
        "{csv}"
    );
    assert_eq!(csv.lines().count(), 1 + 6 + 2, "header, six steps, two evaluations");
    assert!(dir.starts_with(out.join("runs")) && std::fs::read_dir(&dir).unwrap().count() == 2);
    let html = treetrain::display::Rich::html(&t);
    assert!(html.contains("Run logs") && html.contains(&format!("tensorboard --logdir {}", dir.display())));
}

#[test]
#[ignore = "slow: TensorBoard's and pandas' readers (scripts/setup-run-log-readers.sh; test.sh sets TREETRAIN_LOG_READERS_PYTHON)"]
fn tensorboard_and_pandas_read_what_sft_and_grpo_runs_log() {
    let out = scratch("sft-readers");
    let (_, dir) = sft_killed_and_resumed(&out);
    check_with_python_readers(&out, &dir, "sft");
    let out = scratch("grpo-readers");
    let (_, dir) = run_killed_and_resumed(|resume| {
        let mut c = grpo(&out, 5);
        c.train.output.resume_from_checkpoint = resume.then_some(ResumeFrom::Latest);
        GrpoTrainer::from_config(c, None)
    });
    assert_eq!(logged_steps(&out), [1, 2, 3, 4, 5]);
    assert_events_match_the_jsonl(&out, &dir, "train/reward", "reward_mean");
    check_with_python_readers(&out, &dir, "grpo");
}

/// Every trained weight of `t`, by name.
fn weights<T: Trainer>(t: &T) -> Vec<(String, tch::Tensor)> {
    let mut w = t.core().model.vs.variables().into_iter().collect::<Vec<_>>();
    w.sort_by(|a, b| a.0.cmp(&b.0));
    w
}

#[test]
fn save_total_limit_keeps_the_newest_and_latest_resumes_bit_exactly() {
    let reference = {
        let mut t = SftTrainer::new(common::shipped_sft(None, 8)).unwrap();
        t.train_for(8).unwrap();
        weights(&t)
    };
    let out = scratch("rotate");
    let config = |resume| {
        let mut c = common::shipped_sft(Some(out.clone()), 8);
        c.train.output.save_total_limit = Some(2);
        c.train.output.resume_from_checkpoint = resume;
        c
    };
    let mut t = SftTrainer::new(config(None)).unwrap();
    for _ in 0..6 {
        t.train_for(1).unwrap();
        t.save_checkpoint().unwrap();
    }
    drop(t);
    let kept: Vec<u64> = checkpoints(&out).into_iter().map(|c| c.0).collect();
    assert_eq!(kept, [5, 6], "the last two of six saves");
    for step in kept {
        assert_complete(&out.join(format!("checkpoint-{step}")), "after rotation");
    }
    let mut resumed = SftTrainer::new(config(Some(ResumeFrom::Latest))).unwrap();
    assert_eq!(resumed.progress().done, 6);
    resumed.train_for(2).unwrap();
    for ((name, a), (_, b)) in weights(&resumed).iter().zip(&reference) {
        assert!(a.equal(b), "{name} differs from the uninterrupted run");
    }
    resumed.save_checkpoint().unwrap();
    let kept: Vec<u64> = checkpoints(&out).into_iter().map(|c| c.0).collect();
    assert_eq!(kept, [6, 8], "the newest two, the resumed-from one among them");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn save_only_model_checkpoints_load_as_models_but_never_resume() {
    let out = scratch("model-only");
    let mut c = common::shipped_sft(Some(out.clone()), 4);
    c.train.output.save_only_model = true;
    let mut t = SftTrainer::new(c.clone()).unwrap();
    t.train_for(2).unwrap();
    let ckpt = t.save_checkpoint().unwrap();
    assert!(ckpt.join("model.safetensors").is_file() && !ckpt.join("optimizer.safetensors").exists());
    let options = treetrain::model::LoadOptions::default();
    assert!(treetrain::model::Model::load(&ckpt, options).is_ok());
    let err = SftTrainer::from_config(c.clone(), Some(&ckpt)).unwrap_err().to_string();
    assert!(err.contains("save_only_model") && err.contains("checkpoint-2"), "{err}");
    c.train.output.resume_from_checkpoint = Some(ResumeFrom::Latest);
    let err = SftTrainer::new(c).unwrap_err().to_string();
    assert!(err.contains("save_only_model"), "{err}");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn bad_log_and_checkpoint_settings_are_refused_before_step_one() {
    let out = scratch("bad");
    std::fs::create_dir_all(&out).unwrap();
    let file = out.join("taken");
    std::fs::write(&file, "a file, not a folder").unwrap();
    type Change<'a> = Box<dyn Fn(&mut TrainConfig) + 'a>;
    let cases: [(&str, Change); 5] = [
        (
            "`report_to`",
            Box::new(|t| t.output.report_to = vec![ReportTo::None, ReportTo::Csv]),
        ),
        ("`save_total_limit`", Box::new(|t| t.output.save_total_limit = Some(0))),
        (
            "`logging_dir`",
            Box::new(|t| {
                t.output.report_to = vec![ReportTo::Tensorboard];
                t.output.logging_dir = Some(file.join("runs"));
            }),
        ),
        (
            "`logging_dir`",
            Box::new(|t| {
                t.output.report_to = vec![ReportTo::Tensorboard];
                t.output.output_dir = None;
            }),
        ),
        (
            "`resume_from_checkpoint`",
            Box::new(|t| t.output.resume_from_checkpoint = Some(ResumeFrom::Latest)),
        ),
    ];
    for (field, change) in cases {
        let mut c = common::shipped_sft(Some(out.join("run")), 2);
        change(&mut c.train);
        let err = SftTrainer::new(c).unwrap_err().to_string();
        assert!(err.contains(field), "{field}: {err}");
    }
    for (toml, want) in [
        ("report_to = \"wandb\"", "`report_to` = \"wandb\": expected"),
        (
            "report_to = [\"csv\", \"mlflow\"]",
            "`report_to` = [\"csv\",\"mlflow\"]",
        ),
    ] {
        let path = out.join("bad.toml");
        std::fs::write(&path, format!("model = \"m\"\ndataset = \"d\"\n{toml}\n")).unwrap();
        let err = SftConfig::from_toml_file(&path).unwrap_err().to_string();
        assert!(err.contains(want), "{err}");
    }
    let path = out.join("good.toml");
    std::fs::write(
        &path,
        "model = \"m\"\ndataset = \"d\"\nreport_to = \"csv\"\nresume_from_checkpoint = true\n",
    )
    .unwrap();
    let good = SftConfig::from_toml_file(&path).unwrap();
    assert_eq!(good.train.output.report_to, [ReportTo::Csv]);
    assert_eq!(good.train.output.resume_from_checkpoint, Some(ResumeFrom::Latest));
    let _ = std::fs::remove_dir_all(&out);
}

/// `dir/sft.toml`: the shipped SFT at test size into `dir/out`, logging to `log.jsonl` and
/// TensorBoard, with `extra` settings.
fn sft_toml(dir: &Path, extra: &str) -> PathBuf {
    let out = dir.join("out");
    let config = dir.join("sft.toml");
    let model = treetrain::shipped::tiny_model_dir().unwrap();
    let data = common::root().join("datasets/sft/train.parquet");
    std::fs::write(
        &config,
        format!(
            "model = {model:?}\ndataset = {data:?}\noutput_dir = {out:?}\npacking = \"bfd\"\nbatch_size = 4\n\
             report_to = [\"jsonl\", \"tensorboard\"]\n{extra}[tokenize]\nmax_length = 128\n"
        ),
    )
    .unwrap();
    config
}

#[test]
fn a_second_run_into_a_used_output_dir_is_refused_at_once() {
    let dir = scratch("two-runs");
    std::fs::create_dir_all(&dir).unwrap();
    let config = sft_toml(&dir, "max_steps = 200\n");
    let sft = || {
        Command::new(env!("CARGO_BIN_EXE_treetrain"))
            .args(["sft", "--config", config.to_str().unwrap()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    // Started together: one holds the folder, the other is refused before any work.
    let mut runs = common::Workers(vec![sft(), sft()]);
    let started = std::time::Instant::now();
    let refused = loop {
        if let Some(i) = (0..2).find(|&i| runs.0[i].try_wait().unwrap().is_some()) {
            break i;
        }
        assert!(started.elapsed().as_secs() < 30, "neither run was refused");
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    let out = runs.0.remove(refused).wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("is in use by another run (process"),
        "{err}"
    );
    // Beside the live run, a trainer built here is refused before it loads anything.
    let cfg = SftConfig::from_toml_file(&config).unwrap();
    let started = std::time::Instant::now();
    let err = SftTrainer::new(cfg).unwrap_err().to_string();
    let refused_after = started.elapsed();
    assert!(err.contains(&format!("process {}", runs.0[0].id())), "{err}");
    assert!(refused_after.as_millis() < 1000, "refused after {refused_after:?}");
    drop(runs);
    // The killed run's lock is stale (its process is gone), but its checkpoint-less folder
    // may be reused; one with checkpoints needs a resume or overwrite_output_dir.
    std::fs::create_dir_all(dir.join("out/checkpoint-3")).unwrap();
    let run = Command::new(env!("CARGO_BIN_EXE_treetrain"))
        .args(["sft", "--config", config.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(
        !run.status.success() && err.contains("holds an earlier run's checkpoints (checkpoint-3)"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `dir` holds everything a resume reads.
fn assert_complete(dir: &Path, when: &str) {
    for f in [
        "model.safetensors",
        "optimizer.safetensors",
        "optimizer.json",
        "trainer_state.json",
    ] {
        assert!(dir.join(f).is_file(), "{}/{f} missing {when}", dir.display());
    }
}

/// The newest `checkpoint-N` of `out` holds everything a resume reads.
fn assert_newest_checkpoint_complete(out: &Path) -> u64 {
    let (step, dir) = checkpoints(out).pop().expect("a checkpoint survives every kill");
    assert_complete(&dir, "after a kill");
    step
}

/// A save's temporary folder (`.checkpoint-<step>.<pid>.tmp`), left behind by a kill inside it.
fn is_checkpoint_tmp(name: &std::ffi::OsStr) -> bool {
    let name = name.to_string_lossy();
    name.starts_with(".checkpoint-") && name.ends_with(".tmp")
}

#[test]
#[ignore = "slow: five CLI runs, four killed"]
fn kill_9_during_saves_never_costs_the_last_checkpoint_and_latest_resumes() {
    let dir = scratch("kill");
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("out");
    let config = sft_toml(&dir, "max_steps = 24\nsave_steps = 1\nsave_total_limit = 1\n");
    let sft = |resume: bool| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_treetrain"));
        cmd.args(["sft", "--config", config.to_str().unwrap()]);
        if resume {
            cmd.args(["--resume-from", "latest"]);
        }
        cmd.stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        cmd
    };
    // Kill at moments after a new checkpoint appears, and twice the moment a save's temporary
    // folder appears (inside a save). A run removes the folders earlier kills left.
    let temporary = || -> Vec<std::ffi::OsString> {
        let entries = std::fs::read_dir(&out).into_iter().flatten().flatten();
        entries
            .map(|e| e.file_name())
            .filter(|n| is_checkpoint_tmp(n))
            .collect()
    };
    let mut interrupted = 0;
    for (i, delay_ms) in [Some(120u64), None, Some(570), None].into_iter().enumerate() {
        let seen = checkpoints(&out).last().map_or(0, |c| c.0);
        let left = temporary();
        let fresh = || temporary().into_iter().filter(|n| !left.contains(n)).count();
        let mut run = common::Workers(vec![sft(i > 0).spawn().unwrap()]);
        let started = std::time::Instant::now();
        loop {
            let newer = checkpoints(&out).last().map_or(0, |c| c.0) > seen;
            match delay_ms {
                Some(ms) if newer => break std::thread::sleep(std::time::Duration::from_millis(ms)),
                None if newer && fresh() > 0 => break,
                _ => {}
            }
            assert!(started.elapsed().as_secs() < 120, "no new checkpoint");
            assert!(
                run.0[0].try_wait().unwrap().is_none(),
                "the run ended before it was killed"
            );
        }
        drop(run);
        interrupted += fresh();
        assert_newest_checkpoint_complete(&out);
    }
    let last = sft(true).stdout(std::process::Stdio::piped()).output().unwrap();
    let printed = String::from_utf8_lossy(&last.stdout);
    assert!(last.status.success(), "{printed}");
    // save_steps divides max_steps: the last step's checkpoint is written once, not again at
    // the end.
    assert_eq!(printed.matches("checkpoint-24\n").count(), 1, "{printed}");
    assert_eq!(assert_newest_checkpoint_complete(&out), 24);
    let kept: Vec<u64> = checkpoints(&out).into_iter().map(|c| c.0).collect();
    assert_eq!(
        kept.len(),
        2,
        "save_total_limit = 1, and the one this run resumed from: {kept:?}"
    );
    assert!(interrupted >= 1, "no kill landed inside a save");
    assert_eq!(
        temporary(),
        Vec::<std::ffi::OsString>::new(),
        "half-written folders left"
    );
    assert_eq!(logged_steps(&out), (1..=24).collect::<Vec<u64>>());
    let runs: Vec<PathBuf> = std::fs::read_dir(out.join("runs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(
        runs.len(),
        1,
        "every resume continues the first run's TensorBoard folder"
    );
    let events = EventScalars::read(&runs[0]).unwrap();
    let steps: Vec<u64> = events.series("train/loss").iter().map(|p| p.0).collect();
    assert_eq!(steps, (1..=24).collect::<Vec<u64>>());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every key of a GRPO step's `log.jsonl` line, in order, with a value of its type (pinned:
/// how the Rust record is laid out never renames, reorders or drops a key).
const GRPO_STEP_KEYS: &[(&str, &str)] = &[
    ("step", "3"),
    ("generated_by", "2"),
    ("staleness", "1"),
    ("dropped_stale", "4"),
    ("reward_mean", "0.5"),
    ("reward_std", "0.25"),
    ("rewards", r#"[{"name":"exact_answer","mean":0.75,"std":0.125}]"#),
    ("reward_failures", "5"),
    ("completion_length", "6.5"),
    ("completion_length_max", "9"),
    ("completion_length_min", "2"),
    ("frac_reward_zero_std", "0.375"),
    ("truncated_ratio", "0.0625"),
    ("loss", "1.5"),
    ("grad_norm", "2.5"),
    ("lr", "0.001"),
    ("clip_ratio", "0.03125"),
    ("clip_ratio_low", "0.015625"),
    ("clip_ratio_high", "0.0078125"),
    ("approx_kl", "0.1"),
    ("kl", "0.2"),
    ("entropy", "0.3"),
    ("entropy_coef", "0.01"),
    ("sampling_correction", "0.9"),
    ("packing_ratio", "1.75"),
    ("forwarded_tokens", "100"),
    ("raw_tokens", "175"),
    ("rows", "2"),
    ("generation_s", "0.4"),
    ("wait_s", "0.05"),
    ("reward_s", "0.02"),
    ("pack_s", "0.01"),
    ("forward_backward_s", "0.6"),
    ("optimizer_s", "0.07"),
    ("step_s", "1.2"),
    ("generation_tokens_per_s", "130.5"),
    ("training_tokens_per_s", "291.5"),
    ("skipped", "false"),
    ("realign_frac", "0.125"),
    ("fork_frac", "0.0"),
    ("drift_tokens_mean", "1.5"),
    ("drift_tokens_max", "3"),
];

/// The TensorBoard tags (and `metrics.csv` columns after `step`) of that line, in order:
/// TRL's names where it logs the quantity.
const GRPO_STEP_TAGS: &[&str] = &[
    "train/generated_by",
    "train/staleness",
    "train/dropped_stale",
    "train/reward",
    "train/reward_std",
    "train/rewards/exact_answer/mean",
    "train/rewards/exact_answer/std",
    "train/reward_failures",
    "train/completions/mean_length",
    "train/completions/max_length",
    "train/completions/min_length",
    "train/frac_reward_zero_std",
    "train/completions/clipped_ratio",
    "train/loss",
    "train/grad_norm",
    "train/learning_rate",
    "train/clip_ratio/region_mean",
    "train/clip_ratio/low_mean",
    "train/clip_ratio/high_mean",
    "train/approx_kl",
    "train/kl",
    "train/entropy",
    "train/entropy_coef",
    "train/sampling/importance_sampling_ratio/mean",
    "train/packing_ratio",
    "train/forwarded_tokens",
    "train/raw_tokens",
    "train/rows",
    "train/generation_s",
    "train/wait_s",
    "train/reward_s",
    "train/pack_s",
    "train/forward_backward_s",
    "train/optimizer_s",
    "train/step_s",
    "train/generation_tokens_per_s",
    "train/training_tokens_per_s",
    "train/skipped",
    "train/rollout/realign_frac",
    "train/rollout/fork_frac",
    "train/rollout/drift_tokens_mean",
    "train/rollout/drift_tokens_max",
];

#[test]
fn grpo_step_metrics_keep_their_log_keys_tags_and_columns_in_order() {
    use treetrain::grpo::GrpoStepMetrics;
    use treetrain::train::Scalars;
    let fields: Vec<String> = GRPO_STEP_KEYS.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
    let line = format!("{{{}}}", fields.join(","));
    let m: GrpoStepMetrics = serde_json::from_str(&line).unwrap();
    assert_eq!(serde_json::to_string(&m).unwrap(), line, "log.jsonl's line changed");
    let tags: Vec<String> = m.scalars().into_iter().map(|(tag, _)| tag).collect();
    assert_eq!(tags, GRPO_STEP_TAGS, "TensorBoard tags / CSV columns changed");
    // A line written before the newer metrics existed still reads (they default to 0).
    let newer = [
        "completion_length_min",
        "frac_reward_zero_std",
        "clip_ratio_low",
        "clip_ratio_high",
        "entropy_coef",
        "sampling_correction",
        "realign_frac",
        "fork_frac",
        "drift_tokens_mean",
        "drift_tokens_max",
    ];
    let older: Vec<&String> = fields
        .iter()
        .filter(|f| !newer.iter().any(|k| f.starts_with(&format!("\"{k}\":"))))
        .collect();
    let older = format!("{{{}}}", older.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(","));
    let old: GrpoStepMetrics = serde_json::from_str(&older).unwrap();
    let back: serde_json::Value = serde_json::to_value(&old).unwrap();
    for k in newer {
        assert_eq!(back[k].as_f64(), Some(0.0), "{k}");
    }
}

/// A run copied or moved to another folder, or a checkpoint whose state names another log
/// folder, resumes logging only under its own `output_dir`: the saved log folder is kept
/// relative to `output_dir`, and a saved path is never followed.
#[test]
fn a_copied_or_moved_run_logs_only_under_its_own_output_dir() {
    let root = scratch("moved");
    let (a, b, c) = (root.join("a"), root.join("b"), root.join("c"));
    let resume_into = |out: &Path| {
        let mut cfg = sft(out, 4);
        cfg.eval_fraction = 0.0;
        cfg.train.output.resume_from_checkpoint = Some(ResumeFrom::Latest);
        SftTrainer::from_config(cfg, None).unwrap()
    };
    let mut cfg = sft(&a, 4);
    cfg.eval_fraction = 0.0;
    let mut first = SftTrainer::from_config(cfg, None).unwrap();
    first.train_for(2).unwrap();
    first.save_checkpoint().unwrap();
    let name = first.core().logging_dir().unwrap().file_name().unwrap().to_os_string();
    drop(first);
    let events_of = |out: &Path| std::fs::read_dir(out.join("runs").join(&name)).unwrap().count();
    let ok = Command::new("cp").arg("-a").arg(&a).arg(&b).status().unwrap();
    assert!(ok.success());
    let bytes = |dir: &Path| -> u64 {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum()
    };
    let a_logs = bytes(&a.join("runs").join(&name));
    let mut copied = resume_into(&b);
    assert_eq!(copied.core().logging_dir(), Some(b.join("runs").join(&name).as_path()));
    copied.train_for(1).unwrap();
    drop(copied);
    assert_eq!(
        bytes(&a.join("runs").join(&name)),
        a_logs,
        "the copy wrote into the original's logs"
    );
    assert!(events_of(&b) >= 1);
    std::fs::rename(&a, &c).unwrap();
    let mut moved = resume_into(&c);
    moved.train_for(1).unwrap();
    drop(moved);
    assert!(!a.exists(), "a resume after `mv a c` wrote under a again");
    // A state naming a folder outside the run: not followed.
    let outside = root.join("outside");
    let state = b.join("checkpoint-2/trainer_state.json");
    let mut saved: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    assert_eq!(
        saved["logging_dir"],
        format!("runs/{}", name.to_string_lossy()),
        "kept relative"
    );
    saved["logging_dir"] = outside.join("x").to_string_lossy().into_owned().into();
    std::fs::write(&state, saved.to_string()).unwrap();
    let _ = std::fs::remove_dir_all(b.join("checkpoint-3"));
    let mut tampered = resume_into(&b);
    tampered.train_for(1).unwrap();
    assert!(tampered.core().logging_dir().unwrap().starts_with(&b));
    drop(tampered);
    assert!(!outside.exists(), "a saved log path outside the run was followed");
    let _ = std::fs::remove_dir_all(&root);
}
