//! The main job on the shipped defaults (`treetrain demo`, `scripts/demo.sh`): the environment,
//! what padding buys on Neuron, the tiny model scoring conversations, a short SFT run, GRPO of
//! the shipped SFT model with tree-packed updates, tree vs flat packing of a real update, and
//! multi-turn GRPO of the shipped calculator tool task (nested forks).
//! [`run`] prints each section as it goes and returns a [`DemoSummary`] of the numbers; files
//! (report.html, charts, the GRPO log and checkpoint) go to the output folder.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::device::{PadTo, Platform};
use crate::display::{LineChart, Rich};
use crate::grpo::{EvalBreakdown, EvalResult, GrpoConfig, GrpoStepMetrics, GrpoTrainer, RewardStat, RolloutBatch};
use crate::model::{LoadOptions, Model};
use crate::pack::Packing;
use crate::sft::{SftConfig, SftTrainer, StepMetrics, TokenizeOptions};
use crate::shapes::{PaddingComparison, synthetic_lengths};
use crate::shipped::{ShippedEnvironment, calculator::Calculator};
use crate::tokenizer::Tokenizer;
use crate::train::{DataSettings, OptimizerSettings, TrainConfig, TrainError, Trainer};

/// What stopped the demo.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// Training failed.
    #[error(transparent)]
    Train(#[from] TrainError),
    /// The shipped model failed.
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    /// Tokenizing the shipped conversations failed.
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    /// The shape forecast failed.
    #[error(transparent)]
    Shapes(#[from] crate::shapes::ShapeError),
    /// The progress log could not be written.
    #[error("writing the demo's log: {0}")]
    Log(std::io::Error),
    /// An output file could not be written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
}

/// The demo's numbers, as `summary.json` holds them.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DemoSummary {
    /// `treetrain env --json`.
    pub env: serde_json::Value,
    /// Distinct shapes of 2000 chat-length sequences on Neuron.
    pub shapes: serde_json::Value,
    /// The tiny model's NLL on the shipped conversations.
    pub tiny_model: serde_json::Value,
    /// SFT held-out loss before and after.
    pub sft: serde_json::Value,
    /// GRPO held-out reward before and after, and generation speed.
    pub grpo: serde_json::Value,
    /// Tree vs flat packing of one real update.
    pub tree_packing: serde_json::Value,
    /// Multi-turn GRPO of the calculator tool task: held-out reward, tool calls, packing.
    pub multi_turn: serde_json::Value,
    /// Files written.
    pub files: Vec<String>,
}

/// Runs every section, printing to `log`; outputs go to `out`.
pub fn run(out: &Path, log: &mut dyn Write) -> Result<DemoSummary, DemoError> {
    std::fs::create_dir_all(out).map_err(|e| io(out, e))?;
    write_log(log, "== 1. Environment\n\n")?;
    let report = crate::EnvReport::collect();
    write_log(log, &report.text())?;
    write_log(
        log,
        "\n== 2. Shapes: what 2000 chat-length sequences cost in Neuron compiles\n\n",
    )?;
    let lengths = synthetic_lengths(2000, 350.0, 0.7, 8, 4096, 0);
    let comparison = PaddingComparison::new(&lengths, 8, PadTo::Auto, Platform::Neuron, 60.0)?;
    write_log(log, &comparison.text())?;
    write_log(
        log,
        "\n== 3. The shipped tiny Qwen3 scores the shipped conversations\n\n",
    )?;
    let (model, tok, tiny_model) = score_conversations(log)?;
    write_log(
        log,
        "\n== 4. SFT: 30 steps of the tiny model on the shipped conversations (bfd packing)\n\n",
    )?;
    let sft = sft_section(out, log)?;
    write_log(
        log,
        "\n== 5. GRPO of the shipped SFT model on the shipped prompts (datasets/grpo.toml), tree-packed updates\n\n",
    )?;
    let (grpo, shown, grpo_summary) = grpo_section(out, log)?;
    write_log(
        log,
        "\n== 6. The last informative step's rollouts: tree vs flat packing of the update (forward + backward)\n\n",
    )?;
    let tree_packing = packing_section(&grpo, &shown, log)?;
    write_log(
        log,
        "\n== 7. Multi-turn with a tool: the calculator task (datasets/calculator.toml; each tool result forked in two)\n\n",
    )?;
    let multi_turn = multi_turn_section(out, log)?;
    let checkpoint = grpo.save_checkpoint()?;
    let html = format!(
        "<!doctype html><meta charset=\"utf-8\"><title>treetrain demo</title>{}{}{}{}{}",
        report.html(),
        comparison.html(),
        model.html(),
        sample_completions(&shown, &tok).html(),
        grpo.html()
    );
    write_file(&out.join("report.html"), &html)?;
    write_file(&out.join("shapes.svg"), &comparison.chart().to_svg())?;
    let files = [
        "report.html",
        "shapes.svg",
        "sft_curves.svg",
        "grpo_curves.svg",
        "calculator_curves.svg",
        "grpo/log.jsonl",
        "summary.json",
    ];
    let mut files: Vec<String> = files.iter().map(|f| out.join(f).display().to_string()).collect();
    files.push(checkpoint.display().to_string());
    Ok(DemoSummary {
        env: report.to_json(),
        shapes: serde_json::json!({
            "sequences": comparison.sequences,
            "batch_size": comparison.batch_size,
            "platform": comparison.platform.to_string(),
            "compiles_without_padding": comparison.without.compiles(),
            "compiles_with_auto_padding": comparison.with.compiles(),
            "padding_fraction_with_auto": comparison.with.padding_fraction(),
            "compile_minutes_saved": comparison.seconds_saved() / 60.0,
        }),
        tiny_model,
        sft,
        grpo: grpo_summary,
        tree_packing,
        multi_turn,
        files,
    })
}

