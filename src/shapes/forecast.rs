use crate::device::round_up;
use crate::device::{PadTo, Platform};
use crate::display::{self, LineChart, Rich, escape};

use super::ledger::ShapeLedger;

/// Errors from shape forecasting.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ShapeError {
    /// A batch size of zero was given.
    #[error("batch_size must be at least 1")]
    ZeroBatchSize,
    /// The compile price is negative or not finite.
    #[error("seconds_per_compile must be a finite number >= 0, got {0}")]
    BadCompileSeconds(f64),
    /// A length so large that counting its tokens overflows (no real sequence is that long).
    #[error("length {length} (sequence {index}, 0-based) is too large to count: at most {max}", max = MAX_LENGTH)]
    TooLong {
        /// The length.
        length: usize,
        /// Its position in the input.
        index: usize,
    },
}

/// The longest sequence a forecast accepts (2^40 tokens: far past any model's context, and
/// small enough that token counts of any dataset fit in 64 bits).
pub(crate) const MAX_LENGTH: usize = 1 << 40;

/// The shapes one pass over a dataset feeds a graph when batches are padded to their longest
/// row (then up to a multiple, when one is set).
#[derive(Debug, Clone, PartialEq)]
pub struct ShapeForecast {
    /// What this forecast describes (`longest row only`, `pad to 128`).
    pub label: String,
    /// The multiple rows are padded to, if any.
    pub multiple: Option<usize>,
    /// The `forward` graph's shapes `[batch, seq]` batch by batch.
    pub ledger: ShapeLedger,
    /// Batches in the pass.
    pub batches: usize,
    /// Tokens of real data.
    pub real_tokens: u64,
    /// Tokens forwarded including padding.
    pub padded_tokens: u64,
}

impl ShapeForecast {
    /// Forecasts consecutive batches of `batch_size` rows over `lengths` (dataset order; the last
    /// batch may be smaller and is its own shape, as in a real dataloader).
    pub fn new(
        lengths: &[usize],
        batch_size: usize,
        multiple: Option<usize>,
        seconds_per_compile: f64,
    ) -> Result<Self, ShapeError> {
        if batch_size == 0 {
            return Err(ShapeError::ZeroBatchSize);
        }
        if !seconds_per_compile.is_finite() || seconds_per_compile < 0.0 {
            return Err(ShapeError::BadCompileSeconds(seconds_per_compile));
        }
        if let Some((index, &length)) = lengths.iter().enumerate().find(|(_, l)| **l > MAX_LENGTH) {
            return Err(ShapeError::TooLong { length, index });
        }
        let mut ledger = ShapeLedger::new(seconds_per_compile);
        let (mut real, mut padded) = (0u64, 0u64);
        for batch in lengths.chunks(batch_size) {
            let longest = round_up(batch.iter().copied().max().unwrap_or(0), multiple);
            ledger.record("forward", &[batch.len() as i64, longest as i64]);
            real += batch.iter().map(|&l| l as u64).sum::<u64>();
            padded += (batch.len() * longest) as u64;
        }
        let label = match multiple {
            Some(m) if m > 1 => format!("pad to {m}"),
            _ => "longest row only".to_string(),
        };
        Ok(ShapeForecast {
            label,
            multiple,
            ledger,
            batches: lengths.len().div_ceil(batch_size),
            real_tokens: real,
            padded_tokens: padded,
        })
    }

    /// Distinct shapes = Neuron compiles.
    pub fn compiles(&self) -> usize {
        self.ledger.total_distinct()
    }

    /// Share of forwarded tokens that are padding.
    pub fn padding_fraction(&self) -> f64 {
        if self.padded_tokens == 0 {
            0.0
        } else {
            1.0 - self.real_tokens as f64 / self.padded_tokens as f64
        }
    }
}

/// "How many recompiles would this length distribution cause with and without padding?"
#[derive(Debug, Clone, PartialEq)]
pub struct PaddingComparison {
    /// The platform the policy was resolved for.
    pub platform: Platform,
    /// The policy compared against no padding.
    pub pad: PadTo,
    /// Rows per batch.
    pub batch_size: usize,
    /// Rows in the pass.
    pub sequences: usize,
    /// Batches padded to their longest row only.
    pub without: ShapeForecast,
    /// Batches padded under `pad` resolved on `platform`.
    pub with: ShapeForecast,
}

impl PaddingComparison {
    /// Compares no padding against `pad` resolved on `platform`.
    pub fn new(
        lengths: &[usize],
        batch_size: usize,
        pad: PadTo,
        platform: Platform,
        seconds_per_compile: f64,
    ) -> Result<Self, ShapeError> {
        Ok(PaddingComparison {
            platform,
            pad,
            batch_size,
            sequences: lengths.len(),
            without: ShapeForecast::new(lengths, batch_size, None, seconds_per_compile)?,
            with: ShapeForecast::new(lengths, batch_size, pad.resolve(platform), seconds_per_compile)?,
        })
    }

    /// What `pad_to_multiple_of` resolves to on the platform, in words.
    fn resolved_pad(&self) -> String {
        self.pad
            .resolve(self.platform)
            .map_or("no multiple (each batch to its longest row)".to_string(), |m| {
                m.to_string()
            })
    }

    /// Compile time saved by the policy, seconds (negative if it costs more).
    pub(crate) fn seconds_saved(&self) -> f64 {
        self.without.ledger.predicted_compile_seconds() - self.with.ledger.predicted_compile_seconds()
    }

