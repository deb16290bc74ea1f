/// Errors from packing.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PackError {
    /// A rollout's fields are inconsistent.
    #[error("rollout {row}: field `{field}` {message}")]
    InvalidRollout {
        /// Index of the rollout in its input.
        row: usize,
        /// The offending field.
        field: &'static str,
        /// What is wrong.
        message: String,
    },
    /// A rollout cannot fit even an empty row.
    #[error("rollout {row}: {tokens} tokens ({trained} trained) exceed the row budget of {budget}")]
    OverBudget {
        /// Index of the rollout.
        row: usize,
        /// Its tokens.
        tokens: usize,
        /// Its trained tokens.
        trained: usize,
        /// The budget.
        budget: usize,
    },
    /// A budget or rank count of zero.
    #[error("{0} must be at least 1")]
    Zero(&'static str),
}
