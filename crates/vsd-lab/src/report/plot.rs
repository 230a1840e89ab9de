//! The plots, drawn with plotters' SVG back-end, which writes `<text>` and so
//! needs no font files: grouped bars with whiskers, and stacked bars.

use std::ops::Range;

use anyhow::Result;
use plotters::coord::Shift;
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::stats::Spread;

const FONT: &str = "sans-serif";
/// Font sizes in plotters' points, which SVG renders at 1/1.24 of that in pixels.
const TITLE_SIZE: u32 = 18;
const LABEL_SIZE: u32 = 16;
/// Room for the title above the plot, in pixels.
const TITLE_HEIGHT: u32 = 30;
/// Room for a panel's own title, in pixels.
const PANEL_TITLE_HEIGHT: u32 = 24;
/// About the width of a character of either size, in pixels, for layout.
const CHAR_WIDTH: u32 = 8;
/// Okabe and Ito's colours, told apart by colour-blind readers too.
const COLORS: [RGBColor; 8] = [
    RGBColor(0, 114, 178),
    RGBColor(230, 159, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(86, 180, 233),
    RGBColor(213, 94, 0),
    RGBColor(240, 228, 66),
    RGBColor(117, 112, 179),
];
/// The colour of what is left over, such as the time outside the daemon.
pub(crate) const GREY: RGBColor = RGBColor(170, 170, 170);

/// The colour of the `index`th series, stable across every plot of a report.
pub(crate) fn color(index: usize) -> RGBColor {
    COLORS[index % COLORS.len()]
}

/// One bar: the median of the repetitions, whiskers to their extremes, and
/// optionally a marker for a second figure (the p99 beside the mean).
pub(crate) struct Bar {
    pub spread: Spread,
    pub marker: Option<f64>,
}

/// One series' bars, one per cluster (`None` where it did not run).
pub(crate) struct BarSeries {
    pub label: String,
    pub color: RGBColor,
    pub bars: Vec<Option<Bar>>,
}

/// Clusters of bars side by side, one bar per series in each cluster.
pub(crate) struct BarChart {
    pub title: String,
    pub y_desc: String,
    pub clusters: Vec<String>,
    pub series: Vec<BarSeries>,
    /// What the markers show, for the legend, when bars have them.
    pub marker_label: Option<String>,
}

/// Bars of segments stacked left to right, one per label, in one or more
/// panels: each panel stacks some of the segments on an x axis of its own,
/// so that small segments can be read beside a large one.
pub(crate) struct StackedChart {
    pub title: String,
    pub x_desc: String,
    /// Each segment's name and colour, in stacking order.
    pub segments: Vec<(String, RGBColor)>,
    /// Each bar's label and its segments' values, top to bottom.
    pub stacks: Vec<(String, Vec<f64>)>,
    /// Each panel's title and the indices of the segments it stacks, top to bottom.
    pub panels: Vec<(String, Vec<usize>)>,
}

/// A chart of the page: drawn as SVG, and the figures it draws as a table
/// under it, for readers who copy numbers.
pub(crate) trait Plot {
    fn svg(&self) -> Result<String>;

    /// The figures the plot draws, as an HTML table with `id`.
    fn table(&self, id: &str) -> String;
}

/// How a legend entry shows its series.
enum Swatch {
    Fill(RGBColor),
    Marker,
}

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

/// The SVG of `chart`: each cluster's bars with min..max whiskers.
fn grouped_bars(chart: &BarChart) -> Result<String> {
    let per_cluster = (28 * chart.series.len() as u32).max(90);
    let width = (130 + per_cluster * chart.clusters.len() as u32).max(380);
    let mut legend: Vec<(String, Swatch)> =
        chart.series.iter().map(|series| (series.label.clone(), Swatch::Fill(series.color))).collect();
    legend.extend(chart.marker_label.iter().map(|label| (label.clone(), Swatch::Marker)));
    svg(&chart.title, (width, 340), &legend, |plot| draw_bars(plot, chart))
}

/// The SVG of `chart`, its labels left of the bars, its panels one above
/// the other.
fn stacked_bars(chart: &StackedChart) -> Result<String> {
    let label_width = 16 + CHAR_WIDTH * longest(chart.stacks.iter().map(|(label, _)| label));
    let panel_height = PANEL_TITLE_HEIGHT + (60 + 36 * chart.stacks.len() as u32).max(150);
    let legend: Vec<(String, Swatch)> =
        chart.segments.iter().map(|(name, color)| (name.clone(), Swatch::Fill(*color))).collect();
    let height = panel_height * chart.panels.len() as u32;
    svg(&chart.title, (600 + label_width, height), &legend, |plot| {
        let mut rest = plot.clone();
        for (title, segments) in &chart.panels {
            let (panel, below) = rest.split_vertically(panel_height);
            draw_stacks(&panel, chart, title, segments, label_width)?;
            rest = below;
        }
        Ok(())
    })
}

impl Plot for BarChart {
    fn svg(&self) -> Result<String> {
        grouped_bars(self)
    }

    fn table(&self, id: &str) -> String {
        super::data::bar_table(id, self)
    }
}

impl Plot for StackedChart {
    fn svg(&self) -> Result<String> {
        stacked_bars(self)
    }

    fn table(&self, id: &str) -> String {
        super::data::stacked_table(id, self)
    }
}

/// The number of characters of the longest of `texts`.
fn longest<'a>(texts: impl Iterator<Item = &'a String>) -> u32 {
    texts.map(|text| text.chars().count()).max().unwrap_or(0) as u32
}

