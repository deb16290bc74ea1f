//! Line charts as inline SVG, drawn with plotters.
//!
//! Built for training curves read in a notebook: the legend sits in a strip above the plot (never
//! over the data), integer x values (steps) get integer ticks, sparse series (an eval every few
//! steps) are drawn with markers, and a chart with fewer than two points is a note, not a dot on an
//! invented axis.

use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
use plotters::coord::types::RangedCoordf64;
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

impl Series {
    fn finite(&self) -> impl Iterator<Item = (f64, f64)> + '_ {
        self.points
            .iter()
            .copied()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
    }
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

/// Series with at most this many points are drawn with a marker on every point.
const MARKERS_UP_TO: usize = 30;
/// Height of the strip holding the title and the legend.
const HEADER_PX: u32 = 30;
/// Height of each further legend line when the legend wraps.
const LEGEND_LINE_PX: u32 = 20;
const FONT: &str = "sans-serif";

/// The extent of a chart's finite points.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Extent {
    x: (f64, f64),
    y: (f64, f64),
}

impl LineChart {
    /// A chart with the default 560x280 size (two fit side by side in a notebook) and no series.
    pub fn new(title: &str, x_label: &str, y_label: &str) -> Self {
        Self {
            title: title.into(),
            x_label: x_label.into(),
            y_label: y_label.into(),
            series: Vec::new(),
            size: (560, 280),
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

    /// Sets the pixel size (builder style).
    pub(crate) fn with_size(mut self, width: u32, height: u32) -> Self {
        self.size = (width, height);
        self
    }

    /// Distinct x values over all series: a chart needs two to say anything.
    fn distinct_x(&self) -> usize {
        let mut xs: Vec<f64> = self.series.iter().flat_map(|s| s.finite().map(|p| p.0)).collect();
        xs.sort_by(f64::total_cmp);
        xs.dedup();
        xs.len()
    }

    /// Whether the chart has enough points to be drawn (two distinct x values).
    pub(crate) fn is_drawable(&self) -> bool {
        self.distinct_x() >= 2
    }

    /// The chart for an HTML page: the SVG, or a one-line note while it has fewer than two
    /// points (after a first step a curve would be one dot on an invented axis).
    pub(crate) fn fragment(&self) -> String {
        if self.is_drawable() {
            return self.to_svg();
        }
        format!(
            "<p class=\"muted\">{}: the chart appears once there are two {}s.</p>",
            super::escape(&self.title),
            super::escape(&self.x_label)
        )
    }

    fn extent(&self) -> Extent {
        let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
        for (x, y) in self.series.iter().flat_map(Series::finite) {
            (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
        }
        if x0 > x1 {
            (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
        }
        if x1 - x0 < 1e-12 {
            x1 = x0 + 1.0;
        }
        let pad = ((y1 - y0) * 0.06).max(y1.abs().max(y0.abs()) * 0.05).max(1e-9);
        Extent {
            x: (x0, x1),
            y: (y0 - pad, y1 + pad),
        }
    }

    fn integer_x(&self) -> bool {
        self.series
            .iter()
            .flat_map(Series::finite)
            .all(|(x, _)| x.fract() == 0.0)
    }

    /// The chart as an `<svg>` element, whatever its number of points (see [`Self::fragment`]).
    /// Non-finite points are skipped; an empty chart still renders its axes.
    pub(crate) fn to_svg(&self) -> String {
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, self.size).into_drawing_area();
            // Drawing into a String cannot fail for I/O reasons; a layout error leaves a partial
            // SVG, which is still valid output, so errors are deliberately ignored here.
            let _ = self.draw(&root, self.extent());
            let _ = root.present();
        }
        // plotters writes black; currentColor makes axes and labels follow the notebook theme.
        svg.replace("\"#000000\"", "\"currentColor\"")
    }

    fn draw(
        &self,
        root: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
        extent: Extent,
    ) -> Result<(), Box<dyn std::error::Error + '_>> {
        let (header, plot) = root.split_vertically(self.header_px());
        self.draw_header(&header)?;
        let step = tick_step(extent.x, 8, self.integer_x());
        let x_ticks = ticks(extent.x, step);
        let x_decimals = decimals(step);
        let y_step = tick_step(extent.y, 6, false);
        let y_decimals = decimals(y_step);
        let y_scientific = extent.y.0.abs().max(extent.y.1.abs()) < 1e-2;
        let x_fmt = move |x: &f64| format!("{x:.x_decimals$}");
        // A tick at k * step can land a rounding error away from 0 (-1.7e-24): that is 0.
        let y_fmt = move |y: &f64| match (y.abs() < y_step * 1e-6, y_scientific) {
            (true, _) => "0".to_string(),
            (false, true) => format!("{y:.1e}"),
            (false, false) => format!("{y:.y_decimals$}"),
        };
        let (x0, x1) = extent.x;
        let mut chart = ChartBuilder::on(&plot)
            .margin(6)
            .margin_right(20)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .build_cartesian_2d(
                TickedAxis {
                    inner: (x0..x1).into(),
                    ticks: x_ticks,
                },
                extent.y.0..extent.y.1,
            )?;
        chart
            .configure_mesh()
            .x_desc(&self.x_label)
            .y_desc(&self.y_label)
            .label_style((FONT, 15))
            .axis_desc_style((FONT, 16))
            .x_label_formatter(&x_fmt)
            .y_label_formatter(&y_fmt)
            .y_labels(6)
            .max_light_lines(1)
            .light_line_style(RGBColor(128, 128, 128).mix(0.1))
            .bold_line_style(RGBColor(128, 128, 128).mix(0.3))
            .draw()?;
        let densest = self.series.iter().map(|s| s.finite().count()).max().unwrap_or(0);
        for (i, s) in self.series.iter().enumerate() {
            let color = series_color(i);
            let points: Vec<(f64, f64)> = s.finite().collect();
            // A sparse series beside a dense one (an eval every 20 steps beside the training
            // loss) is points only: a line between two evals would invent the steps between.
            let sparse = points.len() * 2 < densest;
            if points.len() <= MARKERS_UP_TO || sparse {
                let radius = if sparse { 4 } else { 3 };
                chart.draw_series(points.iter().map(|&p| Circle::new(p, radius, color.filled())))?;
            }
            if !sparse {
                chart.draw_series(LineSeries::new(points, color.stroke_width(2)))?;
            }
        }
        Ok(())
    }

    /// Where each legend entry goes: `(x, line)`, wrapping to a new line at the chart's width;
    /// the title takes the start of line 0.
    fn legend_layout(&self) -> Vec<(i32, i32)> {
        let width = self.size.0 as i32 - 8;
        let mut x = 16 + text_width(&self.title, 14.5);
        let mut line = 0;
        self.series
            .iter()
            .map(|s| {
                let w = 36 + text_width(&s.name, 13.0);
                if x + w > width && x > 16 {
                    (x, line) = (16, line + 1);
                }
                let at = (x, line);
                x += w;
                at
            })
            .collect()
    }

    /// Height of the strip above the plot: one line of title and legend, more when it wraps.
    fn header_px(&self) -> u32 {
        let lines = self.legend_layout().last().map_or(0, |&(_, l)| l as u32);
        HEADER_PX + LEGEND_LINE_PX * lines
    }

    /// The title, then one swatch and name per series, in a strip above the plot.
    fn draw_header(
        &self,
        area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    ) -> Result<(), Box<dyn std::error::Error + '_>> {
        // plotters' SVG backend writes font sizes at 0.8 of what it is given.
        let title = (FONT, 18).into_font().style(FontStyle::Bold);
        area.draw(&Text::new(self.title.clone(), (8, 6), title))?;
        for (i, (s, (x, line))) in self.series.iter().zip(self.legend_layout()).enumerate() {
            let top = 6 + line * LEGEND_LINE_PX as i32;
            let color = series_color(i);
            area.draw(&PathElement::new(
                vec![(x, top + 8), (x + 18, top + 8)],
                color.stroke_width(3),
            ))?;
            area.draw(&Text::new(s.name.clone(), (x + 22, top + 1), (FONT, 16)))?;
        }
        Ok(())
    }
}

