//! Making nodes read-only or writable: QMP `blockdev-reopen` as QEMU has
//! it, for the options vsd changes (`read-only`, and `backing`: another
//! node, or null for none; every other option is given again as it is),
//! and [`set_read_only_tree`] for a job that writes into a read-only image
//! (a commit into a backing file).
//!
//! A `blockdev-reopen` is all or nothing: every entry is checked before
//! any node changes, writable nodes change children first and read-only
//! ones parents first, and a failure part-way undoes what was done. The
//! exports of the nodes that changed then restart on them, so that their
//! queues see the node as it now is. A new backing node changes the graph
//! only, as in QEMU: the image's header keeps the backing file it names.

use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use serde_json::{Map, Value, json};
use vsd_block::options::{OptionError, OptionMap};
use vsd_block::{BlockGraph, BlockNode, CHILD_ROLES, InactiveChild, LockError};
use vsd_control::qmp::QmpError;
use vsd_qcow2::header::Header;

use crate::chain::{backing_of, image_filename};
use crate::daemon::{Daemon, State};
use crate::writers::switch_exports;

type Node = Arc<dyn BlockNode>;

/// Makes `node` writable, its `file` and `data-file` children (and theirs)
/// first, or read-only, the node first; its backing chain stays as it is.
/// On a failure part-way, what was done is undone.
pub(crate) fn set_read_only_tree(node: &Node, read_only: bool) -> Result<(), String> {
    let mut done = Vec::new();
    change_tree(node, read_only, &mut done).inspect_err(|_| {
        for node in done.iter().rev() {
            put_back(node, read_only);
        }
    })
}

fn change_tree(node: &Node, read_only: bool, done: &mut Vec<Node>) -> Result<(), String> {
    if read_only {
        change(node, true, done)?;
    }
    for child in stored_in(node) {
        change_tree(&child, read_only, done)?;
    }
    if !read_only {
        change(node, false, done)?;
    }
    Ok(())
}

/// The children a node keeps its data in, which it writes when writable.
fn stored_in(node: &Node) -> impl Iterator<Item = Node> {
    node.children().into_iter().filter(|(role, _)| matches!(*role, "file" | "data-file")).map(|(_, child)| child)
}

/// Changes `node` alone, if it is not as asked already, noting it in `done`.
fn change(node: &Node, read_only: bool, done: &mut Vec<Node>) -> Result<(), String> {
    if node.read_only() != read_only {
        node.set_read_only(read_only).map_err(|e| refusal(&**node, &e))?;
        done.push(node.clone());
    }
    Ok(())
}

/// Puts back `node`, which was made `read_only`.
fn put_back(node: &Node, read_only: bool) {
    if let Err(e) = node.set_read_only(!read_only) {
        log::error!("node '{}' could not be put back as it was: {e}", node.name());
    }
}

/// A driver's refusal, in QEMU's words where QEMU has some.
fn refusal(node: &dyn BlockNode, e: &io::Error) -> String {
    match e.get_ref().and_then(|inner| inner.downcast_ref::<LockError>()) {
        Some(e) => e.qmp_text(),
        None => match (node.filename(), e.raw_os_error()) {
            (Some(file), Some(errno)) => format!("Could not open '{file}': {}", vsd_job::strerror(errno)),
            _ => e.to_string(),
        },
    }
}

fn generic(text: impl Into<String>) -> QmpError {
    QmpError::generic(text)
}

/// One entry of a `blockdev-reopen`: a node, whether it is to be
/// read-only, its options as given and as it was added with.
struct Entry {
    node: Node,
    read_only: bool,
    given: OptionMap,
    added: OptionMap,
}

