//! What a generation call returns: one [`Completion`] per row, with why it ended.

/// Why a completion ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An EOS token.
    Eos,
    /// A stop sequence.
    Stop,
    /// `max_new_tokens` reached.
    Length,
}

impl FinishReason {
    /// `eos`, `stop` or `length`.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Eos => "eos",
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// One generated completion.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Completion {
    /// Which prompt it continues.
    pub prompt_index: usize,
    /// Generated ids (EOS / stop sequence included).
    pub output_ids: Vec<i64>,
    /// Log-prob of each generated token under the sampling distribution used.
    pub logprobs: Vec<f32>,
    /// Log-prob of each generated token under `softmax(logits / temperature)`, untruncated.
    pub untruncated_logprobs: Vec<f32>,
    /// Why it ended.
    pub finish_reason: FinishReason,
}