fn io(path: &Path, source: std::io::Error) -> DemoError {
    DemoError::Io {
        path: path.into(),
        source,
    }
}

fn write_file(path: &Path, text: &str) -> Result<(), DemoError> {
    std::fs::write(path, text).map_err(|e| io(path, e))
}

fn write_log(log: &mut dyn Write, text: &str) -> Result<(), DemoError> {
    write!(log, "{text}").map_err(DemoError::Log)
}

/// Section 3: mean NLL of the assistant tokens of 16 shipped conversations.
fn score_conversations(log: &mut dyn Write) -> Result<(Model, Tokenizer, serde_json::Value), DemoError> {
    let dir = crate::shipped::tiny_model_dir()?;
    let model = Model::load(&dir, LoadOptions::default())?;
    let tok = Tokenizer::from_dir(&dir)?;
    write_log(log, &model.text())?;
    let (mut total, mut trained_tokens) = (0f64, 0usize);
    for (messages, _) in crate::shipped::datasets::sft_conversations(16, 1) {
        let messages: Vec<serde_json::Value> = messages
            .iter()
            .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
            .collect();
        let chat = tok.tokenize_chat(&serde_json::Value::Array(messages), &Default::default())?;
        let ids: Vec<i64> = chat.input_ids.iter().map(|&i| i64::from(i)).collect();
        // Assistant-only: token t+1 is trained when its mask is 1.
        for (t, v) in model.score(&ids)?.iter().enumerate() {
            if chat.assistant_masks[t + 1] == 1 {
                total += f64::from(*v);
                trained_tokens += 1;
            }
        }
    }
    let nll = -total / trained_tokens.max(1) as f64;
    write_log(
        log,
        &format!(
            "assistant tokens of 16 conversations: {trained_tokens}, mean NLL {nll:.3} (perplexity {:.1}; uniform over the vocabulary would be {:.1})\n",
            nll.exp(),
            model.lm.config.vocab_size
        ),
    )?;
    let summary = serde_json::json!({
        "parameters": model.lm.config.num_parameters(),
        "assistant_tokens_scored": trained_tokens,
        "mean_nll": nll,
    });
    Ok((model, tok, summary))
}

