//! The figures each plot draws, as a table under it: readers copy numbers,
//! not pixels.

use super::html::{Cell, table, thousands};
use super::plot::{BarChart, StackedChart};

/// One row per bar, clusters in order and each cluster's series in order,
/// as the bars stand left to right.
pub(crate) fn bar_table(id: &str, chart: &BarChart) -> String {
    let median = format!("median, {}", chart.y_desc);
    let marker = chart.marker_label.as_ref().map(|label| format!("{label}, {} (median)", chart.y_desc));
    let mut head = vec!["daemon", "queues and jobs", median.as_str(), "lowest", "highest"];
    head.extend(marker.as_deref());
    let rows: Vec<Vec<Cell>> = chart
        .clusters
        .iter()
        .enumerate()
        .flat_map(|(i, cluster)| {
            chart.series.iter().filter_map(move |series| {
                let bar = series.bars[i].as_ref()?;
                let spread = bar.spread;
                let mut cells = vec![
                    Cell::text(&series.label),
                    Cell::text(cluster),
                    number(spread.median),
                    number(spread.min),
                    number(spread.max),
                ];
                if chart.marker_label.is_some() {
                    cells.push(bar.marker.map_or_else(|| Cell::text("—"), number));
                }
                Some(cells)
            })
        })
        .collect();
    table(Some(id), &head, &rows)
}

/// One row per stack, top to bottom: every segment, whichever panel draws
/// it, and their sum.
pub(crate) fn stacked_table(id: &str, chart: &StackedChart) -> String {
    let head: Vec<&str> = std::iter::once("configuration")
        .chain(chart.segments.iter().map(|(name, _)| name.as_str()))
        .chain(std::iter::once("total"))
        .collect();
    let rows: Vec<Vec<Cell>> = chart
        .stacks
        .iter()
        .map(|(label, values)| {
            let total = values.iter().sum();
            std::iter::once(Cell::text(label))
                .chain(values.iter().copied().map(number))
                .chain(std::iter::once(number(total)))
                .collect()
        })
        .collect();
    table(Some(id), &head, &rows)
}

fn number(value: f64) -> Cell {
    Cell::number(figure(value))
}

/// `value` to at least three significant digits, thousands grouped.
fn figure(value: f64) -> String {
    match value.abs() {
        v if v >= 100.0 => thousands(value),
        v if v >= 10.0 => format!("{value:.1}"),
        _ => format!("{value:.2}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_keep_three_digits() {
        assert_eq!(figure(412_345.6), "412,346");
        assert_eq!(figure(123.4), "123");
        assert_eq!(figure(70.25), "70.2");
        assert_eq!(figure(2.345), "2.35");
        assert_eq!(figure(0.0), "0.00");
    }
}
