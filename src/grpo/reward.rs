//! Reward functions: closures over one rollout, combined with weights; built-ins for the
//! shipped verifiable tasks.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use serde_json::{Map, Value};

use super::answer::extract_answer;

/// What a reward function sees of one rollout.
#[derive(Debug, Clone, Copy)]
pub struct RewardInput<'a> {
    /// The prompt as rendered by the chat template.
    pub prompt: &'a str,
    /// The completion's text (special tokens removed).
    pub completion: &'a str,
    /// The completion's token ids (EOS included when generated).
    pub completion_ids: &'a [i64],
    /// Whether the completion hit `max_completion_length` before EOS.
    pub truncated: bool,
    /// The dataset row the prompt came from (every column, e.g. `answer`, `task`).
    pub row: &'a Map<String, Value>,
    /// Multi-turn: the environment's reward of the conversation (`None` in single-turn runs).
    pub environment: Option<f32>,
}

/// A reward closure: `None` means "cannot score this rollout" (reported; advantage 0).
pub(crate) type RewardClosure = dyn Fn(&RewardInput) -> Option<f32> + Send + Sync;

/// A named, weighted reward function.
#[derive(Clone)]
pub struct RewardFn {
    /// Shown in metrics and displays.
    pub name: String,
    /// Multiplies the score in the rollout's total reward.
    pub weight: f32,
    f: Arc<RewardClosure>,
    /// The dataset column it reads (checked on every prompt row before training starts).
    needs_column: Option<&'static str>,
}

impl std::fmt::Debug for RewardFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RewardFn({} x {})", self.name, self.weight)
    }
}

/// Why a rollout got no reward from a function.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RewardFailure {
    /// The function.
    pub function: String,
    /// Dataset row of the prompt.
    pub dataset_row: usize,
    /// Index of the completion within its group.
    pub completion: usize,
    /// `returned None`, `returned NaN` or the panic message.
    pub reason: String,
}

impl RewardFn {
    /// A reward from a closure, weight 1.
    pub fn new(name: &str, f: impl Fn(&RewardInput) -> Option<f32> + Send + Sync + 'static) -> Self {
        RewardFn {
            name: name.to_string(),
            weight: 1.0,
            f: Arc::new(f),
            needs_column: None,
        }
    }

    /// The same function, declaring the dataset column it reads: a prompt set whose rows lack
    /// it is a config error at start, not a run at reward 0.
    pub(crate) fn needing_column(mut self, column: &'static str) -> Self {
        self.needs_column = Some(column);
        self
    }

    /// The column declared by [`RewardFn::needing_column`].
    pub(crate) fn needs_column(&self) -> Option<&'static str> {
        self.needs_column
    }

    /// The same function with another weight.
    pub fn with_weight(mut self, weight: f32) -> Self {
        self.weight = weight;
        self
    }

    /// 1 when the answer in the completion (the text after the last `Answer:`) equals the row's
    /// `answer` column, else 0; `None` for rows without an `answer`.
    pub fn exact_answer() -> Self {
        RewardFn::new("exact_answer", |x| {
            let want = x.row.get("answer")?;
            let want = match want {
                Value::String(s) => s.trim().to_string(),
                other => other.to_string(),
            };
            Some(if extract_answer(x.completion) == want { 1.0 } else { 0.0 })
        })
        .needing_column("answer")
    }

    /// 1 when the completion is exactly one line `Answer: <something>` and ended on EOS (not
    /// truncated), else 0: the reply format of the shipped SFT data.
    pub fn answer_format() -> Self {
        RewardFn::new("answer_format", |x| {
            let text = x.completion.trim();
            let ok = !x.truncated
                && !text.contains('\n')
                && text
                    .strip_prefix("Answer:")
                    .is_some_and(|rest| !rest.trim().is_empty() && !rest.contains("Answer:"));
            Some(if ok { 1.0 } else { 0.0 })
        })
    }

    /// The environment's reward of a multi-turn conversation, named after the environment
    /// (`None`, hence a failure, when no environment scored it).
    pub fn environment(name: &str) -> Self {
        RewardFn::new(name, |x| x.environment)
    }

    /// A built-in reward function.
    pub(crate) fn builtin(which: BuiltinReward) -> Self {
        match which {
            BuiltinReward::ExactAnswer => Self::exact_answer(),
            BuiltinReward::AnswerFormat => Self::answer_format(),
        }
    }

    /// Scores one rollout; a panic, NaN or infinity becomes an error message instead of
    /// unwinding or poisoning the group's advantages.
    pub fn score(&self, input: &RewardInput) -> Result<f32, String> {
        match catch_unwind(AssertUnwindSafe(|| (self.f)(input))) {
            Ok(Some(v)) if v.is_nan() => Err("returned NaN".into()),
            // An infinite reward would make its whole group's advantages NaN.
            Ok(Some(v)) if v.is_infinite() => Err(format!("returned {v}")),
            Ok(Some(v)) => Ok(v),
            Ok(None) => Err("returned None".into()),
            Err(panic) => Err(format!("panicked: {}", super::panic_message(panic.as_ref()))),
        }
    }
}

/// The reward functions a config file can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum BuiltinReward {
    /// [`RewardFn::exact_answer`].
    ExactAnswer,
    /// [`RewardFn::answer_format`].
    AnswerFormat,
}

crate::util::serde_via_str!(BuiltinReward);

