//! Group-relative advantages.

/// How a group's centred rewards are scaled into advantages (TRL's `scale_rewards`). Read as
/// TRL reads it: `"group"`, `"batch"` or `"none"`, or a boolean (`true` = `"group"`, `false` =
/// `"none"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum ScaleRewards {
    /// `(r - mean) / (std + 1e-4)` (GRPO; TRL's default `"group"`).
    #[default]
    Group,
    /// `(r - group mean) / (std of the whole step's rewards + 1e-4)` (TRL's `"batch"`: one
    /// scale for the step, so groups with a small spread are not blown up). Centred here, scaled
    /// once the step's batch is complete (`super::RolloutBatch::scale_advantages`).
    Batch,
    /// `r - mean` (Dr. GRPO: no division by the group's spread).
    None,
}

impl<'de> serde::Deserialize<'de> for ScaleRewards {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ScaleRewardsVisitor)
    }
}

/// Reads [`ScaleRewards`] from a name or TRL's booleans.
struct ScaleRewardsVisitor;

impl serde::de::Visitor<'_> for ScaleRewardsVisitor {
    type Value = ScaleRewards;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(r#""group", "batch" or "none" (or true = "group", false = "none", as TRL takes them)"#)
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<ScaleRewards, E> {
        Ok(if v { ScaleRewards::Group } else { ScaleRewards::None })
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ScaleRewards, E> {
        match v {
            "group" => Ok(ScaleRewards::Group),
            "batch" => Ok(ScaleRewards::Batch),
            "none" => Ok(ScaleRewards::None),
            other => Err(E::invalid_value(serde::de::Unexpected::Str(other), &self)),
        }
    }
}

/// How several reward functions become one advantage (TRL's `multi_objective_aggregation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum MultiObjective {
    /// The weighted sum of the functions' rewards, normalised as `scale_rewards` says.
    #[default]
    SumThenNormalize,
    /// GDPO: each function's rewards normalised within the group (`(r - mean) / (std + 1e-4)`),
    /// summed under the weights, then normalised over the whole step's batch; `scale_rewards`
    /// does not apply.
    NormalizeThenSum,
}

/// GDPO's first stage for one group: each function's scores `per_function[f][i]` normalised
/// over the group's scored completions, then summed under `weights`; `None` where any function
/// failed (a failed completion gets advantage 0 in either aggregation).
pub(crate) fn decoupled_group_rewards(per_function: &[Vec<Option<f32>>], weights: &[f32]) -> Vec<Option<f32>> {
    let n = per_function.first().map_or(0, Vec::len);
    let mut total = vec![Some(0.0f64); n];
    for (scores, &w) in per_function.iter().zip(weights) {
        let scored: Vec<f64> = scores.iter().flatten().map(|&r| f64::from(r)).collect();
        let (mean, std) = mean_std(&scored);
        for (t, s) in total.iter_mut().zip(scores) {
            *t = match (*t, s) {
                (Some(t), Some(s)) => Some(t + f64::from(w) * (f64::from(*s) - mean) / (std + 1e-4)),
                _ => None,
            };
        }
    }
    total.into_iter().map(|t| t.map(|t| t as f32)).collect()
}

/// One advantage per rollout of a group from its total rewards (`None`: scoring failed).
///
/// Mean and standard deviation (Bessel-corrected, as `torch.std`) are taken over the rollouts
/// that were scored; a failed rollout gets advantage 0, so it adds no gradient. A group whose
/// scored rewards are all equal gets 0 everywhere.
pub(crate) fn group_advantages(rewards: &[Option<f32>], scale: ScaleRewards) -> Vec<f32> {
    let scored: Vec<f64> = rewards.iter().flatten().map(|&r| f64::from(r)).collect();
    if scored.is_empty() {
        return vec![0.0; rewards.len()];
    }
    let (mean, std) = mean_std(&scored);
    rewards
        .iter()
        .map(|r| match r {
            None => 0.0,
            Some(r) => {
                let centred = f64::from(*r) - mean;
                (match scale {
                    ScaleRewards::Group => centred / (std + 1e-4),
                    ScaleRewards::Batch | ScaleRewards::None => centred,
                }) as f32
            }
        })
        .collect()
}

