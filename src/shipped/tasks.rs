//! Verifiable tasks small enough for a tiny model to learn on a CPU in minutes: arithmetic and
//! string manipulation with exactly one correct answer.

use crate::util::SplitMix64;

/// The kinds of task in the shipped datasets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskKind {
    /// `a + b` with small operands.
    Add,
    /// `a - b`, possibly negative.
    Subtract,
    /// A word spelled backwards.
    Reverse,
    /// A word in capitals.
    Uppercase,
    /// How many times a letter occurs in a word.
    CountLetter,
}

impl TaskKind {
    /// All kinds, in generation order.
    pub const ALL: [TaskKind; 5] = [
        TaskKind::Add,
        TaskKind::Subtract,
        TaskKind::Reverse,
        TaskKind::Uppercase,
        TaskKind::CountLetter,
    ];

    /// Stable name stored in the datasets' `task` column.
    pub fn name(self) -> &'static str {
        match self {
            TaskKind::Add => "add",
            TaskKind::Subtract => "subtract",
            TaskKind::Reverse => "reverse",
            TaskKind::Uppercase => "uppercase",
            TaskKind::CountLetter => "count_letter",
        }
    }
}

/// One generated task.
#[derive(Debug, Clone, PartialEq)]
pub struct Task {
    /// What kind.
    pub kind: TaskKind,
    /// The user's question.
    pub question: String,
    /// The one correct answer.
    pub answer: String,
}

const SYLLABLES: [&str; 24] = [
    "ka", "lo", "mi", "ra", "te", "su", "no", "pe", "vi", "da", "ze", "bo", "fu", "gi", "ha", "jo", "ku", "ly", "ma",
    "ne", "or", "pi", "sa", "tu",
];

/// A pronounceable made-up word of 2 to 4 syllables.
pub fn word(rng: &mut SplitMix64) -> String {
    let n = 2 + rng.below(3) as usize;
    (0..n)
        .map(|_| SYLLABLES[rng.below(SYLLABLES.len() as u64) as usize])
        .collect()
}

/// Generates one task of `kind`; phrasing varies so the model must read the question.
pub fn task(kind: TaskKind, rng: &mut SplitMix64) -> Task {
    let pick = |rng: &mut SplitMix64, options: &[&str]| options[rng.below(options.len() as u64) as usize].to_string();
    match kind {
        TaskKind::Add | TaskKind::Subtract => {
            let a = rng.below(50) as i64;
            let b = rng.below(50) as i64;
            let (op, value) = if kind == TaskKind::Add {
                ("+", a + b)
            } else {
                ("-", a - b)
            };
            let template = pick(
                rng,
                &["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} = ?"],
            );
            Task {
                kind,
                question: template
                    .replace("{a}", &a.to_string())
                    .replace("{op}", op)
                    .replace("{b}", &b.to_string()),
                answer: value.to_string(),
            }
        }
        TaskKind::Reverse => {
            let w = word(rng);
            let template = pick(rng, &["Reverse the word {w}.", "Spell {w} backwards."]);
            Task {
                kind,
                question: template.replace("{w}", &w),
                answer: w.chars().rev().collect(),
            }
        }
        TaskKind::Uppercase => {
            let w = word(rng);
            let template = pick(rng, &["Write {w} in capital letters.", "Uppercase the word {w}."]);
            Task {
                kind,
                question: template.replace("{w}", &w),
                answer: w.to_uppercase(),
            }
        }
        TaskKind::CountLetter => {
            let w = word(rng);
            let chars: Vec<char> = w.chars().collect();
            let letter = chars[rng.below(chars.len() as u64) as usize];
            let count = chars.iter().filter(|&&c| c == letter).count();
            Task {
                kind,
                question: format!("How many times does the letter {letter} appear in {w}?"),
                answer: count.to_string(),
            }
        }
    }
}

/// `n` tasks cycling through every kind, from `seed`.
pub fn tasks(n: usize, seed: u64) -> Vec<Task> {
    let mut rng = SplitMix64::new(seed);
    (0..n)
        .map(|i| task(TaskKind::ALL[i % TaskKind::ALL.len()], &mut rng))
        .collect()
}

/// The assistant reply the SFT data teaches: the answer in a fixed format rewards can check.
pub fn format_reply(answer: &str) -> String {
    format!("Answer: {answer}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_correct_and_deterministic() {
        let a = tasks(200, 9);
        assert_eq!(a, tasks(200, 9));
        for t in &a {
            match t.kind {
                TaskKind::Add | TaskKind::Subtract => {
                    let nums: Vec<i64> = t
                        .question
                        .split(|c: char| !c.is_ascii_digit())
                        .filter(|s| !s.is_empty())
                        .map(|s| s.parse().unwrap())
                        .collect();
                    let want = if t.kind == TaskKind::Add {
                        nums[0] + nums[1]
                    } else {
                        nums[0] - nums[1]
                    };
                    assert_eq!(t.answer, want.to_string(), "{}", t.question);
                }
                TaskKind::Reverse => {
                    let word: String = t.answer.chars().rev().collect();
                    assert!(t.question.contains(&word), "{}", t.question);
                }
                TaskKind::Uppercase => assert_eq!(t.answer, t.answer.to_uppercase()),
                TaskKind::CountLetter => assert!(t.answer.parse::<usize>().unwrap() >= 1),
            }
        }
    }
}