impl std::fmt::Display for BuiltinReward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use clap::ValueEnum;
        match self.to_possible_value() {
            Some(v) => f.write_str(v.get_name()),
            None => Ok(()),
        }
    }
}

impl std::str::FromStr for BuiltinReward {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        use clap::ValueEnum;
        <Self as ValueEnum>::from_str(s, false).map_err(|_| {
            let names: Vec<String> = Self::value_variants().iter().map(ToString::to_string).collect();
            format!("unknown reward `{s}` (built-ins: {})", names.join(", "))
        })
    }
}

/// Every function's score of every rollout of one group, and their weighted totals.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GroupRewards {
    /// `per_function[f][i]`: function `f`'s score of completion `i` (None: failed).
    pub per_function: Vec<Vec<Option<f32>>>,
    /// Weighted sum per completion; None when any function failed for it.
    pub total: Vec<Option<f32>>,
    /// One entry per failed (function, completion).
    pub failures: Vec<RewardFailure>,
}

impl GroupRewards {
    /// Marks completion `completion` as unscorable: every function's score and the total become
    /// `None` (advantage 0), and one failure under `function` says why (replacing that
    /// function's own entry for it, so each (function, completion) fails once).
    pub(crate) fn fail_completion(&mut self, completion: usize, dataset_row: usize, function: &str, reason: String) {
        self.failures
            .retain(|f| !(f.completion == completion && f.function == function));
        for scores in &mut self.per_function {
            if let Some(s) = scores.get_mut(completion) {
                *s = None;
            }
        }
        if let Some(t) = self.total.get_mut(completion) {
            *t = None;
        }
        self.failures.push(RewardFailure {
            function: function.to_string(),
            dataset_row,
            completion,
            reason,
        });
    }
}

/// Scores the completions of one prompt with every function.
pub(crate) fn score_group(functions: &[RewardFn], dataset_row: usize, inputs: &[RewardInput]) -> GroupRewards {
    let mut per_function = Vec::with_capacity(functions.len());
    let mut failures = Vec::new();
    for f in functions {
        let scores = inputs
            .iter()
            .enumerate()
            .map(|(i, x)| match f.score(x) {
                Ok(v) => Some(v),
                Err(reason) => {
                    failures.push(RewardFailure {
                        function: f.name.clone(),
                        dataset_row,
                        completion: i,
                        reason,
                    });
                    None
                }
            })
            .collect::<Vec<_>>();
        per_function.push(scores);
    }
    let total = (0..inputs.len())
        .map(|i| {
            functions
                .iter()
                .zip(&per_function)
                .try_fold(0f32, |acc, (f, scores)| scores[i].map(|s| acc + f.weight * s))
        })
        .collect();
    GroupRewards {
        per_function,
        total,
        failures,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input<'a>(completion: &'a str, row: &'a Map<String, Value>) -> RewardInput<'a> {
        RewardInput {
            prompt: "",
            completion,
            completion_ids: &[],
            truncated: false,
            row,
            environment: None,
        }
    }

    #[test]
    fn builtins_check_answer_and_format() {
        let row: Map<String, Value> = serde_json::from_str(r#"{"answer": "KALO"}"#).unwrap();
        let exact = RewardFn::exact_answer();
        let format = RewardFn::answer_format();
        assert_eq!(exact.score(&input("Answer: KALO", &row)), Ok(1.0));
        assert_eq!(exact.score(&input("Answer: kalo", &row)), Ok(0.0));
        assert_eq!(format.score(&input("Answer: kalo", &row)), Ok(1.0));
        assert_eq!(format.score(&input("kalo", &row)), Ok(0.0));
        assert_eq!(format.score(&input("Answer: a\nAnswer: b", &row)), Ok(0.0));
        let mut cut = input("Answer: KALO", &row);
        cut.truncated = true;
        assert_eq!(format.score(&cut), Ok(0.0));
        let numeric: Map<String, Value> = serde_json::from_str(r#"{"answer": 7}"#).unwrap();
        assert_eq!(exact.score(&input("Answer: 7.", &numeric)), Ok(1.0));
        let none = Map::new();
        assert!(exact.score(&input("Answer: 7", &none)).is_err());
    }

    #[test]
    fn failures_are_reported_and_void_the_total() {
        let row = Map::new();
        let fns = vec![
            RewardFn::new("len", |x| Some(x.completion.len() as f32)).with_weight(0.5),
            RewardFn::new("picky", |x| match x.completion {
                "nan" => Some(f32::NAN),
                "inf" => Some(f32::NEG_INFINITY),
                "none" => None,
                "panic" => panic!("bad input"),
                _ => Some(1.0),
            }),
        ];
        let texts = ["ok", "nan", "none", "panic", "inf"];
        let inputs: Vec<RewardInput> = texts.iter().map(|t| input(t, &row)).collect();
        // The panic's message is printed by the default hook; scoring goes on.
        let g = score_group(&fns, 3, &inputs);
        assert_eq!(g.total, vec![Some(2.0), None, None, None, None]);
        assert_eq!(
            g.per_function[0],
            vec![Some(2.0), Some(3.0), Some(4.0), Some(5.0), Some(3.0)]
        );
        let reasons: Vec<&str> = g.failures.iter().map(|f| f.reason.as_str()).collect();
        assert_eq!(
            reasons,
            ["returned NaN", "returned None", "panicked: bad input", "returned -inf"]
        );
        assert!(g.failures.iter().all(|f| f.function == "picky" && f.dataset_row == 3));
        assert_eq!(g.failures[2].completion, 3);
    }
}