/// Mean and Bessel-corrected standard deviation (`torch.std`; 0 for fewer than two values).
pub(crate) fn mean_std(v: &[f64]) -> (f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0);
    }
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let std = if v.len() > 1 {
        (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
    } else {
        0.0
    };
    (mean, std)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalised_like_torch() {
        // torch.tensor([1., 0., 0., 1., 1.]): mean 0.6, std (unbiased) 0.5477226; TRL 1.16
        // divides by std + 1e-4.
        let a = group_advantages(
            &[Some(1.0), Some(0.0), Some(0.0), Some(1.0), Some(1.0)],
            ScaleRewards::Group,
        );
        let s = 0.547_722_6 + 1e-4;
        let want = [0.4 / s, -0.6 / s, -0.6 / s, 0.4 / s, 0.4 / s];
        for (x, w) in a.iter().zip(want) {
            assert!((x - w).abs() < 1e-5, "{a:?}");
        }
        let b = group_advantages(&[Some(2.0), Some(0.0)], ScaleRewards::None);
        assert_eq!(b, vec![1.0, -1.0]);
    }

    /// GDPO's group stage: each function normalised over the group (torch's unbiased std,
    /// + 1e-4), then the weighted sum; a completion any function failed on is `None`.
    #[test]
    fn decoupled_rewards_normalise_each_function_then_sum() {
        let f1 = [1.0f64, 0.0, 1.0, 1.0]; // mean 0.75, std 0.5
        let f2 = [0.5f64, 0.5, 0.0, 1.0]; // mean 0.5, std sqrt(1/6)
        let scores = |f: [f64; 4]| f.iter().map(|&x| Some(x as f32)).collect::<Vec<_>>();
        let per_function = vec![scores(f1), scores(f2)];
        let got = decoupled_group_rewards(&per_function, &[1.0, 0.5]);
        let s2 = (1.0f64 / 6.0).sqrt() + 1e-4;
        for i in 0..4 {
            let want = (f1[i] - 0.75) / (0.5 + 1e-4) + 0.5 * (f2[i] - 0.5) / s2;
            assert!((f64::from(got[i].unwrap()) - want).abs() < 1e-5, "{i}: {got:?}");
        }
        let mut failed = per_function.clone();
        failed[1][2] = None;
        let got = decoupled_group_rewards(&failed, &[1.0, 0.5]);
        assert_eq!(got[2], None);
        // f2 over its three scored completions [0.5, 0.5, 1.0]: mean 2/3, std sqrt(1/12).
        let want = (1.0 - 0.75) / (0.5 + 1e-4) + 0.5 * (1.0 - 2.0 / 3.0) / ((1.0f64 / 12.0).sqrt() + 1e-4);
        assert!((f64::from(got[3].unwrap()) - want).abs() < 1e-5);
    }

    #[test]
    fn failures_get_zero_and_are_left_out_of_the_statistics() {
        let a = group_advantages(&[Some(1.0), None, Some(0.0)], ScaleRewards::Group);
        // over [1, 0]: mean 0.5, std 0.7071
        let half_sqrt2 = 0.5 / (std::f32::consts::FRAC_1_SQRT_2 + 1e-4);
        assert!((a[0] - half_sqrt2).abs() < 1e-5 && a[1] == 0.0 && (a[2] + half_sqrt2).abs() < 1e-5);
        assert_eq!(group_advantages(&[Some(3.0); 4], ScaleRewards::Group), vec![0.0; 4]);
        assert_eq!(group_advantages(&[None, None], ScaleRewards::Group), vec![0.0; 2]);
    }

    /// `scale_rewards` as TRL spells it: its names, and the booleans it maps to "group" and
    /// "none"; anything else is refused saying what is accepted.
    #[test]
    fn scale_rewards_reads_trls_names_and_booleans() {
        #[derive(serde::Deserialize)]
        struct Setting {
            scale_rewards: ScaleRewards,
        }
        let read = |v: &str| toml::from_str::<Setting>(&format!("scale_rewards = {v}")).map(|s| s.scale_rewards);
        assert_eq!(read("true").unwrap(), ScaleRewards::Group);
        assert_eq!(read("false").unwrap(), ScaleRewards::None);
        assert_eq!(read(r#""group""#).unwrap(), ScaleRewards::Group);
        assert_eq!(read(r#""batch""#).unwrap(), ScaleRewards::Batch);
        assert_eq!(read(r#""none""#).unwrap(), ScaleRewards::None);
        for bad in [r#""Group""#, "1"] {
            let err = read(bad).unwrap_err().to_string();
            assert!(
                err.contains(r#""group", "batch" or "none" (or true = "group""#),
                "{bad}: {err}"
            );
        }
    }
}