/// Section 4: 30 SFT steps, held-out loss before and after, the loss curve.
fn sft_section(out: &Path, log: &mut dyn Write) -> Result<serde_json::Value, DemoError> {
    let config = SftConfig {
        train: TrainConfig {
            model: crate::shipped::tiny_model_dir()?.display().to_string(),
            data: DataSettings {
                dataset: crate::shipped::datasets_dir().join("sft/train.parquet"),
                ..Default::default()
            },
            optimizer: OptimizerSettings {
                learning_rate: 2e-3,
                warmup_ratio: 0.05,
                ..Default::default()
            },
            ..Default::default()
        },
        tokenize: TokenizeOptions {
            max_length: 256,
            ..Default::default()
        },
        packing: Some(crate::sft::PackingStrategy::Bfd),
        max_steps: Some(30),
        ..Default::default()
    };
    let mut sft = SftTrainer::new(config)?;
    let before = sft.evaluate()?;
    sft.train_for(30)?;
    let after = sft.evaluate()?;
    write_log(
        log,
        &format!("held-out loss per assistant token: {before:.3} -> {after:.3}\n"),
    )?;
    write_log(log, &sft.state.text())?;
    let pts = |f: fn(&StepMetrics) -> f64| sft.state.history.iter().map(|m| (m.step as f64, f(m))).collect();
    let chart = LineChart::new("SFT loss", "step", "loss per token").with_series("train", pts(|m| m.loss));
    write_file(&out.join("sft_curves.svg"), &chart.to_svg())?;
    Ok(serde_json::json!({"steps": 30, "held_out_loss_before": before, "held_out_loss_after": after}))
}

/// Section 5: the shipped GRPO recipe from the committed SFT model (which speaks the reply
/// format); returns the trainer and the latest batch that carried a learning signal.
fn grpo_section(out: &Path, log: &mut dyn Write) -> Result<(GrpoTrainer, RolloutBatch, serde_json::Value), DemoError> {
    let root = crate::shipped::datasets_dir();
    let mut config = GrpoConfig::from_toml_file(&root.join("grpo.toml"))?;
    config.train.output.output_dir = Some(out.join("grpo"));
    // Every demo run starts afresh.
    config.train.output.overwrite_output_dir = true;
    let mut grpo = GrpoTrainer::new(config)?;
    let held_out = grpo.load_prompts(&root.join("grpo/test.parquet"))?;
    // Held-out exact accuracy every `eval_steps` (8 samples of each test prompt, one seed): the
    // curve a researcher reads first, drawn as points beside the per-step training reward.
    let eval_every = grpo.config().train.output.eval_steps.unwrap_or(u64::MAX).max(1);
    let before = grpo.evaluate(&held_out, 8, 99)?;
    let by_task_before = grpo.evaluate_by(&held_out, "task", 8, 99)?;
    let mut held_out_exact = vec![(0.0, exact_share(&before))];
    let steps = grpo.state.total_steps;
    let t = std::time::Instant::now();
    let mut shown = None;
    while grpo.state.global_step < steps {
        let m = grpo.step()?;
        if let Some(b) = grpo
            .last_batch
            .as_ref()
            .filter(|b| b.rollouts().iter().any(|r| r.advantage != 0.0))
        {
            shown = Some(b.clone());
        }
        if m.step % 10 == 0 || m.step == 1 {
            write_log(log, &step_line(&m))?;
        }
        if m.step % eval_every == 0 && m.step < steps {
            let e = grpo.evaluate(&held_out, 8, 99)?;
            held_out_exact.push((m.step as f64, exact_share(&e)));
            write_log(
                log,
                &format!("  held-out exact answers at step {}: {:.3}\n", m.step, exact_share(&e)),
            )?;
        }
    }
    let seconds = t.elapsed().as_secs_f64();
    let after = grpo.evaluate(&held_out, 8, 99)?;
    let by_task_after = grpo.evaluate_by(&held_out, "task", 8, 99)?;
    held_out_exact.push((steps as f64, exact_share(&after)));
    write_log(
        log,
        &held_out_report([&before, &after], [&by_task_before, &by_task_after], steps, seconds),
    )?;
    let chart = grpo
        .state
        .reward_chart()
        .with_series("held-out exact_answer", held_out_exact.clone());
    write_file(&out.join("grpo_curves.svg"), &chart.to_svg())?;
    write_log(log, &grpo.state.text())?;
    let shown = match shown.or_else(|| grpo.last_batch.clone()) {
        Some(b) => b,
        None => return Err(TrainError::config("max_steps", "the demo's GRPO run took no step").into()),
    };
    let (tokens, gen_s) = (shown.generated_tokens, shown.generation_s);
    let summary = serde_json::json!({
        "steps": steps,
        "seconds": seconds,
        "held_out_reward_before": before.reward_mean,
        "held_out_reward_after": after.reward_mean,
        "held_out_exact_before": exact_share(&before),
        "held_out_exact_after": exact_share(&after),
        "held_out_exact_curve": held_out_exact,
        "held_out_by_task_before": by_task_before,
        "held_out_by_task_after": by_task_after,
        "frac_reward_zero_std_last_step": grpo.state.history.last().map(|m| m.rollouts.frac_reward_zero_std),
        "held_out_before": before,
        "held_out_after": after,
        "train_reward_first_step": grpo.state.history.first().map(|m| m.rollouts.reward_mean),
        "train_reward_last_step": grpo.state.history.last().map(|m| m.rollouts.reward_mean),
        "generated_tokens_last_step": tokens,
        "generation_tokens_per_s_last_step": tokens as f64 / gen_s.max(1e-9),
        "generation_distinct_shapes": grpo.generation_shapes().map_or(0, |l| l.total_distinct()),
    });
    Ok((grpo, shown, summary))
}

