//! "Where does the time go": vsd's own per-stage account of a request, set
//! against the latency the driver saw, as a stacked bar per configuration
//! and a layer-by-layer table.

use std::collections::BTreeMap;

use anyhow::Result;

use super::group::{Run, Section, first_appearances, grouped};
use super::html::{Cell, Page, escape, table};
use super::plot::{GREY, StackedChart, color};
use super::stats::median;
use crate::config::Config;
use crate::row::{Breakdown, Measured};

/// The events per I/O the runner counts, in the order the table shows them.
const EVENTS: [&str; 6] = ["kicks", "calls", "io_uring_enter", "wakeups", "poll_hits", "batches"];
const OUTSIDE: &str = "outside the daemon";
/// The stage in which the engine waits for the host's I/O (submit ->
/// complete): the kernel's and the device's time, which fio on the host
/// pays too. It and the time outside the daemon dwarf vsd's own stages.
const HOST_IO: &str = "complete";

/// One stage's mean time, the median over the repetitions.
struct Stage {
    name: String,
    label: String,
    mean_us: f64,
}

/// One configuration's account, medians over its repetitions.
struct Account {
    id: String,
    stages: Vec<Stage>,
    /// Kick noticed to guest notified.
    inside_us: f64,
    /// The mean latency the driver saw.
    client_us: f64,
    events: BTreeMap<String, f64>,
}

impl Account {
    /// The driver's latency less vsd's: the driver, libblkio or the guest,
    /// the kernel, and the notifications between them.
    fn outside_us(&self) -> f64 {
        (self.client_us - self.inside_us).max(0.0)
    }
}

/// Appends the section's breakdown, if any of its runs has one.
pub(crate) fn write(page: &mut Page, section: &Section) -> Result<()> {
    let accounts = accounts(&section.runs);
    if accounts.is_empty() {
        return Ok(());
    }
    let id = section.id();
    page.push("<h3>Where does the time go</h3>\n");
    let caption = "Where a request's time went, per configuration: vsd's stages from kick noticed to guest \
                   notified (mean per request, median over the repetitions), then the rest of the driver's \
                   mean latency, outside the daemon. The lower panel leaves out the host's I/O (submit -> \
                   complete) and the time outside, so that vsd's own stages get a scale of their own. The \
                   table gives every segment in µs.";
    page.figure(&format!("{id}-breakdown"), &section.caption(caption), &chart(section, &accounts))?;
    for account in &accounts {
        page.push(&format!(
            "<details>\n<summary>{}</summary>\n{}</details>\n",
            escape(&account.id),
            stage_table(account)
        ));
    }
    page.push("<p>Costly events per request (kicks are guest exits, calls interrupts):</p>\n");
    let events_id = page.unique_id(&format!("{id}-events"));
    page.push(&events_table(&events_id, &accounts));
    Ok(())
}

/// The accounts of the configurations with a breakdown, in order of appearance.
fn accounts(runs: &[Run]) -> Vec<Account> {
    let reps = runs.iter().filter_map(|run| Some((run.config(), (run.measured, run.measured.breakdown.as_ref()?))));
    grouped(reps).into_iter().map(|(config, reps)| account(config, &reps)).collect()
}

fn account(config: &Config, reps: &[(&Measured, &Breakdown)]) -> Account {
    let stages =
        first_appearances(reps.iter().flat_map(|(_, breakdown)| &breakdown.stages).map(|s| (&s.name, &s.label)));
    let stages = stages
        .into_iter()
        .map(|(name, label)| {
            let mean_us = median_over(reps, |_, b| Some(b.stages.iter().find(|s| s.name == *name)?.mean_us));
            Stage { name: name.clone(), label: label.clone(), mean_us }
        })
        .collect();
    let events = first_appearances(reps.iter().flat_map(|(_, breakdown)| breakdown.events_per_io.keys()));
    Account {
        id: config.id(),
        stages,
        inside_us: median_over(reps, |_, b| Some(b.total_mean_us)),
        client_us: median_over(reps, |measured, _| Some(measured.lat_us.mean)),
        events: events
            .into_iter()
            .map(|name| (name.clone(), median_over(reps, |_, b| b.events_per_io.get(name).copied())))
            .collect(),
    }
}

/// The median of `value` over the repetitions that have it.
fn median_over(reps: &[(&Measured, &Breakdown)], value: impl Fn(&Measured, &Breakdown) -> Option<f64>) -> f64 {
    median(reps.iter().filter_map(|(measured, breakdown)| value(measured, breakdown))).unwrap_or(0.0)
}