impl Daemon {
    /// QMP `blockdev-reopen`: `{"options": [NODE OPTIONS, ...]}`, each as
    /// `blockdev-add` takes them, naming an existing node by `node-name`.
    pub(crate) fn blockdev_reopen(&self, args: &Value) -> Result<Value, QmpError> {
        // QEMU's order: the arguments' shape, the nodes, their options,
        // then what their users need.
        let given = entries(args)?;
        let mut guard = self.state();
        let state = &mut *guard;
        let entries = given.into_iter().map(|options| entry(state, options)).collect::<Result<Vec<_>, _>>()?;
        // QEMU checks each entry whole, its backing before its other options.
        let mut backings = Backings::default();
        for (at, entry) in entries.iter().enumerate() {
            let (mut added, mut given) = (entry.added.clone(), entry.given.clone());
            backing_given(&entry.node, &given)?;
            if let Some(name) = given.get("backing") {
                self.plan_backing(state, &mut backings, &entry.node, name)?;
            }
            same_children(at, &entry.node, &mut added, &mut given)?;
            unchanged(&entry.node, added, given)?;
        }
        let targets = self.targets(state, &entries)?;
        let changed = apply(&targets).map_err(generic)?;
        if let Err(e) = replace_backings(state, &backings) {
            for node in changed.iter().rev() {
                put_back(node, node.read_only());
            }
            return Err(generic(e));
        }
        for node in &changed {
            // Their queues were opened on the node as it was.
            if let Err(e) = switch_exports(state, node.name(), Some(node), None) {
                log::warn!("the exports of node '{}' go on with the queues they had: {e}", node.name());
            }
        }
        Ok(json!({}))
    }

    /// Checks node `name` (or none, `null`) as the new backing node of
    /// `node`, as QEMU does and then as vsd needs, and notes it in
    /// `backings`.
    fn plan_backing(&self, state: &State, backings: &mut Backings, node: &Node, name: &str) -> Result<(), QmpError> {
        let new = match name {
            "null" => None,
            _ => Some(
                state
                    .graph
                    .get(name)
                    .ok_or_else(|| generic(format!("Cannot find device='' nor node-name='{name}'")))?,
            ),
        };
        if let Some(new) = &new
            && backings.reaches(new, node.name())
        {
            let (new, node) = (new.name(), node.name());
            return Err(generic(format!("Making '{new}' a backing child of '{node}' would create a cycle")));
        }
        let old = backings.of(node);
        if name_of(&old) != name_of(&new) {
            if let Some(old) = &old {
                self.held_by_job(node, old)?;
            }
            if let Some(new) = new.as_ref().filter(|new| !new.active() && node.active()) {
                let refusal =
                    InactiveChild { child: new.name().into(), role: "backing".into(), parent: node.name().into() };
                return Err(generic(refusal.to_string()));
            }
            self.read_through(state, node)?;
        }
        backings.0.push((node.clone(), new));
        Ok(())
    }

    /// Refuses to change `node`'s link to its backing node `old` where a
    /// job holds it, in QEMU's words: QEMU puts a filter of its own over
    /// the top of a stream or a commit, and freezes the links they go down.
    fn held_by_job(&self, node: &Node, old: &Node) -> Result<(), QmpError> {
        let top = |kind: &str, place: usize| (kind == "stream" && place == 0) || (kind == "commit" && place == 1);
        if self.jobs.users_of(old.name()).iter().any(|(job, place)| top(job.kind(), *place)) {
            return Err(generic(format!("Cannot replace implicit backing child of {}", node.name())));
        }
        let goes_down = |kind: &str, place: usize| kind == "stream" || (kind == "commit" && place > 0);
        if self.jobs.users_of(node.name()).iter().any(|(job, place)| goes_down(job.kind(), *place)) {
            let (node, old) = (node.name(), old.name());
            return Err(generic(format!("Cannot change frozen 'backing' link from '{node}' to '{old}'")));
        }
        Ok(())
    }

    /// Refuses a new backing node for `node` where vsd could not make every
    /// reader see it at once: while it is inactive, used by a job (which
    /// reads through queues of its own), or read through a node above it
    /// that an export or a job uses (their queues open on that node).
    fn read_through(&self, state: &State, node: &Node) -> Result<(), QmpError> {
        let name = node.name();
        if !node.active() {
            return Err(generic(format!("Node '{name}' is inactive: vsd reopens only active nodes")));
        }
        if let Some((job, _)) = self.jobs.user_of(name) {
            let id = job.id();
            return Err(generic(format!("Node '{name}' is used by job '{id}': vsd changes its backing only unused")));
        }
        let above = |parent: &&Node| parent.name() != name && Backings::default().reaches(parent, name);
        let used = |parent: &Node| {
            self.jobs.user_of(parent.name()).is_some()
                || state.exports.values().any(|e| e.node().name() == parent.name())
        };
        match state.graph.nodes().filter(above).find(|parent| used(parent)) {
            Some(parent) => Err(generic(format!(
                "Node '{name}' is read through node '{}', which is in use: vsd changes its backing only \
                 where nothing uses it through another node",
                parent.name()
            ))),
            None => Ok(()),
        }
    }

