//! Making nodes read-only or writable: QMP `blockdev-reopen` as QEMU has
//! it, for the one option vsd changes (`read-only`: every other option is
//! given again as it is), and [`set_read_only_tree`] for a job that writes
//! into a read-only image (a commit into a backing file).
//!
//! A `blockdev-reopen` is all or nothing: every entry is checked before
//! any node changes, writable nodes change children first and read-only
//! ones parents first, and a failure part-way undoes what was done. The
//! exports of the nodes that changed then restart on them, so that their
//! queues see the node as it now is.

use std::io;
use std::sync::Arc;

use serde_json::{Map, Value, json};
use vsd_block::options::{OptionError, OptionMap};
use vsd_block::{BlockGraph, BlockNode, CHILD_ROLES, LockError};
use vsd_control::qmp::QmpError;

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
        // QMP's text leaves out the hint QEMU prints on its command line.
        Some(LockError::Held { perm, .. }) => format!("Failed to get \"{perm}\" lock"),
        Some(LockError::Shared { perm, .. }) => format!("Failed to get shared \"{perm}\" lock"),
        Some(LockError::Io { path, source }) => format!("cannot lock '{path}': {source}"),
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
        for (at, entry) in entries.iter().enumerate() {
            unchanged(at, &entry.node, entry.added.clone(), entry.given.clone())?;
        }
        let targets = self.targets(state, &entries)?;
        let changed = apply(&targets).map_err(generic)?;
        for node in &changed {
            // Their queues were opened on the node as it was.
            if let Err(e) = switch_exports(state, node.name(), Some(node), None) {
                log::warn!("the exports of node '{}' go on with the queues they had: {e}", node.name());
            }
        }
        Ok(json!({}))
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

/// Refuses entry `at` if it changes anything of `node` but `read-only`:
/// `added` are the options the node was added with, `given` the entry's.
fn unchanged(at: usize, node: &Node, mut added: OptionMap, mut given: OptionMap) -> Result<(), QmpError> {
    same_children(at, node, &mut added, &mut given)?;
    same_state(node, &mut added, &mut given)?;
    for key in ["node-name", "read-only"] {
        added.take(key);
        given.take(key);
    }
    // QEMU looks for options left out before options changed.
    if let Some(key) = keys(&added).into_iter().find(|key| !given.has(key)) {
        return Err(reset(&key));
    }
    match keys(&given).into_iter().find(|key| !same(&added, &given, key)) {
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

/// The children an entry names must be the node's own, by name: vsd does
/// not replace a node's children. Takes them out of both option sets.
fn same_children(at: usize, node: &Node, added: &mut OptionMap, given: &mut OptionMap) -> Result<(), QmpError> {
    let children = node.children();
    let has = |role: &str| children.iter().any(|(r, _)| *r == role);
    // QEMU finds this one first, as it gathers the nodes.
    if has("backing") && !given.has("backing") && given.clone().take_group("backing").is_none() {
        return Err(generic(format!("backing is missing for '{}'", node.name())));
    }
    for role in CHILD_ROLES {
        added.take(role);
        let current = children.iter().find(|(r, _)| *r == role).map(|(_, child)| child.name());
        if let Some(inline) = given.take_group(role) {
            let key = keys(&inline).into_iter().next().unwrap_or_default();
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
        added.take(key);
        match given.take_bool(key) {
            Ok(None) if now => return Err(reset(key)),
            Ok(None) => {}
            Ok(Some(value)) if value == now => {}
            _ => return Err(changed(key)),
        }
    }
    added.take("active");
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

/// The keys of `options`, in order: an option map shows them only as the
/// leftovers [`OptionMap::finish`] refuses.
fn keys(options: &OptionMap) -> Vec<String> {
    let mut rest = options.clone();
    let mut keys = Vec::new();
    while let Err(OptionError::Unknown { key, .. }) = rest.clone().finish() {
        rest.take(&key);
        keys.push(key);
    }
    keys
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
