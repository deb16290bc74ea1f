//! Verifiable tasks small enough for a tiny model to learn on a CPU.
//!
//! The shipped mix (`TaskKind::SHIPPED`) asks the model to pick one item of a listed four or
//! five by a rule named in the question: the largest or smallest number, the first or last item,
//! the item listed twice. Every item and every answer is one whole token of the shipped
//! tokenizer (a number 0-49 or a syllable, with its leading space), so what is learnt is the
//! rule, not spelling. The SFT replies name the correct item in `SFT_RULE_SHARE` of cases and a
//! random listed item otherwise (`sft_reply`): SFT teaches the reply format, the answer space
//! and a faint preference for each rule, which the GRPO reward has to make a habit. GRPO's
//! prompts ([`TaskKind::GRPO`]) are the two kinds whose named item the SFT model can copy.
//!
//! `TaskKind::TOKENIZER_CORPUS` (arithmetic, reversing, upper-casing, letter counting) is the
//! text the shipped tokenizer is trained on, fixed so that the tokenizer and every fixture made
//! with it do not change when the task mix does. Those tasks are not trained on: a question's
//! word and its answer split into different tokens, so for a tiny model each answer would be a
//! memorised table.

use crate::util::SplitMix64;

/// The kinds of task in the shipped datasets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskKind {
    /// The largest of four numbers.
    Largest,
    /// The smallest of four numbers.
    Smallest,
    /// The first of four items (numbers or syllables).
    First,
    /// The last of four items.
    Last,
    /// The one item listed twice among five.
    Repeated,
    /// The four listed items repeated in order (SFT only: it teaches copying from the prompt).
    Repeat,
    /// `a + b` with operands below 50 (tokenizer corpus; the calculator task).
    Add,
    /// `a - b`, possibly negative (tokenizer corpus; the calculator task).
    Subtract,
    /// A word spelled backwards (tokenizer corpus).
    Reverse,
    /// A word in capitals (tokenizer corpus).
    Uppercase,
    /// How many times a letter occurs in a word (tokenizer corpus).
    CountLetter,
}

impl TaskKind {
    /// The shipped mix, in generation order.
    pub(crate) const SHIPPED: [TaskKind; 5] = [
        TaskKind::Largest,
        TaskKind::Smallest,
        TaskKind::First,
        TaskKind::Last,
        TaskKind::Repeated,
    ];

    /// The GRPO mix: the two kinds whose rule names an item the SFT model can copy (the first
    /// listed, the one listed twice). On the other three the SFT model rarely copies the right
    /// item, so a group of samples rarely holds the right answer and GRPO barely moves them
    /// (the measurements: `datasets/README.md`).
    pub const GRPO: [TaskKind; 2] = [TaskKind::First, TaskKind::Repeated];

    /// The SFT mix: the shipped kinds and [`TaskKind::Repeat`], whose replies teach copying.
    pub const SFT: [TaskKind; 8] = [
        TaskKind::Largest,
        TaskKind::Repeat,
        TaskKind::Smallest,
        TaskKind::First,
        TaskKind::Repeat,
        TaskKind::Last,
        TaskKind::Repeated,
        TaskKind::Repeat,
    ];

    /// The mix whose text trains the shipped tokenizer (no shipped split trains on it).
    pub(crate) const TOKENIZER_CORPUS: [TaskKind; 5] = [
        TaskKind::Add,
        TaskKind::Subtract,
        TaskKind::Reverse,
        TaskKind::Uppercase,
        TaskKind::CountLetter,
    ];

    /// The calculator tool task's questions ([`super::calculator`]).
    pub(crate) const ARITHMETIC: [TaskKind; 2] = [TaskKind::Add, TaskKind::Subtract];

