//! A step whose allocation fails is an error, not a crash. Most of a step's ops are tch's
//! panicking forms (an `f_` form for each would double the model code), so a failed allocation
//! inside one unwinds as a panic carrying libtorch's message; the step's caller catches that
//! one kind of panic and returns [`TrainError::OutOfMemory`]. Any other panic is a bug and
//! unwinds on.

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};

use super::TrainError;

/// What libtorch's allocators say when an allocation fails (CPU, CUDA, the caching allocator).
const ALLOCATION_FAILED: [&str; 3] = ["can't allocate memory", "out of memory", "Cannot allocate memory"];

/// Runs step `step` (`f`); a failed allocation inside it is an out-of-memory error naming the
/// settings `lower` that size the step.
pub(crate) fn guard<T>(
    step: u64,
    lower: &'static str,
    f: impl FnOnce() -> Result<T, TrainError>,
) -> Result<T, TrainError> {
    // Unwind safety: on this path the step is abandoned and its caller drops the gradients;
    // the weights change only in the update, after every allocation that grows with the batch.
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(payload) => {
            let text =
                (payload.downcast_ref::<String>().map(String::as_str)).or(payload.downcast_ref::<&str>().copied());
            match text.and_then(allocation_failure) {
                Some(detail) => Err(TrainError::OutOfMemory { step, detail, lower }),
                None => resume_unwind(payload),
            }
        }
    }
}

/// libtorch's sentence about a failed allocation, when a panic's message `text` carries one
/// (the CLI's panic hook prints that line instead of libtorch's C++ frames).
pub fn allocation_failure(text: &str) -> Option<String> {
    let at = ALLOCATION_FAILED.iter().filter_map(|k| text.find(k)).min()?;
    // From the allocator's sentence to the end of its line ("you tried to allocate N bytes").
    let start = text[..at].rfind(". ").map_or(0, |i| i + 2);
    // The panic shows libtorch's message in Debug form: its line breaks are written `\n`.
    let line = text[start..].lines().next().unwrap_or_default();
    let line = line.split("\\n").next().unwrap_or_default();
    Some(line.strip_suffix("\")").unwrap_or(line).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_allocation_failures_become_errors() {
        let torch = "called `Result::unwrap()` on an `Err` value: Torch(\"[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 55941120 bytes. Error code 12 (Cannot allocate memory)\\nframe #0: c10\")";
        let err = guard(3, "batch_size", || -> Result<(), TrainError> {
            panic!("{}", torch.replace("\\n", "\n"))
        })
        .unwrap_err()
        .to_string();
        assert!(
            err.starts_with("step 3: out of memory (DefaultCPUAllocator: can't allocate memory: you tried to allocate 55941120 bytes. Error code 12 (Cannot allocate memory)); lower batch_size"),
            "{err}"
        );
        assert!(!err.contains("frame #0"), "{err}");
        let other =
            std::panic::catch_unwind(|| guard(0, "x", || -> Result<(), TrainError> { panic!("index out of bounds") }));
        assert!(other.is_err(), "a bug's panic must unwind on");
        assert_eq!(guard(0, "x", || Ok(7)).unwrap(), 7);
    }
}
