//! Reading the answer out of a completion, as the built-in rewards do.

/// The answer a completion gives: the text after the last `Answer:` (else the whole
/// completion), trimmed, without a final period.
pub fn extract_answer(completion: &str) -> &str {
    let tail = completion.rsplit_once("Answer:").map_or(completion, |(_, t)| t);
    tail.trim().trim_end_matches('.').trim()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extracts_the_answer() {
        assert_eq!(extract_answer("Answer: 42."), "42");
        assert_eq!(extract_answer("hmm Answer: x Answer:  KALO "), "KALO");
        assert_eq!(extract_answer(" 7 "), "7");
    }
}