/// A white canvas: `title` across the top, the plot `draw` draws below it
/// on the left, and `legend` beside the plot, so the legend never hides a
/// bar. Returns the SVG document.
fn svg(
    title: &str,
    (plot_width, plot_height): (u32, u32),
    legend: &[(String, Swatch)],
    draw: impl FnOnce(&Area) -> Result<()>,
) -> Result<String> {
    let legend_width = 40 + CHAR_WIDTH * longest(legend.iter().map(|(label, _)| label));
    // plotters centres the title and never wraps it: the canvas must hold it.
    let width = (plot_width + legend_width).max(30 + CHAR_WIDTH * title.chars().count() as u32);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, plot_height + TITLE_HEIGHT)).into_drawing_area();
        root.fill(&WHITE)?;
        let body = root.titled(title, (FONT, TITLE_SIZE))?;
        let (plot, key) = body.split_horizontally(width - legend_width);
        draw(&plot)?;
        draw_legend(&key, legend)?;
        root.present()?;
    }
    // The class lets the page style its plots, and tests find them.
    Ok(svg.replacen("<svg ", "<svg class=\"plot\" ", 1))
}

fn draw_bars(area: &Area, chart: &BarChart) -> Result<()> {
    let top = chart
        .series
        .iter()
        .flat_map(|series| series.bars.iter().flatten())
        .fold(0.0, |top: f64, bar| top.max(bar.spread.max).max(bar.marker.unwrap_or(0.0)));
    let mut plot = ChartBuilder::on(area)
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(centred_axis(chart.clusters.len()), 0.0..headroom(top))?;
    plot.configure_mesh()
        .disable_x_mesh()
        .x_label_formatter(&|x| label_at(&chart.clusters, *x))
        .y_label_formatter(&|y| short_number(*y))
        .y_desc(chart.y_desc.as_str())
        .label_style((FONT, LABEL_SIZE))
        .axis_desc_style((FONT, LABEL_SIZE))
        .light_line_style(WHITE)
        .draw()?;
    // A cluster's bars share at most 0.8 of its unit, in series order,
    // and stay slim when they are few.
    let count = chart.series.len() as f64;
    let width = (0.8 / count).min(0.3);
    for (j, series) in chart.series.iter().enumerate() {
        let offset = width * (j as f64 + 0.5 - count / 2.0);
        let placed =
            || series.bars.iter().enumerate().filter_map(move |(i, bar)| Some((i as f64 + offset, bar.as_ref()?)));
        // A sliver of white between neighbours.
        let half = width * 0.45;
        plot.draw_series(
            placed().map(|(x, bar)| {
                Rectangle::new([(x - half, 0.0), (x + half, bar.spread.median)], series.color.filled())
            }),
        )?;
        plot.draw_series(placed().map(|(x, bar)| {
            ErrorBar::new_vertical(x, bar.spread.min, bar.spread.median, bar.spread.max, BLACK.stroke_width(1), 6)
        }))?;
        plot.draw_series(
            placed().filter_map(|(x, bar)| Some(TriangleMarker::new((x, bar.marker?), 5, BLACK.filled()))),
        )?;
    }
    Ok(())
}

