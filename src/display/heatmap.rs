//! Heatmaps as inline SVG, drawn with plotters: a grid of cells shaded by value, rows labelled
//! down the left, columns along the bottom, the largest value in the darkest cell.

use plotters::prelude::*;

use super::style::PALETTE;

const FONT: &str = "sans-serif";

/// A grid of values rendered to a standalone SVG string.
#[derive(Debug, Clone)]
pub(crate) struct Heatmap {
    /// Caption above the grid.
    pub(crate) title: String,
    /// One label per row (top to bottom).
    pub(crate) rows: Vec<String>,
    /// What the columns are (`expert`); they are numbered from 0.
    pub(crate) columns: String,
    /// `values[row][column]`, non-negative.
    pub(crate) values: Vec<Vec<f64>>,
}

impl Heatmap {
    /// The grid as an `<svg>` element: cells of at least 6 px, shaded from the background
    /// (0) to the first palette colour (the largest value).
    pub(crate) fn to_svg(&self) -> String {
        let cols = self.values.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let rows = self.values.len().max(1);
        let cell = (720 / cols).clamp(6, 40) as u32;
        let size = (cell * cols as u32 + 110, (cell.max(18) * rows as u32) + 90);
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
            // As for line charts: a layout error leaves a partial SVG, still valid output.
            let _ = self.draw(&root, (rows, cols));
            let _ = root.present();
        }
        svg.replace("\"#000000\"", "\"currentColor\"")
    }

    fn draw(
        &self,
        root: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
        (rows, cols): (usize, usize),
    ) -> Result<(), Box<dyn std::error::Error + '_>> {
        let top = self
            .values
            .iter()
            .flatten()
            .copied()
            .fold(0.0, f64::max)
            .max(f64::MIN_POSITIVE);
        let (r, g, b) = PALETTE[0];
        let mut chart = ChartBuilder::on(root)
            .caption(&self.title, (FONT, 18).into_font().style(FontStyle::Bold))
            .margin(8)
            .x_label_area_size(36)
            .y_label_area_size(90)
            .build_cartesian_2d(0..cols, 0..rows)?;
        let labels = self.rows.clone();
        let row_label = move |y: &usize| labels.get(rows.saturating_sub(y + 1)).cloned().unwrap_or_default();
        chart
            .configure_mesh()
            .disable_mesh()
            .x_desc(&self.columns)
            .x_labels(cols.min(16))
            .y_labels(rows)
            .label_style((FONT, 14))
            .axis_desc_style((FONT, 15))
            .y_label_formatter(&row_label)
            .draw()?;
        for (i, row) in self.values.iter().enumerate() {
            let y = rows - 1 - i;
            chart.draw_series(row.iter().enumerate().map(|(x, &v)| {
                let shade = (v / top).clamp(0.0, 1.0);
                Rectangle::new(
                    [(x, y), (x + 1, y + 1)],
                    RGBColor(r, g, b).mix(0.08 + 0.92 * shade).filled(),
                )
            }))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_svg_has_a_cell_per_value_and_the_row_labels() {
        let h = Heatmap {
            title: "load".into(),
            rows: vec!["layer 1".into(), "layer 3".into()],
            columns: "expert".into(),
            values: vec![vec![1.0, 0.0, 3.0], vec![2.0, 2.0, 2.0]],
        };
        let svg = h.to_svg();
        assert!(svg.starts_with("<svg") && svg.contains("layer 1") && svg.contains("layer 3"));
        assert!(svg.matches("<rect").count() >= 6, "{svg}");
    }
}