/// An f64 axis with chosen ticks (plotters' own picks fractional steps for integer data).
struct TickedAxis {
    inner: RangedCoordf64,
    ticks: Vec<f64>,
}

impl Ranged for TickedAxis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        self.inner.map(value, limit)
    }

    fn key_points<Hint: KeyPointHint>(&self, _hint: Hint) -> Vec<f64> {
        self.ticks.clone()
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.inner.range()
    }
}

fn series_color(i: usize) -> RGBColor {
    let (r, g, b) = PALETTE[i % PALETTE.len()];
    RGBColor(r, g, b)
}

/// Approximate rendered width of `s` in a sans-serif font of `px` pixels (no font metrics here).
fn text_width(s: &str, px: f64) -> i32 {
    (s.chars().count() as f64 * px * 0.56).ceil() as i32
}

/// A 1-2-5 tick step giving at most about `max_ticks` ticks over `range`; at least 1 when the
/// values are integers (steps), so no tick falls between two steps.
fn tick_step(range: (f64, f64), max_ticks: usize, integer: bool) -> f64 {
    let raw = ((range.1 - range.0) / max_ticks as f64).max(1e-12);
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|&s| s >= raw * 0.999)
        .unwrap_or(10.0 * magnitude);
    if integer { step.max(1.0).round() } else { step }
}

/// Multiples of `step` inside `range`.
fn ticks(range: (f64, f64), step: f64) -> Vec<f64> {
    let first = (range.0 / step).ceil() as i64;
    let last = (range.1 / step).floor() as i64;
    (first..=last).map(|k| k as f64 * step).collect()
}

