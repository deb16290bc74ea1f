//! Shape accounting: every distinct input shape is a graph compile on Neuron (priced at a
//! minute each by default, the order TRL v1.16 reports for Trainium2), so treetrain counts
//! shapes per named graph and forecasts what a length distribution will cost with and without
//! `pad_to_multiple_of`, before anyone pays for Trainium time.

mod comparison;
mod forecast;
mod ledger;
mod lengths;

pub use comparison::LedgerComparison;
pub use forecast::{PaddingComparison, ShapeError, ShapeForecast};
pub use ledger::{GraphShapes, ShapeLedger};
pub use lengths::synthetic_lengths;
