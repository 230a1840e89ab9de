//! `query-commands` and `query-qmp-schema` of vsd beside those of
//! qemu-storage-daemon: vsd has every command QSD has, and everything vsd
//! declares (commands, their arguments with their types and optionality,
//! events) QSD declares alike, unless it carries QEMU's `unstable`
//! feature (vsd's own). What QSD has and vsd does not (arguments, drivers,
//! enum values) is listed when the test runs; `GAPS` counts it so that
//! nothing is lost or gained unseen.

mod common;

use std::collections::{BTreeSet, HashMap, HashSet};

use common::qmp::Qmp;
use common::{Daemon, Scratch, monitor};
use serde_json::{Value, json};

/// What QSD declares that vsd does not: the number the last count found.
/// A change either way must be looked at (and the number moved with it).
const GAPS: usize = 0;

struct Schema(HashMap<String, Value>);

impl Schema {
    fn read(qmp: &mut Qmp) -> Self {
        let entities = qmp.ok("query-qmp-schema", json!({}));
        Self(entities.as_array().unwrap().iter().map(|e| (e["name"].as_str().unwrap().to_string(), e.clone())).collect())
    }

    fn get(&self, name: &str) -> &Value {
        self.0.get(name).unwrap_or_else(|| panic!("the schema names '{name}' and lacks it"))
    }

    fn of(&self, meta_type: &str) -> BTreeSet<String> {
        self.0.values().filter(|e| e["meta-type"] == meta_type).map(|e| e["name"].as_str().unwrap().into()).collect()
    }
}

/// Walks vsd's schema beside QSD's from the same command or event.
struct Comparison<'a> {
    vsd: &'a Schema,
    qsd: &'a Schema,
    seen: HashSet<(String, String)>,
    /// vsd declares it differently from QSD, or QSD lacks it.
    differences: Vec<String>,
    /// QSD declares it, vsd does not.
    gaps: Vec<String>,
}

fn unstable(entity: &Value) -> bool {
    entity["features"].as_array().is_some_and(|f| f.contains(&json!("unstable")))
}

/// An object's members with those of its variants, by name, as
/// (member, the case it belongs to).
fn members<'a>(schema: &'a Schema, object: &'a Value) -> Vec<(&'a Value, Option<&'a str>)> {
    let mut all: Vec<_> = object["members"].as_array().into_iter().flatten().map(|m| (m, None)).collect();
    for variant in object["variants"].as_array().into_iter().flatten() {
        let case = variant["case"].as_str();
        let variant = schema.get(variant["type"].as_str().unwrap());
        all.extend(variant["members"].as_array().into_iter().flatten().map(|m| (m, case)));
    }
    all
}