    /// What the nodes reopened are to become ([`wanted`]), once every
    /// user of theirs is found to go along with it.
    fn targets(&self, state: &State, entries: &[Entry]) -> Result<Vec<(Node, bool)>, QmpError> {
        let targets = wanted(&state.graph, entries);
        let target = |name: &str| targets.iter().find(|(node, _)| node.name() == name).map(|(_, target)| *target);
        let read_only = |node: &dyn BlockNode| target(node.name()).unwrap_or_else(|| node.read_only());
        // Parents first, as QEMU finds the user that refuses.
        for (node, target) in targets.iter().rev() {
            if node.read_only() != *target && !node.active() {
                return Err(generic(format!("Node '{}' is inactive: vsd reopens only active nodes", node.name())));
            }
            if *target && self.written(state, &**node, &read_only) {
                return Err(generic(format!("Read-only block node '{}' cannot support read-write users", node.name())));
            }
            if !*target && writes_children(&**node) && stored_in(node).any(|child| read_only(&*child)) {
                return Err(generic("Block node is read-only"));
            }
        }
        Ok(targets)
    }

    /// Whether something writes `node` once every node is as `read_only`
    /// says: a writable export, a job's target, or a parent that writes it
    /// (a writable format, or a filter that is itself written).
    fn written(&self, state: &State, node: &dyn BlockNode, read_only: &dyn Fn(&dyn BlockNode) -> bool) -> bool {
        let name = node.name();
        let writes = |parent: &Node| {
            let child = |(role, child): &(&str, Node)| *role != "backing" && child.name() == name;
            parent.children().iter().any(child)
                && match writes_children(&**parent) {
                    true => !read_only(&**parent),
                    false => self.written(state, &**parent, read_only),
                }
        };
        state.exports.values().any(|e| e.writable() && e.node().name() == name)
            || state.stopping.values().any(|(stopping, _)| stopping == name)
            || self.jobs.users_of(name).iter().any(|(_, place)| *place == 0)
            || state.graph.nodes().any(writes)
    }
}

/// What each node reopened is to become, in the graph's order (children
/// first): as the last entry naming it says, or, for a child defined
/// inline without a name (`#block<n>`), as its parent: QEMU reopens such
/// children with their parent, whose `read-only` they inherit.
fn wanted(graph: &BlockGraph, entries: &[Entry]) -> Vec<(Node, bool)> {
    let mut targets: Vec<(Node, bool)> = Vec::new();
    // Parents were added after their children: these come first.
    let nodes: Vec<&Node> = graph.nodes().collect();
    for node in nodes.into_iter().rev() {
        let named = entries.iter().rev().find(|e| e.node.name() == node.name()).map(|e| e.read_only);
        let parent = || targets.iter().find(|(parent, _)| stored_in(parent).any(|child| child.name() == node.name()));
        let inherited = || parent().filter(|_| node.name().starts_with('#')).map(|(_, target)| *target);
        if let Some(target) = named.or_else(inherited) {
            targets.push((node.clone(), target));
        }
    }
    targets.reverse();
    targets
}

/// Whether a node writes its children whenever it is writable (a format
/// keeping metadata there), rather than passing its users' writes on.
fn writes_children(node: &dyn BlockNode) -> bool {
    node.driver() == "qcow2"
}

/// Changes the nodes of `targets` (in the graph's order) that are not as
/// asked: those going read-only parents first, then those going writable
/// children first. Returns them; on a failure, undoes what was done.
fn apply(targets: &[(Node, bool)]) -> Result<Vec<Node>, String> {
    let going = |read_only: bool| targets.iter().filter(move |(n, t)| *t == read_only && n.read_only() != *t);
    let order: Vec<(Node, bool)> = going(true).rev().chain(going(false)).cloned().collect();
    let mut done: Vec<(Node, bool)> = Vec::new();
    for (node, read_only) in order {
        if let Err(e) = node.set_read_only(read_only) {
            for (node, read_only) in done.iter().rev() {
                put_back(node, *read_only);
            }
            return Err(refusal(&*node, &e));
        }
        done.push((node, read_only));
    }
    Ok(done.into_iter().map(|(node, _)| node).collect())
}