/// Decimals that tell ticks `step` apart.
fn decimals(step: f64) -> usize {
    (-step.log10().floor()).max(0.0) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `(y, text)` of every `<text>` element (plotters writes the text on its own line).
    fn texts(svg: &str) -> Vec<(f64, String)> {
        svg.split("<text")
            .skip(1)
            .map(|t| {
                let y = t
                    .split("y=\"")
                    .nth(1)
                    .and_then(|v| v.split('"').next())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(f64::NAN);
                let body = t.split_once('>').map_or("", |(_, b)| b);
                (y, body.split("</text>").next().unwrap_or("").trim().to_string())
            })
            .collect()
    }

    #[test]
    fn svg_has_title_legend_and_lines() {
        let svg = LineChart::new("compiles", "batch", "shapes")
            .with_series("no padding", vec![(0.0, 1.0), (1.0, 2.0), (2.0, 4.0)])
            .with_series("pad 128", vec![(0.0, 1.0), (1.0, 1.0), (2.0, f64::NAN)])
            .to_svg();
        assert!(svg.starts_with("<svg"), "{}", &svg[..80.min(svg.len())]);
        assert!(svg.contains("no padding") && svg.contains("pad 128"));
        assert!(svg.contains("compiles") && svg.contains("batch"));
        assert!(svg.contains("<polyline"));
    }

    #[test]
    fn integer_steps_get_integer_ticks() {
        let svg = LineChart::new("loss", "step", "loss")
            .with_series("train", (1..=4).map(|s| (s as f64, 1.0 / s as f64)).collect())
            .to_svg();
        let labels: Vec<String> = texts(&svg).into_iter().map(|(_, t)| t).collect();
        for tick in ["1", "2", "3", "4"] {
            assert!(labels.iter().any(|l| l == tick), "tick {tick} missing: {labels:?}");
        }
        assert!(
            !labels.iter().any(|l| l == "2.0" || l == "1.5"),
            "no fractional step ticks: {labels:?}"
        );
        assert_eq!(
            ticks((0.0, 39.0), tick_step((0.0, 39.0), 8, true)),
            vec![0.0, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 35.0]
        );
    }

    #[test]
    fn sparse_series_get_markers_and_dense_ones_do_not() {
        let dense: Vec<(f64, f64)> = (0..100).map(|s| (s as f64, s as f64)).collect();
        let svg = LineChart::new("loss", "step", "loss")
            .with_series("train", dense)
            .with_series("eval", vec![(0.0, 50.0), (99.0, 10.0)])
            .to_svg();
        assert_eq!(svg.matches("<circle").count(), 2, "one marker per eval point only");
        let eval_lines = svg
            .split("<polyline")
            .filter(|p| p.contains("stroke=\"#FF7F0E\""))
            .count();
        assert_eq!(
            eval_lines, 1,
            "the eval series' legend swatch only, no line between evals"
        );
    }

    #[test]
    fn long_legends_wrap_inside_the_chart() {
        let chart = LineChart::new(
            "Distinct shapes (= Neuron compiles) over one epoch",
            "batch",
            "compiles",
        )
        .with_series("longest row only", vec![(0.0, 1.0), (1.0, 2.0)])
        .with_series("pad to 128 (pad_to_multiple_of=auto)", vec![(0.0, 1.0), (1.0, 1.0)]);
        let layout = chart.legend_layout();
        assert_eq!(layout[1].1, 1, "the second entry wraps: {layout:?}");
        for (i, s) in chart.series.iter().enumerate() {
            assert!(layout[i].0 + 36 + text_width(&s.name, 13.0) <= chart.size.0 as i32);
        }
        assert_eq!(chart.header_px(), HEADER_PX + LEGEND_LINE_PX);
    }

    #[test]
    fn legend_sits_above_the_plot() {
        let svg = LineChart::new("reward", "step", "r")
            .with_series("total", vec![(1.0, 0.0), (2.0, 1.0)])
            .to_svg();
        let (legend_y, _) = texts(&svg)
            .into_iter()
            .find(|(_, t)| t == "total")
            .expect("legend text");
        assert!(
            legend_y < f64::from(HEADER_PX),
            "legend at y={legend_y}, inside the plot"
        );
    }

    #[test]
    fn fewer_than_two_points_is_a_note() {
        let one = LineChart::new("Reward", "step", "reward").with_series("total", vec![(1.0, 0.5)]);
        assert!(!one.is_drawable());
        assert!(one.fragment().starts_with("<p") && one.fragment().contains("two steps"));
        let two = one.clone().with_series("eval", vec![(2.0, 0.6)]);
        assert!(two.fragment().starts_with("<svg"));
    }

    #[test]
    fn tiny_values_read_in_scientific_notation() {
        let svg = LineChart::new("KL", "step", "nats")
            .with_series("kl", vec![(1.0, 1e-5), (2.0, 3e-5)])
            .to_svg();
        assert!(
            texts(&svg).iter().any(|(_, t)| t.ends_with("e-5")),
            "scientific y ticks"
        );
    }

    #[test]
    fn empty_chart_still_renders() {
        let svg = LineChart::new("empty", "x", "y").to_svg();
        assert!(svg.contains("</svg>"));
    }
}

impl super::Rich for LineChart {
    fn html(&self) -> String {
        super::style::container(&self.fragment())
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

crate::display::rich_display!(LineChart);