fn chart(section: &Section, accounts: &[Account]) -> StackedChart {
    let names = first_appearances(accounts.iter().flat_map(|account| &account.stages).map(|s| (&s.name, &s.label)));
    let mut segments: Vec<_> =
        names.iter().enumerate().map(|(i, (name, label))| (format!("{name}: {label}"), color(i))).collect();
    segments.push((OUTSIDE.to_owned(), GREY));
    let ids: Vec<&str> = accounts.iter().map(|account| account.id.as_str()).collect();
    let stacks = distinguishing(&ids)
        .into_iter()
        .zip(accounts)
        .map(|(label, account)| {
            let stage_us = |name: &str| account.stages.iter().find(|s| s.name == name).map_or(0.0, |s| s.mean_us);
            let mut values: Vec<f64> = names.iter().map(|(name, _)| stage_us(name)).collect();
            values.push(account.outside_us());
            (label, values)
        })
        .collect();
    let own: Vec<usize> = (0..names.len()).filter(|&i| names[i].0 != HOST_IO).collect();
    let mut panels = vec![("The whole request".to_owned(), (0..segments.len()).collect())];
    if !own.is_empty() {
        panels.push(("vsd's own stages, on their own scale".to_owned(), own));
    }
    StackedChart {
        title: section.plot_title(&format!("Where the time goes · {}", section.matrix)),
        x_desc: "µs per request (mean)".to_owned(),
        segments,
        stacks,
        panels,
    }
}

/// The parts of each slash-separated id that tell it from the others: the
/// rest is the same for all and would only widen the labels.
fn distinguishing(ids: &[&str]) -> Vec<String> {
    let split: Vec<Vec<&str>> = ids.iter().map(|id| id.split('/').collect()).collect();
    let varies = |i: usize| split.iter().any(|parts| parts.get(i) != split[0].get(i));
    split
        .iter()
        .zip(ids)
        .map(|(parts, id)| {
            let kept: Vec<&str> = parts.iter().enumerate().filter(|(i, _)| varies(*i)).map(|(_, part)| *part).collect();
            if kept.is_empty() { id.to_string() } else { kept.join("/") }
        })
        .collect()
}

/// Layer by layer: each stage's time, the running total, and its share of
/// the latency the driver saw.
fn stage_table(account: &Account) -> String {
    let share =
        |us: f64| if account.client_us > 0.0 { format!("{:.1}", 100.0 * us / account.client_us) } else { "—".into() };
    let mut cumulative = 0.0;
    let mut row = |name: &str, between: &str, us: f64| {
        cumulative += us;
        vec![
            Cell::text(name),
            Cell::text(between),
            Cell::number(format!("{us:.1}")),
            Cell::number(format!("{cumulative:.1}")),
            Cell::number(share(us)),
        ]
    };
    let mut rows: Vec<Vec<Cell>> =
        account.stages.iter().map(|stage| row(&stage.name, &stage.label, stage.mean_us)).collect();
    rows.push(row(OUTSIDE, "driver latency − vsd's total", account.outside_us()));
    rows.push(vec![
        Cell::text("driver latency"),
        Cell::text("submitted -> completed"),
        Cell::number(format!("{:.1}", account.client_us)),
        Cell::text(""),
        Cell::number(share(account.client_us)),
    ]);
    table(None, &["stage", "between", "mean µs", "cumulative µs", "share of driver latency %"], &rows)
}

/// Events per request, one row per configuration: the known events first,
/// then any others the runner recorded.
fn events_table(id: &str, accounts: &[Account]) -> String {
    let recorded = accounts.iter().flat_map(|account| account.events.keys().map(String::as_str));
    let columns = first_appearances(EVENTS.into_iter().chain(recorded));
    let rows: Vec<Vec<Cell>> = accounts
        .iter()
        .map(|account| {
            let counts = columns.iter().map(|name| match account.events.get(*name) {
                Some(count) => Cell::number(format!("{count:.2}")),
                None => Cell::text("—"),
            });
            std::iter::once(Cell::text(&account.id)).chain(counts).collect()
        })
        .collect();
    let head: Vec<&str> = std::iter::once("configuration").chain(columns.iter().copied()).collect();
    table(Some(id), &head, &rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_keep_only_what_differs() {
        let ids = ["vsd/tmpfs/mq1-1jobs/4k", "vsd-nopoll/tmpfs/mq2-1jobs/4k"];
        assert_eq!(distinguishing(&ids), ["vsd/mq1-1jobs", "vsd-nopoll/mq2-1jobs"]);
        assert_eq!(distinguishing(&["vsd/tmpfs"]), ["vsd/tmpfs"]);
    }
}