/// The backing nodes the entries give (`None`: none), in their order.
#[derive(Default)]
struct Backings(Vec<(Node, Option<Node>)>);

impl Backings {
    /// `node`'s backing node once these are given.
    fn of(&self, node: &Node) -> Option<Node> {
        match self.0.iter().rev().find(|(n, _)| n.name() == node.name()) {
            Some((_, backing)) => backing.clone(),
            None => backing_of(node),
        }
    }

    /// Whether `from` is `target` or has it below, once these are given.
    fn reaches(&self, from: &Node, target: &str) -> bool {
        let mut children: Vec<Node> =
            from.children().into_iter().filter(|(role, _)| *role != "backing").map(|(_, child)| child).collect();
        children.extend(self.of(from));
        from.name() == target || children.iter().any(|child| self.reaches(child, target))
    }
}

fn name_of(node: &Option<Node>) -> Option<&str> {
    node.as_ref().map(|node| node.name())
}

/// Gives the nodes of `backings` their new backing nodes, in order; on a
/// failure, puts back those given before.
fn replace_backings(state: &mut State, backings: &Backings) -> Result<(), String> {
    let mut done: Vec<(&Node, Option<Node>)> = Vec::new();
    for (node, new) in &backings.0 {
        let old = backing_of(node);
        if name_of(&old) == name_of(new) {
            continue;
        }
        if let Err(e) = replace_backing(state, node, new) {
            for (node, old) in done.iter().rev() {
                if let Err(e) = replace_backing(state, node, old) {
                    log::error!("node '{}' could not be given its backing node back: {e}", node.name());
                }
            }
            return Err(e);
        }
        done.push((node, old));
    }
    Ok(())
}

/// Gives `node` backing node `backing` with its exports stopped at a
/// request boundary, then restarted on the node as it now is: their
/// queues read through the new backing node, none through the old.
fn replace_backing(state: &mut State, node: &Node, backing: &Option<Node>) -> Result<(), String> {
    let mut work = || node.replace_backing(backing.clone()).map_err(|e| e.to_string());
    switch_exports(state, node.name(), Some(node), Some(&mut work))
}

/// Whether the header of `node`'s image names a backing file, whatever
/// its backing node now is: QEMU then wants `backing` given again.
fn names_backing_file(node: &Node) -> bool {
    // A header lies in the image's first cluster, of 2 MiB at most.
    const MAX_CLUSTER: u64 = 2 << 20;
    let Some(path) = image_filename(node).filter(|_| node.driver() == "qcow2") else { return false };
    let header = std::fs::File::open(path).and_then(|file| {
        let len = file.metadata()?.len();
        let mut head = vec![0; len.min(MAX_CLUSTER) as usize];
        file.read_exact_at(&mut head, 0)?;
        Header::parse(&head, len).map_err(io::Error::other)
    });
    header.is_ok_and(|header| header.backing_file.is_some())
}

/// The entries of the arguments, checked as QEMU's schema checks them
/// (every entry before any node is looked at).
fn entries(args: &Value) -> Result<Vec<OptionMap>, QmpError> {
    let empty = Map::new();
    let args = args.as_object().unwrap_or(&empty);
    let list = match args.get("options") {
        None => return Err(generic("Parameter 'options' is missing")),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(generic("Invalid parameter type for 'options', expected: array")),
    };
    let entries = list.iter().enumerate().map(|(at, entry)| shaped(at, entry)).collect::<Result<Vec<_>, _>>()?;
    if let Some(key) = args.keys().find(|key| *key != "options") {
        return Err(generic(format!("Parameter '{key}' is unexpected")));
    }
    Ok(entries)
}

/// The formats whose options take a `backing` in QEMU's schema.
const COW_FORMATS: [&str; 4] = ["qcow", "qcow2", "qed", "vmdk"];