/// The demo's line for a GRPO step: reward, exact answers, zero-variance groups, packing.
fn step_line(m: &GrpoStepMetrics) -> String {
    format!(
        "step {:>3}: reward {:.3}, exact {:.3}, groups with equal rewards {:.0}%, completion {:.1} tokens, entropy {:.2}, update packing {:.1}x, {:.2} s\n",
        m.step,
        m.rollouts.reward_mean,
        exact_mean(&m.rollouts.rewards),
        100.0 * m.rollouts.frac_reward_zero_std,
        m.rollouts.completion_length,
        m.update.entropy,
        m.update.packing_ratio,
        m.times.step_s
    )
}

/// Held-out rewards before and after the run, its exact answers overall and by task kind.
fn held_out_report(eval: [&EvalResult; 2], by_task: [&EvalBreakdown; 2], steps: u64, seconds: f64) -> String {
    let [before, after] = eval;
    let per_fn = |e: &EvalResult| {
        e.per_function
            .iter()
            .map(|r| format!("{} {:.3}", r.name, r.mean))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let kinds: Vec<String> = by_task[0]
        .means("exact_answer")
        .into_iter()
        .zip(by_task[1].means("exact_answer"))
        .map(|((task, a), (_, b))| format!("{task} {a:.3} -> {b:.3}"))
        .collect();
    format!(
        "held-out reward ({} completions: 8 per test prompt): {:.3} ({}) -> {:.3} ({}) after {steps} steps in {seconds:.1} s (held-out evaluations included)\n\
         held-out exact answers: {:.3} -> {:.3} ({:+.3})\n\
         held-out exact answers by task: {}\n",
        after.completions,
        before.reward_mean,
        per_fn(before),
        after.reward_mean,
        per_fn(after),
        exact_share(before),
        exact_share(after),
        exact_share(after) - exact_share(before),
        kinds.join(", ")
    )
}

/// Share of held-out completions whose answer is exactly right (the `exact_answer` reward's
/// mean; 0 when the run has no such reward).
fn exact_share(e: &EvalResult) -> f64 {
    exact_mean(&e.per_function)
}

fn exact_mean(stats: &[RewardStat]) -> f64 {
    RewardStat::mean_in(stats, "exact_answer").unwrap_or(0.0)
}

/// Section 6: the same update packed both ways, best of 3 timings each.
fn packing_section(
    grpo: &GrpoTrainer,
    batch: &RolloutBatch,
    log: &mut dyn Write,
) -> Result<serde_json::Value, DemoError> {
    let (tree_s, tree) = grpo.measure_update(batch, Packing::Tree, 3)?;
    let (flat_s, flat) = grpo.measure_update(batch, Packing::Flat, 3)?;
    let (tree_ms, flat_ms) = (tree_s * 1e3, flat_s * 1e3);
    let rollouts = batch.rollouts().len();
    let line = format!(
        "step {}, {rollouts} rollouts: {} tokens flat, {} forwarded as prefix trees (packing ratio {:.2}); update {flat_ms:.0} ms flat, {tree_ms:.0} ms tree ({:.2}x); loss {:.6} vs {:.6}\n",
        batch.version + 1,
        flat.forwarded_tokens,
        tree.forwarded_tokens,
        tree.packing_ratio(),
        flat_ms / tree_ms,
        tree.loss,
        flat.loss
    );
    write_log(log, &line)?;
    Ok(serde_json::json!({
        "rollouts": rollouts,
        "flat_tokens": flat.forwarded_tokens,
        "tree_tokens": tree.forwarded_tokens,
        "packing_ratio": tree.packing_ratio(),
        "flat_update_ms": flat_ms,
        "tree_update_ms": tree_ms,
        "tree_speedup": flat_ms / tree_ms,
        "loss_tree": tree.loss,
        "loss_flat": flat.loss,
    }))
}

/// Section 7: multi-turn GRPO of the shipped calculator tool task (`datasets/calculator.toml`):
/// the held-out reward before, during and after, how often the model calls the tool, and the
/// nested forks' packing of the last step.
fn multi_turn_section(out: &Path, log: &mut dyn Write) -> Result<serde_json::Value, DemoError> {
    let root = crate::shipped::datasets_dir();
    let mut config = GrpoConfig::from_toml_file(&root.join("calculator.toml"))?;
    config.train.output.output_dir = None;
    let (samples, eval_every) = (
        config.eval.eval_samples,
        config.train.output.eval_steps.unwrap_or(u64::MAX).max(1),
    );
    let mut grpo = ShippedEnvironment::Calculator.trainer(config, None)?;
    let held_out = grpo.load_prompts(&root.join("calculator/test.parquet"))?;
    let before = grpo.evaluate(&held_out, samples, 99)?;
    let mut curve = vec![(0.0, before.reward_mean)];
    let mut steps = Vec::new();
    let t = std::time::Instant::now();
    while grpo.state.global_step < grpo.state.total_steps {
        let m = grpo.step()?;
        let calls = grpo
            .last_batch
            .as_ref()
            .map_or(0.0, |b| Calculator::call_share(b, grpo.tokenizer()));
        if m.step % 5 == 0 || m.step == 1 {
            let line = format!(
                "step {:>2}: reward {:.3}, calls the calculator in {:.0}% of conversations, groups with equal rewards {:.0}%, failed {}, update packing {:.1}x, {:.2} s\n",
                m.step,
                m.rollouts.reward_mean,
                100.0 * calls,
                100.0 * m.rollouts.frac_reward_zero_std,
                m.rollouts.reward_failures,
                m.update.packing_ratio,
                m.times.step_s
            );
            write_log(log, &line)?;
        }
        if m.step % eval_every == 0 && m.step < grpo.state.total_steps {
            curve.push((m.step as f64, grpo.evaluate(&held_out, samples, 99)?.reward_mean));
        }
        steps.push(
            serde_json::json!({"reward": m.rollouts.reward_mean, "tool_call_share": calls, "packing_ratio": m.update.packing_ratio}),
        );
    }
    let seconds = t.elapsed().as_secs_f64();
    let after = grpo.evaluate(&held_out, samples, 99)?;
    curve.push((grpo.state.global_step as f64, after.reward_mean));
    write_log(
        log,
        &format!(
            "held-out right answers ({} prompts x {samples} conversations): {:.3} -> {:.3} in {} steps ({seconds:.0} s)\n",
            held_out.prompts.len(),
            before.reward_mean,
            after.reward_mean,
            grpo.state.global_step
        ),
    )?;
    let chart = grpo
        .state
        .reward_chart()
        .with_series("held-out right answers", curve.clone());
    write_file(&out.join("calculator_curves.svg"), &chart.to_svg())?;
    let batch = grpo
        .last_batch
        .clone()
        .ok_or_else(|| TrainError::config("max_steps", "the multi-turn run took no step"))?;
    let packing = packing_section(&grpo, &batch, log)?;
    Ok(serde_json::json!({
        "seconds": seconds,
        "held_out_reward_before": before.reward_mean,
        "held_out_reward_after": after.reward_mean,
        "held_out_curve": curve,
        "steps": steps,
        "packing": packing,
    }))
}

/// Two completions of every prompt of `batch`, for the report.
fn sample_completions(batch: &RolloutBatch, tok: &Tokenizer) -> crate::generate::Completions {
    let prompts: Vec<Vec<i64>> = batch.groups.iter().map(|g| g.prompt_ids.clone()).collect();
    let completions = batch
        .groups
        .iter()
        .enumerate()
        .flat_map(|(i, g)| {
            g.completions.iter().take(2).cloned().map(move |mut c| {
                c.prompt_index = i;
                c
            })
        })
        .collect();
    crate::generate::Completions::new(completions, &prompts, Some(tok))
}

impl Rich for DemoSummary {
    fn html(&self) -> String {
        crate::display::config_html("Demo summary", self)
    }
    fn text(&self) -> String {
        crate::display::config_text(self)
    }
}

crate::display::rich_display!(DemoSummary);
