//! `query-commands` and `query-qmp-schema` of vsd beside those of
//! qemu-storage-daemon: vsd has every command QSD has, and everything vsd
//! declares (commands, their arguments with their types and optionality,
//! what they return, events) QSD declares alike, unless it carries QEMU's
//! `unstable` feature (vsd's own); and vsd returns every member QSD
//! always returns. What QSD has and vsd does not (arguments, drivers,
//! enum values) is listed when the test runs; `GAPS` counts it so that
//! nothing is lost or gained unseen.

mod common;

use std::collections::{BTreeSet, HashMap, HashSet};

use common::qmp::Qmp;
use common::{Daemon, Scratch, monitor};
use serde_json::{Value, json};

/// What QSD declares that vsd does not: the number the last count found.
/// A change either way must be looked at (and the number moved with it).
const GAPS: usize = 204;

struct Schema(HashMap<String, Value>);

impl Schema {
    fn read(qmp: &mut Qmp) -> Self {
        let entities = qmp.ok("query-qmp-schema", json!({}));
        Self(
            entities.as_array().unwrap().iter().map(|e| (e["name"].as_str().unwrap().to_string(), e.clone())).collect(),
        )
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
    seen: HashSet<(String, String, bool)>,
    /// Walking what a command returns: every member QSD always returns
    /// vsd must return too.
    returns: bool,
    /// vsd declares it differently from QSD, or QSD lacks it.
    differences: Vec<String>,
    /// QSD declares it, vsd does not.
    gaps: Vec<String>,
}

fn unstable(entity: &Value) -> bool {
    entity["features"].as_array().is_some_and(|f| f.contains(&json!("unstable")))
}

/// An object's members, by case: the base's alone (`None`) for a
/// struct, the base's with each variant's for a union.
fn views<'a>(schema: &'a Schema, object: &'a Value) -> Vec<(Option<&'a str>, Vec<&'a Value>)> {
    let base: Vec<&Value> = object["members"].as_array().into_iter().flatten().collect();
    let Some(variants) = object["variants"].as_array() else {
        return vec![(None, base)];
    };
    let view = |variant: &'a Value| {
        let own = schema.get(variant["type"].as_str().unwrap())["members"].as_array();
        (variant["case"].as_str(), base.iter().copied().chain(own.into_iter().flatten()).collect())
    };
    variants.iter().map(view).collect()
}

impl Comparison<'_> {
    fn types(&mut self, vsd: &str, qsd: &str, path: &str) {
        if !self.seen.insert((vsd.to_string(), qsd.to_string(), self.returns)) {
            return;
        }
        let (v, q) = (self.vsd.get(vsd), self.qsd.get(qsd));
        let meta = v["meta-type"].as_str().unwrap();
        if (vsd == "any" && qsd != "any") || (vsd == "str" && q["meta-type"] == "enum") {
            self.gaps.push(format!("{path}: vsd takes any {vsd}, QSD a {qsd}"));
            return;
        }
        if meta != "alternate" && q["meta-type"] == "alternate" {
            // One of QSD's alternatives.
            let alternatives = q["members"].as_array().unwrap().iter().map(|m| m["type"].as_str().unwrap());
            let same_kind = |t: &&str| self.qsd.get(t)["meta-type"] == meta && (meta != "builtin" || *t == vsd);
            match alternatives.clone().find(same_kind) {
                Some(q_type) => self.types(vsd, q_type, path),
                None => self.differences.push(format!("{path}: a {meta} in vsd, none of QSD's alternatives")),
            }
            self.gaps.extend(alternatives.filter(|t| !same_kind(t)).map(|t| format!("{path}: alternative {t}")));
            return;
        }
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
        let theirs = views(self.qsd, q);
        for (case, ours) in views(self.vsd, v) {
            let at = |name: &str| case.map_or_else(|| format!("{path}.{name}"), |case| format!("{path}.{case}:{name}"));
            // A case QSD lacks is a value of the tag's enum QSD lacks.
            let Some((_, their_members)) = theirs.iter().find(|(c, _)| *c == case) else { continue };
            for member in &ours {
                let name = member["name"].as_str().unwrap();
                match their_members.iter().find(|m| m["name"] == name) {
                    None if unstable(member) => {}
                    None => self.differences.push(format!("{}: not QSD's (mark it unstable if vsd's own)", at(name))),
                    Some(theirs) => {
                        let (ours_optional, theirs_optional) =
                            (member.get("default").is_some(), theirs.get("default").is_some());
                        // vsd may always return what QSD returns at times.
                        let fine = ours_optional == theirs_optional || (self.returns && theirs_optional);
                        if !fine {
                            self.differences.push(format!("{}: optional in one of vsd and QSD only", at(name)));
                        }
                        let (v_type, q_type) = (member["type"].as_str().unwrap(), theirs["type"].as_str().unwrap());
                        self.types(v_type, q_type, &at(name));
                    }
                }
            }
            for member in their_members {
                let name = member["name"].as_str().unwrap();
                match ours.iter().any(|m| m["name"] == name) {
                    true => {}
                    false if self.returns && member.get("default").is_none() => {
                        self.differences.push(format!("{}: QSD always returns it, vsd does not", at(name)));
                    }
                    false => self.gaps.push(at(name)),
                }
            }
        }
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

    let mut comparison = Comparison {
        vsd: &vsd,
        qsd: &qsd,
        seen: HashSet::new(),
        returns: false,
        differences: Vec::new(),
        gaps: Vec::new(),
    };
    for kind in ["command", "event"] {
        for name in vsd.of(kind) {
            let ours = vsd.get(&name);
            match qsd.0.get(&name) {
                None if unstable(ours) => {}
                None => comparison.differences.push(format!("{kind} {name}: not QSD's")),
                Some(theirs) => {
                    let (v, q) = (ours["arg-type"].as_str().unwrap(), theirs["arg-type"].as_str().unwrap());
                    comparison.returns = false;
                    comparison.types(v, q, &name);
                    if let (Some(v), Some(q)) = (ours["ret-type"].as_str(), theirs["ret-type"].as_str()) {
                        comparison.returns = true;
                        comparison.types(v, q, &format!("{name} ->"));
                    }
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

/// docs/manual/qmp.md names every command vsd lists, each in backquotes.
#[test]
fn the_manual_names_every_command() {
    let dir = Scratch::new("schema-manual");
    let _vsd = Daemon::vsd(&dir, &monitor(&dir.path("vsd.sock")));
    let commands = Qmp::connect(&dir.path("vsd.sock")).ok("query-commands", json!({}));
    let manual = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/manual/qmp.md")).unwrap();
    let missing: Vec<&str> = commands
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .filter(|name| !manual.contains(&format!("`{name}`")))
        .collect();
    assert!(missing.is_empty(), "docs/manual/qmp.md does not name {missing:?}");
}