/// Entry `at`, if it has the members QEMU requires of every node's options,
/// of their types.
fn shaped(at: usize, entry: &Value) -> Result<OptionMap, QmpError> {
    let wrong_type = |member: String, expected: &str| {
        Err(generic(format!("Invalid parameter type for '{member}', expected: {expected}")))
    };
    let Value::Object(members) = entry else { return wrong_type(format!("options[{at}]"), "object") };
    if !members.contains_key("driver") {
        return Err(generic(format!("Parameter 'options[{at}].driver' is missing")));
    }
    for (name, expected) in [("driver", "string"), ("node-name", "string"), ("read-only", "boolean")] {
        let fits = |value: &Value| if expected == "string" { value.is_string() } else { value.is_boolean() };
        if members.get(name).is_some_and(|value| !fits(value)) {
            return wrong_type(format!("options[{at}].{name}"), expected);
        }
    }
    if let Some(backing) = members.get("backing") {
        if !COW_FORMATS.contains(&members["driver"].as_str().unwrap_or_default()) {
            return Err(generic(format!("Parameter 'options[{at}].backing' is unexpected")));
        }
        if !matches!(backing, Value::String(_) | Value::Null | Value::Object(_)) {
            // QEMU names an alternate's member without its path.
            return wrong_type("backing".into(), "BlockdevRefOrNull");
        }
    }
    OptionMap::parse("blockdev-reopen", &entry.to_string()).map_err(|e| generic(e.to_string()))
}

/// The node an entry names, and what it is to become.
fn entry(state: &State, given: OptionMap) -> Result<Entry, QmpError> {
    let name = given.get("node-name").ok_or_else(|| generic("node-name not specified"))?;
    let (Some(node), Some(added)) = (state.graph.get(name), state.graph.options(name)) else {
        return Err(generic(format!("Failed to find node with node-name='{name}'")));
    };
    let read_only = given.clone().take_bool("read-only").map_err(|e| generic(e.to_string()))?.unwrap_or(false);
    Ok(Entry { node, read_only, added: added.clone(), given })
}

/// Refuses an entry if it changes anything of `node` but `read-only`, its
/// children left out ([`same_children`]): `added` are the options the node
/// was added with, `given` the entry's.
fn unchanged(node: &Node, mut added: OptionMap, mut given: OptionMap) -> Result<(), QmpError> {
    same_state(node, &mut added, &mut given)?;
    for key in ["node-name", "read-only"] {
        added.remove(key);
        given.remove(key);
    }
    // QEMU looks for options left out before options changed.
    if let Some(key) = added.keys().into_iter().find(|key| !given.has(key)) {
        return Err(reset(&key));
    }
    match given.keys().into_iter().find(|key| !same(&added, &given, key)) {
        Some(key) => Err(changed(&key)),
        None => Ok(()),
    }
}

fn changed(key: &str) -> QmpError {
    generic(format!("Cannot change the option '{key}'"))
}

fn reset(key: &str) -> QmpError {
    generic(format!("Option '{key}' cannot be reset to its default value"))
}

/// Refuses an entry that leaves out `backing` for a node that has a backing
/// node, or whose header names a backing file: QEMU finds this one first,
/// as it gathers the nodes.
fn backing_given(node: &Node, given: &OptionMap) -> Result<(), QmpError> {
    let missing = !given.has("backing") && given.clone().take_group("backing").is_none();
    if missing && (backing_of(node).is_some() || names_backing_file(node)) {
        return Err(generic(format!("backing is missing for '{}'", node.name())));
    }
    Ok(())
}

/// The children an entry names must be the node's own, by name, but for
/// its backing node (which [`Daemon::plan_backing`] checks): vsd does not
/// replace a node's other children. Takes them out of both option sets.
fn same_children(at: usize, node: &Node, added: &mut OptionMap, given: &mut OptionMap) -> Result<(), QmpError> {
    let children = node.children();
    for role in CHILD_ROLES {
        added.remove(role);
        let current = children.iter().find(|(r, _)| *r == role).map(|(_, child)| child.name());
        if let Some(inline) = given.take_group(role) {
            let key = inline.keys().into_iter().next().unwrap_or_default();
            return Err(changed(&format!("{role}.{key}")));
        }
        match (given.take(role), current) {
            (None, None) => {}
            (None, Some(_)) if role == "file" => {
                return Err(generic(format!("Parameter 'options[{at}].file' is missing")));
            }
            (None, Some(_)) => return Err(reset(role)),
            (Some(name), None) if name == "null" => {}
            (Some(name), Some(current)) if name == current => {}
            (Some(_), _) if role == "backing" => {}
            (Some(_), _) => return Err(changed(role)),
        }
    }
    Ok(())
}