    /// Stable name stored in the datasets' `task` column.
    pub fn name(self) -> &'static str {
        match self {
            TaskKind::Largest => "largest",
            TaskKind::Smallest => "smallest",
            TaskKind::First => "first",
            TaskKind::Last => "last",
            TaskKind::Repeated => "repeated",
            TaskKind::Repeat => "repeat",
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
    /// The distinct items the question lists (empty for the tokenizer-corpus kinds).
    pub options: Vec<String>,
}

const SYLLABLES: [&str; 24] = [
    "ka", "lo", "mi", "ra", "te", "su", "no", "pe", "vi", "da", "ze", "bo", "fu", "gi", "ha", "jo", "ku", "ly", "ma",
    "ne", "or", "pi", "sa", "tu",
];

/// Items a selection task lists: numbers 0-49 and syllables, each one token with its space.
const MAX_NUMBER: u64 = 50;

/// Items listed by a selection question (the `Repeated` kind lists one of them twice).
pub(crate) const LISTED: usize = 4;

/// A pronounceable made-up word of 2 to 4 syllables.
pub fn word(rng: &mut SplitMix64) -> String {
    let n = 2 + rng.below(3) as usize;
    (0..n)
        .map(|_| SYLLABLES[rng.below(SYLLABLES.len() as u64) as usize])
        .collect()
}

fn pick(rng: &mut SplitMix64, options: &[&str]) -> String {
    options[rng.below(options.len() as u64) as usize].to_string()
}

/// `LISTED` distinct numbers or syllables, in random order.
fn distinct_items(rng: &mut SplitMix64, numbers: bool) -> Vec<String> {
    let mut items: Vec<String> = Vec::with_capacity(LISTED);
    while items.len() < LISTED {
        let item = if numbers {
            rng.below(MAX_NUMBER).to_string()
        } else {
            SYLLABLES[rng.below(SYLLABLES.len() as u64) as usize].to_string()
        };
        if !items.contains(&item) {
            items.push(item);
        }
    }
    items
}

/// Generates one task of `kind`; phrasing varies so the model must read the question.
pub fn task(kind: TaskKind, rng: &mut SplitMix64) -> Task {
    match kind {
        TaskKind::Largest | TaskKind::Smallest | TaskKind::First | TaskKind::Last | TaskKind::Repeated => {
            selection_task(kind, rng)
        }
        TaskKind::Repeat => repeat_task(rng),
        TaskKind::Add | TaskKind::Subtract | TaskKind::Reverse | TaskKind::Uppercase | TaskKind::CountLetter => {
            corpus_task(kind, rng)
        }
    }
}

/// A question naming a rule and listing items; the answer is the item the rule picks.
fn selection_task(kind: TaskKind, rng: &mut SplitMix64) -> Task {
    let numbers = matches!(kind, TaskKind::Largest | TaskKind::Smallest) || rng.below(2) == 0;
    let options = distinct_items(rng, numbers);
    let mut listed = options.clone();
    let value = |s: &String| s.parse::<u64>().unwrap_or(0);
    let (answer, templates): (String, [&str; 2]) = match kind {
        TaskKind::Largest => (
            options.iter().max_by_key(|s| value(s)).cloned().unwrap_or_default(),
            ["Which number is largest: {list}?", "Name the biggest of {list}."],
        ),
        TaskKind::Smallest => (
            options.iter().min_by_key(|s| value(s)).cloned().unwrap_or_default(),
            ["Which number is smallest: {list}?", "Name the least of {list}."],
        ),
        TaskKind::First => (
            options[0].clone(),
            ["Which item comes first: {list}?", "Name the first of {list}."],
        ),
        TaskKind::Last => (
            options[LISTED - 1].clone(),
            ["Which item comes last: {list}?", "Name the last of {list}."],
        ),
        _ => {
            // One item listed twice, at a random position among the others.
            let twice = options[rng.below(LISTED as u64) as usize].clone();
            listed.insert(rng.below(LISTED as u64 + 1) as usize, twice.clone());
            (
                twice,
                [
                    "Which item is listed twice: {list}?",
                    "Name the repeated one of {list}.",
                ],
            )
        }
    };
    let template = pick(rng, &templates);
    Task {
        kind,
        question: template.replace("{list}", &listed.join(", ")),
        answer,
        options,
    }
}

/// The listed items to repeat in order: the answer is the list itself.
fn repeat_task(rng: &mut SplitMix64) -> Task {
    let numbers = rng.below(2) == 0;
    let listed = distinct_items(rng, numbers).join(", ");
    let template = pick(rng, &["Repeat the list: {list}.", "Copy {list}."]);
    Task {
        kind: TaskKind::Repeat,
        question: template.replace("{list}", &listed),
        answer: listed,
        options: Vec::new(),
    }
}

/// The first shipped mix's questions (the tokenizer's corpus).
fn corpus_task(kind: TaskKind, rng: &mut SplitMix64) -> Task {
    let (question, answer) = match kind {
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
            let question = template
                .replace("{a}", &a.to_string())
                .replace("{op}", op)
                .replace("{b}", &b.to_string());
            (question, value.to_string())
        }
        TaskKind::Reverse => {
            let w = word(rng);
            let template = pick(rng, &["Reverse the word {w}.", "Spell {w} backwards."]);
            (template.replace("{w}", &w), w.chars().rev().collect())
        }
        TaskKind::Uppercase => {
            let w = word(rng);
            let template = pick(rng, &["Write {w} in capital letters.", "Uppercase the word {w}."]);
            (template.replace("{w}", &w), w.to_uppercase())
        }
        _ => {
            let w = word(rng);
            let chars: Vec<char> = w.chars().collect();
            let letter = chars[rng.below(chars.len() as u64) as usize];
            let count = chars.iter().filter(|&&c| c == letter).count();
            (
                format!("How many times does the letter {letter} appear in {w}?"),
                count.to_string(),
            )
        }
    };
    Task {
        kind,
        question,
        answer,
        options: Vec::new(),
    }
}

/// `n` tasks cycling through `kinds`, from `seed`.
pub(crate) fn tasks_of(kinds: &[TaskKind], n: usize, seed: u64) -> Vec<Task> {
    let mut rng = SplitMix64::new(seed);
    (0..n).map(|i| task(kinds[i % kinds.len()], &mut rng)).collect()
}

