use crate::util::SplitMix64;

/// `n` sequence lengths from a seeded log-normal distribution clamped to `[min, max]`: the long
/// right tail real chat and completion lengths show.
///
/// `median` is the distribution's median in tokens; `sigma` its log-space spread (0.5 to 0.8 is
/// typical of conversation datasets).
pub fn synthetic_lengths(n: usize, median: f64, sigma: f64, min: usize, max: usize, seed: u64) -> Vec<usize> {
    let mut rng = SplitMix64::new(seed);
    let mu = median.max(1.0).ln();
    (0..n)
        .map(|_| {
            let x = (mu + sigma * rng.normal()).exp().round();
            (x as usize).clamp(min, max.max(min))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_clamped_and_centred() {
        let a = synthetic_lengths(2000, 300.0, 0.6, 16, 2048, 3);
        assert_eq!(a, synthetic_lengths(2000, 300.0, 0.6, 16, 2048, 3));
        assert!(a.iter().all(|&l| (16..=2048).contains(&l)));
        let mut s = a.clone();
        s.sort_unstable();
        let median = s[s.len() / 2] as f64;
        assert!((median - 300.0).abs() < 30.0, "{median}");
    }
}
