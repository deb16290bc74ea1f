//! The shipped task datasets, written as Parquet in the Hugging Face `datasets` layout
//! (`messages` / `prompt` are lists of `{role, content}` structs).

use std::path::Path;
use std::sync::Arc;

use arrow::array::{ArrayRef, ListArray, RecordBatch, StringArray, StructArray};
use arrow::buffer::OffsetBuffer;
use arrow::datatypes::{DataType, Field, Fields, Schema};
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;

use super::calculator::Calculator;
use super::tasks::{Task, TaskKind, arithmetic_tasks, format_reply, grpo_tasks, sft_reply, tasks_of};
use crate::util::SplitMix64;

/// One chat message.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// Text.
    pub content: String,
}

fn msg(role: &str, content: &str) -> ChatMessage {
    ChatMessage {
        role: role.into(),
        content: content.into(),
    }
}

/// System prompt used by part of the SFT conversations and by every GRPO prompt.
pub(crate) const SYSTEM_PROMPT: &str = "You are a precise assistant. Reply with 'Answer: ' followed by the answer.";

/// SFT conversations of the shipped mix: one or two question/answer turns, a system prompt on
/// about a third; replies from `sft_reply` (the correct item or a random listed one, see
/// [`super::tasks`]).
pub fn sft_conversations(n: usize, seed: u64) -> Vec<(Vec<ChatMessage>, String)> {
    let mut reply_rng = SplitMix64::new(seed ^ 0x5f7_a45);
    conversations(&tasks_of(&TaskKind::SFT, 2 * n, seed), n, seed, |t| {
        sft_reply(t, &mut reply_rng)
    })
}

/// SFT conversations of the calculator task ([`super::calculator`]): each of `n` questions
/// twice, after the system prompt: answered directly (correctly), then through a call to the
/// calculator and its result.
pub(crate) fn calculator_conversations(n: usize, seed: u64) -> Vec<Vec<ChatMessage>> {
    arithmetic_tasks(n, seed)
        .into_iter()
        .flat_map(|t| {
            let ask = vec![msg("system", SYSTEM_PROMPT), msg("user", &t.question)];
            let answer = msg("assistant", &format_reply(&t.answer));
            let direct = [ask.clone(), vec![answer.clone()]].concat();
            let call = msg("assistant", &Calculator::call_text(&t.question));
            let result = msg("tool", &Calculator::respond(Ok(t.question.clone())));
            [direct, [ask, vec![call, result, answer]].concat()]
        })
        .collect()
}

/// `n` conversations over `pool` (two tasks a conversation at most), each assistant turn written
/// by `reply`; the task kinds of each conversation's turns, comma-joined.
fn conversations(
    pool: &[Task],
    n: usize,
    seed: u64,
    mut reply: impl FnMut(&Task) -> String,
) -> Vec<(Vec<ChatMessage>, String)> {
    let mut rng = SplitMix64::new(seed ^ 0x5f7);
    let mut it = pool.iter();
    (0..n)
        .map(|_| {
            let mut m = Vec::new();
            if rng.below(3) == 0 {
                m.push(msg("system", SYSTEM_PROMPT));
            }
            let turns = if rng.below(4) == 0 { 2 } else { 1 };
            let mut kinds = Vec::new();
            for t in it.by_ref().take(turns) {
                m.push(msg("user", &t.question));
                m.push(msg("assistant", &reply(t)));
                kinds.push(t.kind.name());
            }
            (m, kinds.join(","))
        })
        .collect()
}

/// GRPO prompts of the GRPO mix ([`TaskKind::GRPO`]): system + user question, with the exact
/// answer and task kind.
pub fn grpo_prompts(n: usize, seed: u64) -> Vec<(Vec<ChatMessage>, Task)> {
    with_system_prompt(grpo_tasks(n, seed))
}

/// GRPO prompts of the calculator task (its environment adds the tool), as [`grpo_prompts`].
pub(crate) fn calculator_prompts(n: usize, seed: u64) -> Vec<(Vec<ChatMessage>, Task)> {
    with_system_prompt(arithmetic_tasks(n, seed))
}

fn with_system_prompt(tasks: Vec<Task>) -> Vec<(Vec<ChatMessage>, Task)> {
    tasks
        .into_iter()
        .map(|t| (vec![msg("system", SYSTEM_PROMPT), msg("user", &t.question)], t))
        .collect()
}

fn message_struct_fields() -> Fields {
    Fields::from(vec![
        Field::new("role", DataType::Utf8, true),
        Field::new("content", DataType::Utf8, true),
    ])
}

fn messages_array(rows: &[&[ChatMessage]]) -> ArrayRef {
    let flat: Vec<&ChatMessage> = rows.iter().flat_map(|r| r.iter()).collect();
    let roles = StringArray::from_iter_values(flat.iter().map(|m| m.role.as_str()));
    let contents = StringArray::from_iter_values(flat.iter().map(|m| m.content.as_str()));
    let structs = StructArray::new(message_struct_fields(), vec![Arc::new(roles), Arc::new(contents)], None);
    let offsets = OffsetBuffer::from_lengths(rows.iter().map(|r| r.len()));
    let item = Arc::new(Field::new("item", DataType::Struct(message_struct_fields()), true));
    Arc::new(ListArray::new(item, offsets, Arc::new(structs), None))
}