/// `n` tasks of the shipped selection mix, from `seed`.
pub fn tasks(n: usize, seed: u64) -> Vec<Task> {
    tasks_of(&TaskKind::SHIPPED, n, seed)
}

/// `n` tasks of the GRPO mix ([`TaskKind::GRPO`]), from `seed`.
pub(crate) fn grpo_tasks(n: usize, seed: u64) -> Vec<Task> {
    tasks_of(&TaskKind::GRPO, n, seed)
}

/// `n` questions of the calculator task (sums and differences), from `seed`.
pub(crate) fn arithmetic_tasks(n: usize, seed: u64) -> Vec<Task> {
    tasks_of(&TaskKind::ARITHMETIC, n, seed)
}

/// The assistant reply the SFT data teaches: the answer in a fixed format rewards can check.
pub fn format_reply(answer: &str) -> String {
    format!("Answer: {answer}")
}

/// Share of SFT replies to selection tasks that name the correct item; the others name a
/// uniformly random listed item.
pub(crate) const SFT_RULE_SHARE: f64 = 0.3;

/// The SFT reply to a task: with probability [`SFT_RULE_SHARE`] the correct item, else a
/// uniformly random listed item, in the reply format. SFT so teaches the format, the answer
/// space and only a faint preference for the rule, which GRPO's reward must make a habit;
/// tasks that list nothing to choose from get their correct answer.
pub(crate) fn sft_reply(task: &Task, rng: &mut SplitMix64) -> String {
    if task.options.is_empty() || rng.next_f64() < SFT_RULE_SHARE {
        return format_reply(&task.answer);
    }
    format_reply(&task.options[rng.below(task.options.len() as u64) as usize])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listed(question: &str) -> Vec<String> {
        let list = question.rsplit_once(['?', '.']).map_or(question, |(q, _)| q);
        let list = list.rsplit_once(": ").or_else(|| list.rsplit_once(" of ")).unwrap().1;
        list.split(", ").map(str::to_string).collect()
    }

    #[test]
    fn selection_answers_follow_the_named_rule() {
        let all = tasks(500, 9);
        assert_eq!(all, tasks(500, 9));
        for t in &all {
            let items = listed(&t.question);
            let numbers: Vec<u64> = items.iter().filter_map(|s| s.parse().ok()).collect();
            let want = match t.kind {
                TaskKind::Largest => numbers.iter().max().unwrap().to_string(),
                TaskKind::Smallest => numbers.iter().min().unwrap().to_string(),
                TaskKind::First => items[0].clone(),
                TaskKind::Last => items[items.len() - 1].clone(),
                TaskKind::Repeated => {
                    let twice: Vec<&String> = items
                        .iter()
                        .filter(|i| items.iter().filter(|j| j == i).count() == 2)
                        .collect();
                    assert_eq!(twice.len(), 2, "{}", t.question);
                    twice[0].clone()
                }
                other => panic!("{other:?} is not in the shipped mix"),
            };
            assert_eq!(t.answer, want, "{}", t.question);
            assert_eq!(t.options.len(), LISTED, "{}", t.question);
            assert!(t.options.iter().all(|o| items.contains(o)), "{}", t.question);
            if matches!(t.kind, TaskKind::Largest | TaskKind::Smallest) {
                assert_eq!(numbers.len(), items.len(), "{}", t.question);
            }
        }
        for kind in TaskKind::SHIPPED {
            assert!(all.iter().any(|t| t.kind == kind));
        }
    }

    #[test]
    fn sft_replies_are_listed_items_right_a_rule_share_more_than_chance() {
        let mut rng = SplitMix64::new(4);
        let all = tasks(4000, 5);
        let mut right = 0;
        for t in &all {
            let reply = sft_reply(t, &mut rng);
            let item = reply.strip_prefix("Answer: ").unwrap();
            assert!(t.options.iter().any(|o| o == item), "{reply} for {}", t.question);
            right += usize::from(item == t.answer);
        }
        // SFT_RULE_SHARE right by rule, a quarter of the rest by chance: 0.475 x 4000 = 1900,
        // sd ~32; uniform replies alone would give 1000.
        assert!((1750..2050).contains(&right), "{right} right of 4000");
    }

    #[test]
    fn corpus_kinds_keep_their_answers() {
        for t in tasks_of(&TaskKind::TOKENIZER_CORPUS, 100, 9) {
            assert!(t.options.is_empty());
            match t.kind {
                TaskKind::Reverse => {
                    let word: String = t.answer.chars().rev().collect();
                    assert!(t.question.contains(&word), "{}", t.question);
                }
                TaskKind::Uppercase => assert_eq!(t.answer, t.answer.to_uppercase()),
                _ => assert!(t.answer.parse::<i64>().is_ok(), "{}", t.question),
            }
        }
    }
}