/// One panel of `chart`: the `segments` of each stack, on a scale that fits them.
fn draw_stacks(area: &Area, chart: &StackedChart, title: &str, segments: &[usize], label_width: u32) -> Result<()> {
    let picked = |values: &[f64]| segments.iter().map(|&i| (values[i], chart.segments[i].1)).collect::<Vec<_>>();
    let longest =
        chart.stacks.iter().map(|(_, values)| picked(values).iter().map(|(v, _)| v).sum()).fold(0.0, f64::max);
    let mut plot = ChartBuilder::on(area)
        .caption(title, (FONT, LABEL_SIZE))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(label_width)
        .build_cartesian_2d(0.0..headroom(longest), centred_axis(chart.stacks.len()))?;
    // The first stack is drawn on top, where the y axis ends.
    let labels: Vec<String> = chart.stacks.iter().rev().map(|(label, _)| label.clone()).collect();
    plot.configure_mesh()
        .disable_y_mesh()
        .y_label_formatter(&|y| label_at(&labels, *y))
        .x_label_formatter(&|x| short_number(*x))
        .x_desc(chart.x_desc.as_str())
        .label_style((FONT, LABEL_SIZE))
        .axis_desc_style((FONT, LABEL_SIZE))
        .light_line_style(WHITE)
        .draw()?;
    for (y, (_, values)) in chart.stacks.iter().rev().enumerate() {
        let y = y as f64;
        let segments = picked(values).into_iter().scan(0.0, |end, (value, color)| {
            let start = *end;
            *end += value;
            Some(Rectangle::new([(start, y - 0.35), (*end, y + 0.35)], color.filled()))
        });
        plot.draw_series(segments)?;
    }
    Ok(())
}

/// An axis of `items` slots one unit wide, ticked (and so labelled) at their
/// centres, where clusters and stacks sit.
struct CentredAxis {
    items: usize,
    scale: RangedCoordf64,
}

fn centred_axis(items: usize) -> CentredAxis {
    CentredAxis { items, scale: (-0.5..items as f64 - 0.5).into() }
}

impl Ranged for CentredAxis {
    // The charts label the ticks themselves; this lets the mesh draw them.
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        self.scale.map(value, limit)
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        if hint.weight().allow_light_points() { Vec::new() } else { (0..self.items).map(|i| i as f64).collect() }
    }

    fn range(&self) -> Range<f64> {
        self.scale.range()
    }
}

/// The label of the item centred at `position` on a [`centred_axis`].
fn label_at(labels: &[String], position: f64) -> String {
    labels.get(position.round() as usize).cloned().unwrap_or_default()
}

/// The axis' end: room above the highest value, and a unit for an all-zero plot.
fn headroom(top: f64) -> f64 {
    if top > 0.0 { top * 1.1 } else { 1.0 }
}

fn draw_legend(area: &Area, entries: &[(String, Swatch)]) -> Result<()> {
    let style = TextStyle::from((FONT, LABEL_SIZE).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
    for (i, (label, swatch)) in entries.iter().enumerate() {
        let y = 20 + 22 * i as i32;
        match swatch {
            Swatch::Fill(color) => area.draw(&Rectangle::new([(6, y - 6), (18, y + 6)], color.filled()))?,
            Swatch::Marker => area.draw(&TriangleMarker::new((12, y), 5, BLACK.filled()))?,
        }
        area.draw(&Text::new(label.as_str(), (24, y), style.clone()))?;
    }
    Ok(())
}

/// `1_250_000.0` -> "1.25M": axis labels stay short.
fn short_number(value: f64) -> String {
    let (scaled, suffix) = match value.abs() {
        v if v >= 1e6 => (value / 1e6, "M"),
        v if v >= 1e3 => (value / 1e3, "k"),
        _ => (value, ""),
    };
    let digits = format!("{scaled:.2}");
    format!("{}{suffix}", digits.trim_end_matches('0').trim_end_matches('.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_short() {
        assert_eq!(short_number(1_250_000.0), "1.25M");
        assert_eq!(short_number(350_000.0), "350k");
        assert_eq!(short_number(12.5), "12.5");
        assert_eq!(short_number(0.0), "0");
    }
}
