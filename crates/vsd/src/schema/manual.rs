//! The manual's reference lists against the code's own tables: each
//! driver, export type, object type and the NBD server has an `Options:`
//! line on its page under a heading naming it, and the line names exactly
//! the options the schema declares (which `every_option_a_driver_reads_is_described`
//! and its twins tie to the code that reads them). The command line's
//! list is checked against clap's.

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::Value;

use super::*;

type Names = BTreeSet<String>;

fn page(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/manual").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The names in backquotes in `text`.
fn quoted(text: &str) -> Names {
    text.split('`').skip(1).step_by(2).map(String::from).collect()
}

/// Each heading of `page` (at any level) with the names its first
/// `Options:` line gives, in the order of the page.
fn documented(page: &str) -> Vec<(Names, Names)> {
    let mut found = Vec::new();
    let mut heading = None;
    for line in page.lines() {
        if line.starts_with('#') {
            heading = Some(quoted(line));
        } else if let Some(list) = line.strip_prefix("Options: ")
            && let Some(names) = heading.take()
        {
            found.push((names, quoted(list)));
        }
    }
    found
}

/// The options the heading naming `item` lists on `page`.
fn options_of(page: &str, item: &str) -> Option<Names> {
    documented(page).into_iter().find(|(names, _)| names.contains(item)).map(|(_, options)| options)
}

fn members(schema: &Value) -> Names {
    flattened(schema).into_iter().map(|(name, _)| name).collect()
}

/// What the cases of `union` have in common and what each has of its own,
/// against what `page` lists: the differences, both ways.
fn drift(page_name: &str, union: &Value, tag: &str, cases: &[&str], common_heading: Option<&str>) -> Vec<String> {
    let text = page(page_name);
    let all: Vec<Names> =
        cases.iter().map(|c| members(case(union, tag, c)).into_iter().filter(|m| m != tag).collect()).collect();
    let shared: Names = match common_heading {
        Some(_) => all.iter().skip(1).fold(all[0].clone(), |acc, m| acc.intersection(m).cloned().collect()),
        None => Names::new(),
    };
    let mut problems = Vec::new();
    let mut compare = |what: String, code: &Names, listed: Option<Names>| match listed {
        None => problems.push(format!("{page_name}: no heading naming {what} with an Options: line")),
        Some(listed) => {
            for missing in code.difference(&listed) {
                problems.push(format!("{page_name}: {what} lacks `{missing}`"));
            }
            for extra in listed.difference(code) {
                problems.push(format!("{page_name}: {what} lists `{extra}`, which the code lacks"));
            }
        }
    };
    if let Some(heading) = common_heading {
        let listed = text
            .split(&format!("## {heading}\n"))
            .nth(1)
            .and_then(|rest| rest.lines().find_map(|l| l.strip_prefix("Options: ")).map(quoted));
        compare(format!("'{heading}'"), &shared, listed);
    }
    for (kind, own) in cases.iter().zip(&all) {
        let own: Names = own.difference(&shared).cloned().collect();
        compare(format!("`{kind}`"), &own, options_of(&text, kind));
    }
    // Every heading with an Options: line names something the code has.
    for (names, _) in documented(&text) {
        for name in names.iter().filter(|n| !cases.contains(&n.as_str())) {
            problems.push(format!("{page_name}: a heading names `{name}`, which the code lacks"));
        }
    }
    problems
}

#[test]
fn the_block_nodes_page_lists_every_driver_and_its_options() {
    let common = Some("Options every node takes");
    let problems = drift("block-nodes.md", &blockdev_union(), "driver", vsd_block::DRIVERS, common);
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn the_exports_page_lists_every_export_type_and_its_options() {
    let union = block_export_options(&mut Introspection::new());
    let common = Some("Options every export takes");
    let problems = drift("exports.md", &union, "type", crate::daemon::EXPORT_TYPES, common);
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn the_objects_page_lists_every_object_type_and_its_properties() {
    let union = object_options(&mut Introspection::new());
    // `id` aside, which every object has; QEMU's `x-` spellings of the
    // throttle limits stay undocumented, as in QEMU.
    let problems: Vec<String> = drift("objects.md", &union, "qom-type", crate::objects::TYPES, None)
        .into_iter()
        .filter(|p| !p.ends_with("lacks `id`") && !p.contains("lacks `x-"))
        .collect();
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn the_nbd_page_lists_every_server_option() {
    let server = nbd_server_options(&mut Introspection::new());
    let code: Names = server["properties"].as_object().unwrap().keys().cloned().collect();
    let listed = options_of(&page("nbd.md"), "--nbd-server").expect("nbd.md: no `--nbd-server` Options: line");
    assert_eq!(listed, code, "nbd.md's `--nbd-server` options");
}

#[test]
fn the_command_line_page_lists_every_option() {
    let code: Names = crate::cli()
        .get_arguments()
        .filter_map(|arg| arg.get_long())
        .filter(|long| !["help", "version"].contains(long))
        .map(|long| format!("--{long}"))
        .collect();
    let text = page("command-line.md");
    let listed =
        text.lines().find_map(|l| l.strip_prefix("Options: ")).map(quoted).expect("command-line.md: no Options: line");
    assert_eq!(listed, code, "command-line.md's options against `vsd --help`");
}
