//! The HTML page: escaping, tables, figures, and the files written at the end.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use super::plot::Plot;

/// Inline, so the report is one file that renders offline.
const STYLE: &str = "\
body { font-family: sans-serif; color: #222; max-width: 1500px; margin: 1.5rem auto; padding: 0 1rem; }
h2 { border-bottom: 2px solid #ccc; padding-bottom: .2rem; margin-top: 2.5rem; }
.figures { display: flex; flex-wrap: wrap; gap: 1rem; align-items: flex-start; }
figure { display: table; margin: 0 0 1rem; }
figcaption { display: table-caption; caption-side: bottom; font-size: .9rem; color: #444; padding-top: .3rem; }
svg.plot { display: block; max-width: 100%; height: auto; }
table { border-collapse: collapse; margin: .5rem 0 1rem; }
th, td { border: 1px solid #ccc; padding: .2rem .6rem; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure table { font-size: .85rem; margin: .4rem 0 0; }
.guest-note { background: #fff3cd; border-left: 4px solid #e0a800; padding: .4rem .8rem; }
";

/// `text` safe inside HTML elements and quoted attributes.
pub(crate) fn escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => escaped.push_str("&amp;"),
            '<' => escaped.push_str("&lt;"),
            '>' => escaped.push_str("&gt;"),
            '"' => escaped.push_str("&quot;"),
            '\'' => escaped.push_str("&#39;"),
            c => escaped.push(c),
        }
    }
    escaped
}

/// `1234567.8` -> "1,234,568": whole numbers readable at a glance.
pub(crate) fn thousands(value: f64) -> String {
    let digits = format!("{:.0}", value.abs());
    let mut grouped = String::new();
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            grouped.push(',');
        }
        grouped.push(digit);
    }
    if value.round() < 0.0 { format!("-{grouped}") } else { grouped }
}

/// One table cell: its text and attributes, escaped when written.
pub(crate) struct Cell {
    text: String,
    attrs: Vec<(&'static str, String)>,
}

impl Cell {
    pub fn text(text: impl Into<String>) -> Self {
        Cell { text: text.into(), attrs: Vec::new() }
    }

    /// A right-aligned figure.
    pub fn number(text: impl Into<String>) -> Self {
        Cell::text(text).attr("class", "num")
    }

    pub fn attr(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.attrs.push((name, value.into()));
        self
    }

    fn html(&self) -> String {
        let attrs: String = self.attrs.iter().map(|(name, value)| format!(" {name}=\"{}\"", escape(value))).collect();
        format!("<td{attrs}>{}</td>", escape(&self.text))
    }
}

/// A table with a header row; `id` names it for links and tests.
pub(crate) fn table(id: Option<&str>, head: &[&str], rows: &[Vec<Cell>]) -> String {
    let id = id.map(|id| format!(" id=\"{}\"", escape(id))).unwrap_or_default();
    let head: String = head.iter().map(|title| format!("<th>{}</th>", escape(title))).collect();
    let body: String =
        rows.iter().map(|row| format!("<tr>{}</tr>\n", row.iter().map(Cell::html).collect::<String>())).collect();
    format!("<table{id}>\n<tr>{head}</tr>\n{body}</table>\n")
}

/// The report being built: its body, and the plots to save beside it.
#[derive(Default)]
pub(crate) struct Page {
    body: String,
    plots: Vec<(String, String)>,
    ids: HashSet<String>,
}

impl Page {
    /// Appends HTML the caller has escaped.
    pub fn push(&mut self, html: &str) {
        self.body.push_str(html);
    }

    /// `id`, or `id-2`, `id-3`...: ids name files, so two must never clash.
    pub fn unique_id(&mut self, id: &str) -> String {
        let mut unique = id.to_owned();
        let mut n = 1;
        while !self.ids.insert(unique.clone()) {
            n += 1;
            unique = format!("{id}-{n}");
        }
        unique
    }

    /// Appends a figure: the plot's SVG (trusted: plotters escapes its
    /// text), its figures as a table with id `ID-data`, and the caption.
    pub fn figure(&mut self, id: &str, caption: &str, plot: &dyn Plot) -> Result<()> {
        let id = self.unique_id(id);
        let svg = plot.svg()?;
        self.body.push_str(&format!(
            "<figure id=\"{}\">\n{svg}{}<figcaption>{}</figcaption>\n</figure>\n",
            escape(&id),
            plot.table(&format!("{id}-data")),
            escape(caption)
        ));
        self.plots.push((id, svg));
        Ok(())
    }

    /// Writes `out_dir/index.html` and every plot as `out_dir/<id>.svg`.
    pub fn write(self, title: &str, out_dir: &Path) -> Result<PathBuf> {
        fs::create_dir_all(out_dir).with_context(|| format!("cannot create '{}'", out_dir.display()))?;
        for (id, svg) in &self.plots {
            write_file(&out_dir.join(format!("{id}.svg")), svg)?;
        }
        let html = format!(
            "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>{}</title>\n\
             <style>\n{STYLE}</style>\n</head>\n<body>\n{}</body>\n</html>\n",
            escape(title),
            self.body
        );
        let path = out_dir.join("index.html");
        write_file(&path, &html)?;
        Ok(path)
    }
}

fn write_file(path: &Path, contents: &str) -> Result<()> {
    fs::write(path, contents).with_context(|| format!("cannot write '{}'", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_escaped() {
        assert_eq!(escape("<a href=\"x\">&'</a>"), "&lt;a href=&quot;x&quot;&gt;&amp;&#39;&lt;/a&gt;");
    }

    #[test]
    fn thousands_are_grouped() {
        assert_eq!(thousands(1234567.8), "1,234,568");
        assert_eq!(thousands(999.0), "999");
        assert_eq!(thousands(-1000.0), "-1,000");
        assert_eq!(thousands(0.2), "0");
    }

    #[test]
    fn ids_never_clash() {
        let mut page = Page::default();
        assert_eq!(page.unique_id("a"), "a");
        assert_eq!(page.unique_id("a"), "a-2");
        assert_eq!(page.unique_id("a"), "a-3");
    }
}
