//! The report: one self-contained HTML page with plots, made from a results
//! file, in the shapes of the studies vsd answers: RSD's "mqX-Yjobs" bars of
//! IOPS, CPU and latency per daemon, a layer-by-layer latency table, and a
//! format × cache-mode matrix. Every plot has the figures it draws as a
//! table under it.

mod breakdown;
mod data;
mod figures;
mod grid;
mod group;
mod html;
mod plot;
mod stats;
mod summary;

use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::row::Row;
use figures::Daemons;
use group::{GUEST_NOTE, Run, Section, slug, title};
use html::{Page, escape};

/// Writes `out_dir/index.html` (self-contained: plots inlined as SVG) and
/// every plot also as `out_dir/<name>.svg`; returns the HTML path.
pub fn write_report(rows: &[Row], out_dir: &Path) -> Result<PathBuf> {
    let runs = Run::all(rows);
    let sections = group::sections(&runs);
    let daemons = Daemons::of(rows);
    let failures = summary::failures(rows);
    let mut page = Page::default();
    page.push(&summary::header(rows));
    page.push(&contents(&sections, !failures.is_empty()));
    for section in &sections {
        write_section(&mut page, section, &daemons)?;
    }
    page.push(&failures);
    page.write(&summary::title(rows), out_dir)
}

/// Links to the sections.
fn contents(sections: &[Section], has_failures: bool) -> String {
    let mut links: Vec<(String, String)> = sections.iter().map(|section| (section.id(), section.heading())).collect();
    if has_failures {
        links.push(("failures".to_owned(), "Failed runs".to_owned()));
    }
    let items: String =
        links.iter().map(|(id, text)| format!("<li><a href=\"#{}\">{}</a></li>\n", escape(id), escape(text))).collect();
    format!("<nav>\n<ul>\n{items}</ul>\n</nav>\n")
}

/// One matrix from one placement: its comparison figures, group by group,
/// then where the time went and the format × cache-mode tables.
fn write_section(page: &mut Page, section: &Section, daemons: &Daemons) -> Result<()> {
    let id = section.id();
    page.push(&format!("<section id=\"{}\">\n<h2>{}</h2>\n", escape(&id), escape(&section.heading())));
    if section.is_guest() {
        page.push(&format!("<p class=\"guest-note\">{}.</p>\n", escape(GUEST_NOTE)));
    }
    for (key, runs) in group::figure_groups(&section.runs) {
        let parts = key.parts();
        page.push(&format!("<h3>{}</h3>\n<div class=\"figures\">\n", escape(&title(&parts))));
        for comparison in figures::comparisons(section, &key, &runs, daemons) {
            let figure_id = format!("{id}-{}-{}", slug(&parts.join("-")), comparison.slug);
            page.figure(&figure_id, &comparison.caption, &comparison.chart)?;
        }
        page.push("</div>\n");
    }
    breakdown::write(page, section)?;
    grid::write(page, section);
    page.push("</section>\n");
    Ok(())
}