/// Options every node has, compared with what the node is now rather than
/// with what it was added with: its cache options (which inline children
/// inherit) and whether it is active (which `blockdev-set-active` changes).
/// Takes them out of both option sets.
fn same_state(node: &Node, added: &mut OptionMap, given: &mut OptionMap) -> Result<(), QmpError> {
    let cache = node.cache();
    for (key, now) in [("cache.direct", cache.direct), ("cache.no-flush", cache.no_flush)] {
        added.remove(key);
        match given.take_bool(key) {
            Ok(None) if now => return Err(reset(key)),
            Ok(None) => {}
            Ok(Some(value)) if value == now => {}
            _ => return Err(changed(key)),
        }
    }
    added.remove("active");
    match given.take_bool("active") {
        Ok(None) => Ok(()),
        Ok(Some(active)) if active == node.active() => Ok(()),
        _ => Err(changed("active")),
    }
}

/// Whether `key` has the same value in both sets: the same text, or the
/// same boolean or size however written (`on` and `true`, `1M` and
/// `1048576`).
fn same(added: &OptionMap, given: &OptionMap, key: &str) -> bool {
    fn parsed<T: PartialEq>(
        added: &OptionMap,
        given: &OptionMap,
        parse: impl Fn(&mut OptionMap) -> Result<Option<T>, OptionError>,
    ) -> bool {
        matches!((parse(&mut added.clone()), parse(&mut given.clone())), (Ok(Some(a)), Ok(Some(b))) if a == b)
    }
    added.get(key) == given.get(key)
        || parsed(added, given, |m| m.take_bool(key))
        || parsed(added, given, |m| m.take_size(key))
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::*;

    /// A new qcow2 image in a directory of its own, removed on drop.
    struct Image(PathBuf);

    impl Image {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("vsd-reopen-{name}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("disk.qcow2");
            let out = std::process::Command::new("qemu-img")
                .args(["create", "-q", "-f", "qcow2", path.to_str().unwrap(), "1M"])
                .output()
                .expect("qemu-img");
            assert!(out.status.success(), "{out:?}");
            Self(path)
        }
    }

    impl Drop for Image {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(self.0.parent().unwrap());
        }
    }

    /// A graph with qcow2 node `q` over file node `f` on `image`, both read-only.
    fn read_only_nodes(image: &Path) -> (BlockGraph, Node) {
        let mut graph = BlockGraph::new();
        let add = |graph: &mut BlockGraph, text: String| graph.add(OptionMap::parse("--blockdev", &text).unwrap());
        add(&mut graph, format!("driver=file,node-name=f,filename={},read-only=on", image.display())).unwrap();
        let q = add(&mut graph, "driver=qcow2,node-name=q,file=f,read-only=on".into()).unwrap();
        (graph, q)
    }

    fn read_only(graph: &BlockGraph) -> [bool; 2] {
        ["f", "q"].map(|name| graph.get(name).unwrap().read_only())
    }

    #[test]
    fn a_tree_becomes_writable_file_first_and_read_only_again() {
        let image = Image::new("tree");
        let (graph, q) = read_only_nodes(&image.0);
        set_read_only_tree(&q, false).unwrap();
        assert_eq!(read_only(&graph), [false, false]);
        set_read_only_tree(&q, true).unwrap();
        assert_eq!(read_only(&graph), [true, true]);
    }

    #[test]
    fn a_tree_refused_part_way_is_put_back() {
        let image = Image::new("refused");
        let (graph, q) = read_only_nodes(&image.0);
        // Another open of the image that refuses writers, as another process's.
        let (_other, _) = read_only_nodes(&image.0);
        assert_eq!(set_read_only_tree(&q, false).unwrap_err(), "Failed to get \"write\" lock");
        assert_eq!(read_only(&graph), [true, true], "the file was made writable, then put back");
    }
}
