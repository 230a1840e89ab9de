//! The report's head (what ran, where) and its list of failed runs.

use super::group::first_appearances;
use super::html::{Cell, escape, table};
use crate::row::{Machine, Row};

/// A fact about the machine, and how to read it from [`Machine`].
type Fact = (&'static str, fn(&Machine) -> String);

const FACTS: [Fact; 9] = [
    ("CPU", |m| m.cpu_model.clone()),
    ("online CPUs", |m| m.cpus.to_string()),
    ("memory", |m| format!("{:.1} GiB", m.mem_gib)),
    ("kernel", |m| m.kernel.clone()),
    ("clock source", |m| m.clocksource.clone()),
    ("vsd", |m| m.vsd_version.clone()),
    ("qemu-storage-daemon", |m| m.qemu_version.clone()),
    ("fio", |m| m.fio_version.clone()),
    ("disk back-end's file system", |m| m.disk_fs.clone()),
];

/// The page's title: the specs it reports.
pub(crate) fn title(rows: &[Row]) -> String {
    format!("vsd-lab report: {}", joined(rows.iter().map(|row| row.spec.clone())))
}

/// What ran, how often, and on what.
pub(crate) fn header(rows: &[Row]) -> String {
    let failed = rows.iter().filter(|row| row.error.is_some()).count();
    let configurations = first_appearances(rows.iter().map(|row| (&row.matrix, &row.id))).len();
    let matrices = first_appearances(rows.iter().map(|row| &row.matrix)).len();
    let counts = format!(
        "{} runs ({failed} failed) of {configurations} configurations in {matrices} matrices. Figures show the \
         median over each configuration's repetitions, whiskers their range.",
        rows.len()
    );
    let facts: Vec<Vec<Cell>> = FACTS
        .iter()
        .map(|(fact, read)| vec![Cell::text(*fact), Cell::text(joined(rows.iter().map(|row| read(&row.machine))))])
        .collect();
    format!(
        "<header>\n<h1>{}</h1>\n<p>{}</p>\n<p>{}</p>\n{}</header>\n",
        escape(&title(rows)),
        escape(&counts),
        escape(&pinning(rows)),
        table(Some("machine"), &["machine", "value"], &facts)
    )
}

/// Where the daemon and the driver ran: pinned apart, they do not compete
/// for a CPU.
fn pinning(rows: &[Row]) -> String {
    let placement = |cpus: fn(&Machine) -> &String| {
        let cpus = distinct(rows.iter().map(|row| cpus(&row.machine).clone()));
        if cpus.is_empty() { "was not pinned".to_owned() } else { format!("was pinned to CPUs {}", cpus.join(", ")) }
    };
    format!("The daemon {}; the driver {}.", placement(|m| &m.daemon_cpus), placement(|m| &m.client_cpus))
}

/// The failed runs, with why; empty when none failed.
pub(crate) fn failures(rows: &[Row]) -> String {
    let failed: Vec<Vec<Cell>> = rows
        .iter()
        .filter_map(|row| {
            let error = row.error.as_ref()?;
            Some(vec![
                Cell::text(&row.matrix),
                Cell::text(&row.id),
                Cell::number(row.rep.to_string()),
                Cell::text(error),
            ])
        })
        .collect();
    if failed.is_empty() {
        return String::new();
    }
    format!(
        "<section id=\"failures\">\n<h2>Failed runs</h2>\n{}</section>\n",
        table(Some("failed"), &["matrix", "configuration", "rep", "error"], &failed)
    )
}

/// The distinct non-empty values, in order of appearance.
fn distinct(values: impl Iterator<Item = String>) -> Vec<String> {
    first_appearances(values.filter(|value| !value.is_empty()))
}

/// The distinct non-empty values, or "—" for none.
fn joined(values: impl Iterator<Item = String>) -> String {
    let values = distinct(values);
    if values.is_empty() { "—".to_owned() } else { values.join(", ") }
}