    /// The cumulative-compiles chart (one line per forecast).
    pub fn chart(&self) -> LineChart {
        let curve = |f: &ShapeForecast| {
            f.ledger
                .compile_curve("forward")
                .into_iter()
                .map(|(c, d)| (c as f64 + 1.0, d as f64))
                .collect()
        };
        LineChart::new(
            "Distinct shapes (= Neuron compiles) over one epoch",
            "batch",
            "compiles so far",
        )
        .with_series(&self.without.label, curve(&self.without))
        .with_series(
            &format!("{} (pad_to_multiple_of={})", self.with.label, self.pad),
            curve(&self.with),
        )
    }

    fn rows(&self) -> Vec<[String; 5]> {
        [&self.without, &self.with]
            .iter()
            .map(|f| {
                [
                    f.label.clone(),
                    f.compiles().to_string(),
                    format!("{:.1}", f.ledger.predicted_compile_seconds() / 60.0),
                    format!("{:.1}%", 100.0 * f.padding_fraction()),
                    f.padded_tokens.to_string(),
                ]
            })
            .collect()
    }
}

const HEADERS: [&str; 5] = [
    "batches padded",
    "distinct shapes",
    "compile min",
    "padding share",
    "tokens forwarded",
];

impl Rich for PaddingComparison {
    fn html(&self) -> String {
        let rows: Vec<Vec<String>> = self
            .rows()
            .into_iter()
            .map(|r| r.iter().map(|c| escape(c)).collect())
            .collect();
        let intro = format!(
            "<p>{} sequences in batches of {} on <b>{}</b>; <code>pad_to_multiple_of={}</code> resolves to {}. \
             Each distinct shape is one compile ({:.0} s each on Neuron): the policy saves <b>{:.1} min</b>.</p>",
            self.sequences,
            self.batch_size,
            self.platform,
            self.pad,
            self.resolved_pad(),
            self.with.ledger.seconds_per_compile,
            self.seconds_saved() / 60.0
        );
        display::style::container(&display::section(
            "Shapes with and without padding",
            &format!("{intro}{}{}", display::table(&HEADERS, &rows), self.chart().fragment()),
        ))
    }

    fn text(&self) -> String {
        let mut s = format!(
            "{} sequences, batch {}, platform {}, pad_to_multiple_of={} -> {}\n",
            self.sequences,
            self.batch_size,
            self.platform,
            self.pad,
            self.resolved_pad()
        );
        s.push_str(&format!(
            "{:<18}{:>16}{:>13}{:>15}{:>18}\n",
            HEADERS[0], HEADERS[1], HEADERS[2], HEADERS[3], HEADERS[4]
        ));
        for r in self.rows() {
            s.push_str(&format!(
                "{:<18}{:>16}{:>13}{:>15}{:>18}\n",
                r[0], r[1], r[2], r[3], r[4]
            ));
        }
        s.push_str(&format!("compile time saved: {:.1} min\n", self.seconds_saved() / 60.0));
        s
    }
}

crate::display::rich_display!(PaddingComparison);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_shapes_and_padding_by_hand() {
        // batches: [100, 130] [129, 7] [300]
        let lengths = [100, 130, 129, 7, 300];
        let f = ShapeForecast::new(&lengths, 2, None, 60.0).unwrap();
        assert_eq!(f.batches, 3);
        // shapes [2,130] [2,129] [1,300]
        assert_eq!(f.compiles(), 3);
        assert_eq!(f.real_tokens, 666);
        assert_eq!(f.padded_tokens, 260 + 258 + 300);
        let p = ShapeForecast::new(&lengths, 2, Some(128), 60.0).unwrap();
        // shapes [2,256] [2,256] [1,384]
        assert_eq!(p.compiles(), 2);
        assert_eq!(p.padded_tokens, 512 + 512 + 384);
        assert!((p.padding_fraction() - (1.0 - 666.0 / 1408.0)).abs() < 1e-12);
    }

    #[test]
    fn comparison_resolves_auto_per_platform() {
        let lengths = super::super::synthetic_lengths(512, 300.0, 0.6, 8, 2048, 1);
        let neuron = PaddingComparison::new(&lengths, 8, PadTo::Auto, Platform::Neuron, 60.0).unwrap();
        assert_eq!(neuron.with.multiple, Some(128));
        assert!(neuron.with.compiles() < neuron.without.compiles() / 3);
        assert!(neuron.seconds_saved() > 0.0);
        let cpu = PaddingComparison::new(&lengths, 8, PadTo::Auto, Platform::Cpu, 60.0).unwrap();
        assert_eq!(cpu.with.compiles(), cpu.without.compiles());
        assert_eq!(cpu.seconds_saved(), 0.0);
        let html = neuron.html();
        assert!(html.contains("<svg") && html.contains("pad to 128"));
        assert!(neuron.text().contains("compile time saved"));
        assert!(
            neuron.text().contains("pad_to_multiple_of=auto -> 128\n"),
            "{}",
            neuron.text()
        );
        assert!(html.contains("</code> resolves to 128."));
        let none = "pad_to_multiple_of=auto -> no multiple (each batch to its longest row)\n";
        assert!(cpu.text().contains(none), "{}", cpu.text());
    }

    #[test]
    fn rejects_bad_arguments() {
        assert_eq!(ShapeForecast::new(&[1], 0, None, 60.0), Err(ShapeError::ZeroBatchSize));
        assert!(matches!(
            ShapeForecast::new(&[1], 1, None, f64::NAN),
            Err(ShapeError::BadCompileSeconds(_))
        ));
        let empty = ShapeForecast::new(&[], 4, Some(128), 60.0).unwrap();
        assert_eq!((empty.compiles(), empty.batches, empty.padding_fraction()), (0, 0, 0.0));
    }
}
