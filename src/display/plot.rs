//! Line charts as inline SVG, drawn with plotters.

use plotters::prelude::*;

use super::style::PALETTE;

/// One named line of a [`LineChart`].
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend label.
    pub name: String,
    /// `(x, y)` points in drawing order.
    pub points: Vec<(f64, f64)>,
}

/// A line chart rendered to a standalone SVG string.
#[derive(Debug, Clone)]
pub struct LineChart {
    /// Caption above the plot.
    pub title: String,
    /// X axis description.
    pub x_label: String,
    /// Y axis description.
    pub y_label: String,
    /// The lines.
    pub series: Vec<Series>,
    /// Pixel size `(width, height)`.
    pub size: (u32, u32),
}

impl LineChart {
    /// A chart with the default 640x320 size and no series yet.
    pub fn new(title: &str, x_label: &str, y_label: &str) -> Self {
        Self {
            title: title.into(),
            x_label: x_label.into(),
            y_label: y_label.into(),
            series: Vec::new(),
            size: (640, 320),
        }
    }

    /// Adds a series (builder style).
    pub fn with_series(mut self, name: &str, points: Vec<(f64, f64)>) -> Self {
        self.series.push(Series {
            name: name.into(),
            points,
        });
        self
    }

    /// The chart as an `<svg>` element. Non-finite points are skipped; an empty chart still
    /// renders its axes.
    pub fn to_svg(&self) -> String {
        let mut svg = String::new();
        let finite = || {
            self.series
                .iter()
                .flat_map(|s| s.points.iter())
                .filter(|(x, y)| x.is_finite() && y.is_finite())
        };
        let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
        for &(x, y) in finite() {
            x0 = x0.min(x);
            x1 = x1.max(x);
            y0 = y0.min(y);
            y1 = y1.max(y);
        }
        if x0 > x1 {
            (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
        }
        if x1 - x0 < 1e-12 {
            x1 = x0 + 1.0;
        }
        let pad = ((y1 - y0) * 0.05).max(1e-9);
        let (y0, y1) = (y0 - pad, y1 + pad);
        {
            let root = SVGBackend::with_string(&mut svg, self.size).into_drawing_area();
            // Drawing into a String cannot fail for I/O reasons; a layout error leaves a partial
            // SVG, which is still valid output, so errors are deliberately ignored here.
            let _ = self.draw(&root, (x0, x1), (y0, y1));
            let _ = root.present();
        }
        // plotters writes black; currentColor makes axes and labels follow the notebook theme.
        svg.replace("\"#000000\"", "\"currentColor\"")
    }

    fn draw(
        &self,
        root: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
        (x0, x1): (f64, f64),
        (y0, y1): (f64, f64),
    ) -> Result<(), Box<dyn std::error::Error + '_>> {
        let mut chart = ChartBuilder::on(root)
            .caption(&self.title, ("sans-serif", 16))
            .margin(8)
            .margin_right(24)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(x0..x1, y0..y1)?;
        chart
            .configure_mesh()
            .x_desc(&self.x_label)
            .y_desc(&self.y_label)
            .light_line_style(RGBColor(128, 128, 128).mix(0.15))
            .draw()?;
        for (i, s) in self.series.iter().enumerate() {
            let (r, g, b) = PALETTE[i % PALETTE.len()];
            let color = RGBColor(r, g, b);
            let points: Vec<(f64, f64)> = s
                .points
                .iter()
                .copied()
                .filter(|(x, y)| x.is_finite() && y.is_finite())
                .collect();
            // A line needs two points: after a first training step a curve is one dot.
            if points.len() == 1 {
                chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
            }
            chart
                .draw_series(LineSeries::new(points, color.stroke_width(2)))?
                .label(&s.name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
        }
        if !self.series.is_empty() {
            chart
                .configure_series_labels()
                .border_style(RGBColor(128, 128, 128))
                .position(SeriesLabelPosition::UpperLeft)
                .draw()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn svg_contains_series_and_labels() {
        let svg = LineChart::new("compiles", "batch", "shapes")
            .with_series("no padding", vec![(0.0, 1.0), (1.0, 2.0), (2.0, 4.0)])
            .with_series("pad 128", vec![(0.0, 1.0), (1.0, 1.0), (2.0, f64::NAN)])
            .to_svg();
        assert!(svg.starts_with("<svg"), "{}", &svg[..80.min(svg.len())]);
        assert!(svg.contains("no padding") && svg.contains("pad 128"));
        assert!(svg.contains("compiles") && svg.contains("batch"));
        assert!(svg.contains("<polyline"));
        let one = LineChart::new("reward", "step", "reward")
            .with_series("total", vec![(1.0, 0.5)])
            .to_svg();
        assert!(one.contains("<circle"), "a single point is drawn as a dot");
    }

    #[test]
    fn empty_chart_still_renders() {
        let svg = LineChart::new("empty", "x", "y").to_svg();
        assert!(svg.contains("</svg>"));
    }
}

impl super::Rich for LineChart {
    fn html(&self) -> String {
        super::style::container(&self.to_svg())
    }
    fn text(&self) -> String {
        let mut s = format!("{} ({} vs {})\n", self.title, self.y_label, self.x_label);
        for series in &self.series {
            let last = series
                .points
                .last()
                .map_or(String::from("-"), |(x, y)| format!("{y:.4} at {x}"));
            s.push_str(&format!(
                "  {}: {} points, last {last}\n",
                series.name,
                series.points.len()
            ));
        }
        s
    }
}

crate::rich_display!(LineChart);