impl Comparison<'_> {
    fn types(&mut self, vsd: &str, qsd: &str, path: &str) {
        if !self.seen.insert((vsd.to_string(), qsd.to_string())) {
            return;
        }
        let (v, q) = (self.vsd.get(vsd), self.qsd.get(qsd));
        let meta = v["meta-type"].as_str().unwrap();
        if meta != q["meta-type"] {
            self.differences.push(format!("{path}: a {meta} in vsd, a {} in QSD", q["meta-type"]));
            return;
        }
        match meta {
            "builtin" if vsd != qsd => self.differences.push(format!("{path}: {vsd} in vsd, {qsd} in QSD")),
            "enum" => {
                let values = |e: &Value| -> BTreeSet<String> {
                    e["values"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect()
                };
                let (v, q) = (values(v), values(q));
                for extra in v.difference(&q) {
                    self.differences.push(format!("{path}: value '{extra}' is not QSD's"));
                }
                for missing in q.difference(&v) {
                    self.gaps.push(format!("{path}: value '{missing}'"));
                }
            }
            "array" => {
                let (v, q) = (v["element-type"].as_str().unwrap(), q["element-type"].as_str().unwrap());
                self.types(v, q, &format!("{path}[]"));
            }
            "object" => self.objects(v, q, path),
            "alternate" => {
                let kinds = |schema: &Schema, e: &Value| -> Vec<(String, String)> {
                    let types = e["members"].as_array().unwrap().iter().map(|m| m["type"].as_str().unwrap());
                    types.map(|t| (schema.get(t)["meta-type"].as_str().unwrap().to_string(), t.to_string())).collect()
                };
                let theirs = kinds(self.qsd, q);
                for (kind, v_type) in kinds(self.vsd, v) {
                    match theirs.iter().find(|(k, q_type)| *k == kind && (kind != "builtin" || *q_type == v_type)) {
                        Some((_, q_type)) => self.types(&v_type, q_type, &format!("{path}|{kind}")),
                        None => self.differences.push(format!("{path}: alternative {kind} {v_type} is not QSD's")),
                    }
                }
            }
            _ => {}
        }
    }

    fn objects(&mut self, v: &Value, q: &Value, path: &str) {
        let theirs = members(self.qsd, q);
        let ours = members(self.vsd, v);
        for (member, case) in &ours {
            let name = member["name"].as_str().unwrap();
            let at = match case {
                Some(case) => format!("{path}.{case}:{name}"),
                None => format!("{path}.{name}"),
            };
            let found = theirs.iter().find(|(m, c)| m["name"] == name && (c.is_none() || c == case));
            match found {
                None if unstable(member) => {}
                None => self.differences.push(format!("{at}: not QSD's (mark it unstable if it is vsd's own)")),
                Some((theirs, _)) => {
                    if member.get("default").is_some() != theirs.get("default").is_some() {
                        self.differences.push(format!("{at}: optional in one of vsd and QSD only"));
                    }
                    let (v_type, q_type) = (member["type"].as_str().unwrap(), theirs["type"].as_str().unwrap());
                    self.types(v_type, q_type, &at);
                }
            }
        }
        for (member, case) in &theirs {
            let name = member["name"].as_str().unwrap();
            let known_case = case.is_none() || ours.iter().any(|(_, c)| c == case) || self.has_case(v, case.unwrap());
            if known_case && !ours.iter().any(|(m, c)| m["name"] == name && (c.is_none() || c == case)) {
                let at = case.map_or_else(|| format!("{path}.{name}"), |case| format!("{path}.{case}:{name}"));
                self.gaps.push(at);
            }
        }
    }

    fn has_case(&self, object: &Value, case: &str) -> bool {
        object["variants"].as_array().into_iter().flatten().any(|v| v["case"] == case)
    }
}

#[test]
fn vsd_has_every_command_of_qsd_and_declares_what_it_has_as_qsd_does() {
    let dir = Scratch::new("schema");
    let _vsd = Daemon::vsd(&dir, &monitor(&dir.path("vsd.sock")));
    let _qsd = Daemon::qsd(&dir, &monitor(&dir.path("qsd.sock")));
    let (mut vsd_qmp, mut qsd_qmp) = (Qmp::connect(&dir.path("vsd.sock")), Qmp::connect(&dir.path("qsd.sock")));
    let (vsd, qsd) = (Schema::read(&mut vsd_qmp), Schema::read(&mut qsd_qmp));

    let listed = |qmp: &mut Qmp| -> BTreeSet<String> {
        let commands = qmp.ok("query-commands", json!({}));
        commands.as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap().to_string()).collect()
    };
    let (vsd_commands, qsd_commands) = (listed(&mut vsd_qmp), listed(&mut qsd_qmp));
    assert_eq!(vsd_commands, vsd.of("command"), "query-commands and query-qmp-schema list the same commands");
    let missing: Vec<_> = qsd_commands.iter().filter(|c| !c.starts_with("x-") && !vsd_commands.contains(*c)).collect();

    let mut comparison =
        Comparison { vsd: &vsd, qsd: &qsd, seen: HashSet::new(), differences: Vec::new(), gaps: Vec::new() };
    for kind in ["command", "event"] {
        for name in vsd.of(kind) {
            let ours = vsd.get(&name);
            match qsd.0.get(&name) {
                None if unstable(ours) => {}
                None => comparison.differences.push(format!("{kind} {name}: not QSD's")),
                Some(theirs) => {
                    let (v, q) = (ours["arg-type"].as_str().unwrap(), theirs["arg-type"].as_str().unwrap());
                    comparison.types(v, q, &name);
                }
            }
        }
    }
    let Comparison { differences, gaps, .. } = comparison;
    for gap in &gaps {
        println!("QSD has, vsd not yet: {gap}");
    }
    assert!(differences.is_empty(), "vsd declares differently from QSD:\n{}", differences.join("\n"));
    assert!(missing.is_empty(), "commands of QSD vsd lacks: {missing:?}");
    assert_eq!(gaps.len(), GAPS, "what QSD has and vsd lacks changed (listed above)");
}
