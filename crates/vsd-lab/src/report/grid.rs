//! Format × cache mode: for every configuration run with more than one
//! image format or cache mode, a table of median IOPS, rows the formats and
//! columns the cache modes.

use std::collections::{BTreeMap, BTreeSet};

use super::group::{Run, Section, mq_label, slug, title};
use super::html::{Cell, Page, escape, table, thousands};
use super::stats::median;
use crate::config::{CacheMode, Config, Format, name, size_label};

/// One table: the IOPS of every repetition, per format and cache mode.
type Grid = BTreeMap<(Format, Option<CacheMode>), Vec<f64>>;

/// Appends the section's format × cache-mode tables, if it has any.
pub(crate) fn write(page: &mut Page, section: &Section) {
    let grids = grids(&section.runs);
    if grids.is_empty() {
        return;
    }
    page.push("<h3>Format × cache mode</h3>\n");
    let note = "Median IOPS over the repetitions; the greener a cell, the faster within its table.";
    page.push(&format!("<p>{}</p>\n", escape(&section.caption(note))));
    for (shared, grid) in grids {
        let parts = parts(&shared);
        let id = page.unique_id(&format!("{}-formats-{}", section.id(), slug(&parts.join("-"))));
        page.push(&format!("<h4>{}</h4>\n{}", escape(&title(&parts)), grid_table(&id, &grid)));
    }
}

/// The grids of `runs`, keyed by what their runs share: the configuration
/// with its format and cache mode erased.
fn grids(runs: &[Run]) -> Vec<(Config, Grid)> {
    let mut grids: BTreeMap<Config, Grid> = BTreeMap::new();
    for run in runs {
        let config = run.config();
        let shared = Config { format: Format::Raw, cache: None, ..config.clone() };
        let cell = grids.entry(shared).or_default().entry((config.format, config.cache)).or_default();
        cell.push(run.measured.iops);
    }
    grids
        .into_iter()
        .filter(|(_, grid)| {
            let (formats, caches) = axes(grid);
            formats.len() > 1 || caches.len() > 1
        })
        .collect()
}

/// The formats (rows) and cache modes (columns) of `grid`.
fn axes(grid: &Grid) -> (BTreeSet<Format>, BTreeSet<Option<CacheMode>>) {
    (grid.keys().map(|(format, _)| *format).collect(), grid.keys().map(|(_, cache)| *cache).collect())
}

/// The axes a grid's runs share, for its title and id.
fn parts(shared: &Config) -> Vec<String> {
    [
        Some(shared.daemon.clone()),
        shared.bus.map(|bus| name(&bus)),
        Some(name(&shared.backend)),
        shared.engine.map(|engine| name(&engine)),
        Some(mq_label(shared.queues, shared.jobs)),
        Some(size_label(shared.bs)),
        Some(name(&shared.rw)),
        Some(format!("qd{}", shared.iodepth)),
    ]
    .into_iter()
    .flatten()
    .collect()
}

fn grid_table(id: &str, grid: &Grid) -> String {
    let medians: BTreeMap<_, f64> =
        grid.iter().filter_map(|(cell, iops)| Some((*cell, median(iops.iter().copied())?))).collect();
    let best = medians.values().copied().fold(0.0, f64::max);
    let (formats, caches) = axes(grid);
    let cache_name = |cache: &Option<CacheMode>| cache.map_or_else(|| "—".to_owned(), |cache| name(&cache));
    let rows: Vec<Vec<Cell>> = formats
        .iter()
        .map(|format| {
            let cells = caches.iter().map(|cache| match medians.get(&(*format, *cache)) {
                Some(&iops) => Cell::number(thousands(iops))
                    .attr("title", format!("{} · {}: {} IOPS", name(format), cache_name(cache), thousands(iops)))
                    .attr("style", heat(iops, best)),
                None => Cell::text("—"),
            });
            std::iter::once(Cell::text(name(format))).chain(cells).collect()
        })
        .collect();
    let head: Vec<String> =
        std::iter::once("format \\ cache".to_owned()).chain(caches.iter().map(cache_name)).collect();
    table(Some(id), &head.iter().map(String::as_str).collect::<Vec<_>>(), &rows)
}

/// A green background, the deeper the closer `iops` is to the table's best.
fn heat(iops: f64, best: f64) -> String {
    let share = if best > 0.0 { iops / best } else { 0.0 };
    format!("background-color: rgba(0, 158, 115, {:.2})", 0.08 + 0.5 * share)
}