fn write(path: &Path, columns: Vec<(&str, ArrayRef)>) -> Result<(), String> {
    let schema = Arc::new(Schema::new(
        columns
            .iter()
            .map(|(n, a)| Field::new(*n, a.data_type().clone(), true))
            .collect::<Vec<_>>(),
    ));
    let batch = RecordBatch::try_new(schema.clone(), columns.into_iter().map(|(_, a)| a).collect())
        .map_err(|e| e.to_string())?;
    let file = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let props = WriterProperties::builder().set_compression(Compression::SNAPPY).build();
    let mut w = ArrowWriter::try_new(file, schema, Some(props)).map_err(|e| e.to_string())?;
    w.write(&batch).map_err(|e| e.to_string())?;
    w.close().map_err(|e| e.to_string())?;
    Ok(())
}

/// Sizes of the shipped splits: SFT conversations of the selection mix.
pub(crate) const SFT_TRAIN: usize = 2000;
/// Questions of the calculator task in the SFT data (each twice; `sft/train-calculator.parquet`).
pub const SFT_CALCULATOR: usize = 600;
/// Calculator GRPO training prompts.
pub(crate) const CALCULATOR_TRAIN: usize = 500;
/// Calculator GRPO held-out prompts.
pub(crate) const CALCULATOR_TEST: usize = 100;
/// GRPO training prompts.
pub(crate) const GRPO_TRAIN: usize = 500;
/// GRPO held-out prompts.
pub(crate) const GRPO_TEST: usize = 100;
/// SFT conversations, GRPO training and held-out prompts of [`TaskKind::TOKENIZER_CORPUS`] in
/// the tokenizer's corpus: fixed, so resizing a shipped split leaves the tokenizer as it is.
const TOKENIZER_CORPUS_SIZES: [usize; 3] = [2000, 500, 100];

/// Writes `sft/train.parquet` (the selection mix's conversations), `sft/train-calculator.parquet`
/// (the calculator's, with a `tools` column), `grpo/{train,test}.parquet` and
/// `calculator/{train,test}.parquet` under `root`. The SFT recipe reads `sft/`'s train split: both files (their names say `train`).
pub fn write_all(root: &Path) -> Result<(), String> {
    for dir in ["sft", "grpo", "calculator"] {
        std::fs::create_dir_all(root.join(dir)).map_err(|e| e.to_string())?;
    }
    let selection = sft_conversations(SFT_TRAIN, 1);
    let msgs: Vec<&[ChatMessage]> = selection.iter().map(|(m, _)| m.as_slice()).collect();
    let kinds = selection.iter().map(|(_, k)| k.as_str());
    write(
        &root.join("sft/train.parquet"),
        vec![
            ("messages", messages_array(&msgs)),
            ("task", Arc::new(StringArray::from_iter_values(kinds))),
        ],
    )?;
    let calculator = calculator_conversations(SFT_CALCULATOR, 4);
    let msgs: Vec<&[ChatMessage]> = calculator.iter().map(Vec::as_slice).collect();
    let tools = serde_json::json!([Calculator::schema()]).to_string();
    write(
        &root.join("sft/train-calculator.parquet"),
        vec![
            ("messages", messages_array(&msgs)),
            (
                "task",
                Arc::new(StringArray::from_iter_values(msgs.iter().map(|_| "calculator"))),
            ),
            (
                "tools",
                Arc::new(StringArray::from_iter_values(msgs.iter().map(|_| tools.as_str()))),
            ),
        ],
    )?;
    let splits = [
        ("grpo/train", grpo_prompts(GRPO_TRAIN, 2)),
        ("grpo/test", grpo_prompts(GRPO_TEST, 3)),
        ("calculator/train", calculator_prompts(CALCULATOR_TRAIN, 5)),
        ("calculator/test", calculator_prompts(CALCULATOR_TEST, 6)),
    ];
    for (split, rows) in splits {
        write_prompts(&root.join(format!("{split}.parquet")), &rows)?;
    }
    Ok(())
}

/// A GRPO prompt file: `prompt` messages, the exact `answer` and the `task` kind.
fn write_prompts(path: &Path, rows: &[(Vec<ChatMessage>, Task)]) -> Result<(), String> {
    let prompts: Vec<&[ChatMessage]> = rows.iter().map(|(m, _)| m.as_slice()).collect();
    let answers = rows.iter().map(|(_, t)| t.answer.as_str());
    let kinds = rows.iter().map(|(_, t)| t.kind.name());
    write(
        path,
        vec![
            ("prompt", messages_array(&prompts)),
            ("answer", Arc::new(StringArray::from_iter_values(answers))),
            ("task", Arc::new(StringArray::from_iter_values(kinds))),
        ],
    )
}

/// The text the shipped tokenizer is trained on: [`TaskKind::TOKENIZER_CORPUS`] as SFT
/// conversations (correct replies) and GRPO splits of fixed sizes, so the tokenizer does not
/// change when the task mix does.
pub(crate) fn corpus() -> Vec<String> {
    let kinds = &TaskKind::TOKENIZER_CORPUS;
    let [sft_n, train_n, test_n] = TOKENIZER_CORPUS_SIZES;
    let sft = conversations(&tasks_of(kinds, 2 * sft_n, 1), sft_n, 1, |t| format_reply(&t.answer));
    let mut texts: Vec<String> = sft
        .into_iter()
        .flat_map(|(m, _)| m.into_iter().map(|x| x.content))
        .collect();
    for (split_n, seed) in [(train_n, 2), (test_n, 3)] {
        for (m, t) in with_system_prompt(tasks_of(kinds, split_n, seed)) {
            texts.extend(m.into_iter().map(|x| x.content));
            texts.push(format_reply(&t.answer));
        }
    }
    texts
}
