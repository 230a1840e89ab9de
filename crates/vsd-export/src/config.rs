//! `--export type=vhost-user-blk,...` options.

use vsd_block::options::{OptionError, OptionMap};
pub use vsd_nbd_proto::Address;

pub use vsd_virtio::MAX_QUEUE_SIZE;
/// Queues an export may offer.
pub const MAX_QUEUES: u16 = 64;

/// A vhost-user-blk export, as configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportConfig {
    /// `id=`: the export's name.
    pub id: String,
    /// `node-name=`: the block node it serves.
    pub node_name: String,
    /// `addr.*`: the listening socket, a path to bind (`type=unix`) or one
    /// passed (`type=fd`).
    pub addr: Address,
    /// `writable=`: whether the guest may write (default off, as in QEMU).
    pub writable: bool,
    /// `writethrough=`: every write is durable before it completes, and the
    /// guest sees no volatile write cache.
    pub writethrough: bool,
    /// `num-queues=`: virtqueues offered (default 1).
    pub num_queues: u16,
    /// `num-threads=`: worker threads serving the queues, 1 to
    /// `num_queues`; queue q is served by thread q % `num_threads` unless
    /// `queue_threads` says otherwise. By default one per queue, but no
    /// more than the CPUs vsd may run on.
    pub num_threads: u16,
    /// The I/O threads (`--object iothread`, shared with other exports)
    /// the worker threads are, by thread: one from `iothread=`, which
    /// serves every queue, or one per item of `iothread-vq-mapping`.
    /// Empty: the export's own threads.
    pub iothreads: Vec<String>,
    /// The thread serving each queue, where `iothread-vq-mapping` names
    /// the queues of each I/O thread; empty otherwise.
    pub queue_threads: Vec<u16>,
    /// `logical-block-size=`: 512 or 4096.
    pub logical_block_size: u32,
    /// `serial=`: what GET_ID answers (at most 20 bytes are sent).
    pub serial: String,
    /// `trace=`: time every request's stages (default on); off keeps only
    /// the counters.
    pub trace: bool,
    /// `poll-us=`: the longest a worker polls its ring and engine for more
    /// work before sleeping, in µs; the window adapts below it (0 = never
    /// poll).
    pub poll_us: u32,
    /// `call-batch-us=`: how long a worker may hold a guest notification
    /// while more of its requests are in flight, so that one interrupt
    /// covers several completions (RSD's call batching); 0 = never hold.
    pub call_batch_us: u32,
    /// `cpu-affinity=`: CPUs for the worker threads, `0-3` or `1:3`; thread
    /// t is pinned to the t-th (cycling). Empty: not pinned.
    pub cpu_affinity: Vec<usize>,
    /// `socket-mode=`: the socket file's permissions, in octal (default
    /// 0600: only the daemon's user may connect).
    pub socket_mode: u32,
    /// `socket-owner=`: the uid the socket file belongs to (a user name or
    /// number, resolved when the options are read); `None`: the daemon's.
    pub socket_owner: Option<u32>,
    /// `socket-group=`: the gid the socket file belongs to, as `socket_owner`.
    pub socket_group: Option<u32>,
    /// `allow-inactive=`: the node may be inactive (the destination of a
    /// live migration, before it takes the image over): the front-end may
    /// connect and set up its rings, whose requests wait until the node is
    /// activated. Without it, exporting an inactive node activates it and
    /// the node cannot be inactivated, as in QEMU.
    pub allow_inactive: bool,
}

/// QEMU's refusal of a TCP socket: vhost-user passes descriptors, which
/// only unix sockets carry.
pub(crate) const UNIX_OR_FD_ONLY: &str = "Only socket address types 'unix' and 'fd' are supported";

/// The default `poll-us`: Cloud Hypervisor's fixed window, here a ceiling.
pub const DEFAULT_POLL_US: u32 = 50;
/// The largest `poll-us` and `call-batch-us` accepted.
const MAX_WINDOW_US: u64 = 10_000;

impl ExportConfig {
    /// Reads the options of one `--export`.
    pub fn from_options(opts: &mut OptionMap) -> Result<Self, OptionError> {
        let kind = opts.require("type")?;
        if kind != "vhost-user-blk" {
            return Err(opts.invalid("type", kind, "vhost-user-blk"));
        }
        let id = opts.require("id")?;
        let node_name = opts.require("node-name")?;
        let addr = opts.take_address("addr")?;
        if let Address::Inet { .. } = addr {
            return Err(opts.rejected(UNIX_OR_FD_ONLY));
        }
        if let Address::Fd(_) = addr
            && let Some(key) = ["socket-mode", "socket-owner", "socket-group"].into_iter().find(|key| opts.has(key))
        {
            let why = format!("{key} cannot be set with addr.type=fd: vsd binds no socket file, its owner did");
            return Err(opts.rejected(why));
        }
        let writable = opts.take_bool("writable")?.unwrap_or(false);
        let writethrough = opts.take_bool("writethrough")?.unwrap_or(false);
        let num_queues = match opts.take_u64("num-queues")?.unwrap_or(1) {
            n @ 1..=64 => n as u16,
            n => return Err(opts.invalid("num-queues", n, &format!("a number from 1 to {MAX_QUEUES}"))),
        };
        let Shared { iothreads, queue_threads } = take_iothreads(opts, num_queues)?;
        if let Some(key) = ["num-threads", "cpu-affinity", "poll-us"].into_iter().find(|key| opts.has(key))
            && !iothreads.is_empty()
        {
            return Err(opts.rejected(format!(
                "{key} cannot be set with I/O threads (iothread or iothread-vq-mapping): each serves its \
                 queues on its own CPUs, polling as its poll-max-ns says"
            )));
        }
        let num_threads = match opts.take_u64("num-threads")? {
            None if !iothreads.is_empty() => iothreads.len() as u16,
            None => default_threads(num_queues),
            Some(n) if (1..=u64::from(num_queues)).contains(&n) => n as u16,
            Some(n) => {
                let expected = format!("a number from 1 to num-queues ({num_queues})");
                return Err(opts.invalid("num-threads", n, &expected));
            }
        };
        let logical_block_size = match opts.take_size("logical-block-size")?.unwrap_or(512) {
            n @ (512 | 4096) => n as u32,
            n => return Err(opts.invalid("logical-block-size", n, "512 or 4096")),
        };
        let serial = opts.take("serial").unwrap_or_default();
        let trace = opts.take_bool("trace")?.unwrap_or(true);
        let poll_us = take_window(opts, "poll-us", DEFAULT_POLL_US)?;
        let call_batch_us = take_window(opts, "call-batch-us", 0)?;
        let cpu_affinity = match opts.take("cpu-affinity") {
            Some(text) => vsd_sys::parse_cpu_list(&text, ':').map_err(|why| {
                opts.invalid("cpu-affinity", &text, &format!("a CPU list such as 0-3 or 1:3 ({why})"))
            })?,
            None => Vec::new(),
        };
        let socket_mode = match opts.take("socket-mode") {
            Some(text) => u32::from_str_radix(&text, 8)
                .ok()
                .filter(|mode| *mode <= 0o777)
                .ok_or_else(|| opts.invalid("socket-mode", &text, "permissions in octal, such as 0660"))?,
            None => 0o600,
        };
        let socket_owner = take_id(opts, "socket-owner", "a user name or uid", vsd_sys::user_by_name, |u| u.uid)?;
        let socket_group = take_id(opts, "socket-group", "a group name or gid", vsd_sys::group_by_name, |g| g)?;
        let allow_inactive = opts.take_bool("allow-inactive")?.unwrap_or(false);
        Ok(Self {
            id,
            node_name,
            addr,
            writable,
            writethrough,
            num_queues,
            num_threads,
            iothreads,
            queue_threads,
            logical_block_size,
            serial,
            trace,
            poll_us,
            call_batch_us,
            cpu_affinity,
            socket_mode,
            socket_owner,
            socket_group,
            allow_inactive,
        })
    }
}

impl ExportConfig {
    /// The worker thread that serves queue `queue`.
    pub(crate) fn thread_of(&self, queue: u16) -> u16 {
        match self.queue_threads.get(usize::from(queue)) {
            Some(&thread) => thread,
            None => queue % self.num_threads,
        }
    }

    /// The CPU thread `thread` is pinned to, if `cpu-affinity` was given.
    pub(crate) fn cpu_of(&self, thread: u16) -> Option<usize> {
        let cpus = &self.cpu_affinity;
        (!cpus.is_empty()).then(|| cpus[usize::from(thread) % cpus.len()])
    }
}

/// The I/O threads an export's queues run on, and which queue each serves.
struct Shared {
    iothreads: Vec<String>,
    queue_threads: Vec<u16>,
}

/// `iothread=ID`, or `iothread-vq-mapping`: a list of `{iothread, vqs}`
/// with QEMU's shape and rules (its virtio-blk device's property, checked
/// with its messages): either every item lists its queues, and each queue
/// is listed once, or none does, and the queues go round-robin.
fn take_iothreads(opts: &mut OptionMap, num_queues: u16) -> Result<Shared, OptionError> {
    let mapping = opts.take_groups("iothread-vq-mapping");
    let iothread = opts.take("iothread");
    if mapping.is_empty() {
        return Ok(Shared { iothreads: iothread.into_iter().collect(), queue_threads: Vec::new() });
    }
    if iothread.is_some() {
        return Err(opts.rejected("iothread and iothread-vq-mapping properties cannot be set at the same time"));
    }
    let mut iothreads: Vec<String> = Vec::new();
    let mut queue_threads = vec![u16::MAX; usize::from(num_queues)];
    let mut listed = None;
    for (thread, mut item) in mapping.into_iter().enumerate() {
        let name = item.require("iothread")?;
        if iothreads.contains(&name) {
            return Err(opts.rejected(format!("duplicate IOThread name \"{name}\" in iothread-vq-mapping")));
        }
        let vqs = item.take_values("vqs");
        if *listed.get_or_insert(!vqs.is_empty()) == vqs.is_empty() {
            return Err(
                opts.rejected("either all items in iothread-vq-mapping must have vqs or none of them must have it")
            );
        }
        for vq in vqs {
            let index = vq.parse::<u16>().map_err(|_| item.invalid("vqs", &vq, "a queue number"))?;
            match queue_threads.get_mut(usize::from(index)) {
                None => {
                    return Err(opts.rejected(format!(
                        "vq index {index} for IOThread \"{name}\" must be less than num_queues {num_queues} in \
                         iothread-vq-mapping"
                    )));
                }
                Some(slot) if *slot != u16::MAX => {
                    return Err(opts.rejected(format!(
                        "cannot assign vq {index} to IOThread \"{name}\" because it is already assigned"
                    )));
                }
                Some(slot) => *slot = thread as u16,
            }
        }
        item.finish()?;
        iothreads.push(name);
    }
    if listed == Some(false) {
        // Round-robin: queue q to thread q % the threads, as without a mapping.
        return Ok(Shared { iothreads, queue_threads: Vec::new() });
    }
    if let Some(queue) = queue_threads.iter().position(|&thread| thread == u16::MAX) {
        return Err(opts.rejected(format!("missing vq {queue} IOThread assignment in iothread-vq-mapping")));
    }
    Ok(Shared { iothreads, queue_threads })
}

/// One thread per queue, but no more than the CPUs vsd may run on: more
/// threads than CPUs only take turns, and each wake-up costs a switch.
fn default_threads(num_queues: u16) -> u16 {
    match vsd_sys::allowed_cpus() {
        Ok(cpus) => num_queues.min(cpus.len().clamp(1, usize::from(MAX_QUEUES)) as u16),
        Err(_) => num_queues,
    }
}

/// A user or group id given as a number or a name; a name is looked up now,
/// once, so that an unknown one is a mistake in the options.
fn take_id<T>(
    opts: &mut OptionMap,
    key: &str,
    expected: &str,
    lookup: fn(&str) -> std::io::Result<Option<T>>,
    id: fn(T) -> u32,
) -> Result<Option<u32>, OptionError> {
    let Some(text) = opts.take(key) else { return Ok(None) };
    // u32::MAX is -1, which chown takes as "leave unchanged".
    if let Ok(number) = text.parse::<u32>() {
        return match number {
            u32::MAX => Err(opts.invalid(key, &text, expected)),
            number => Ok(Some(number)),
        };
    }
    match lookup(&text) {
        Ok(Some(found)) => Ok(Some(id(found))),
        Ok(None) => Err(opts.invalid(key, &text, &format!("{expected} (no such name)"))),
        Err(e) => Err(opts.invalid(key, &text, &format!("{expected} (the lookup failed: {e})"))),
    }
}

/// A time window in µs, from 0 to [`MAX_WINDOW_US`].
fn take_window(opts: &mut OptionMap, key: &str, default: u32) -> Result<u32, OptionError> {
    match opts.take_u64(key)?.unwrap_or(u64::from(default)) {
        n @ 0..=MAX_WINDOW_US => Ok(n as u32),
        n => Err(opts.invalid(key, n, &format!("a number of µs from 0 to {MAX_WINDOW_US}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ExportConfig, OptionError> {
        let mut opts = OptionMap::parse("--export", text)?;
        let config = ExportConfig::from_options(&mut opts)?;
        opts.finish()?;
        Ok(config)
    }

    #[test]
    fn qsd_style_options() {
        let c = parse(
            "type=vhost-user-blk,id=e0,node-name=n,addr.type=unix,addr.path=/tmp/s,writable=on,num-queues=4,serial=abc",
        )
        .unwrap();
        assert_eq!(c.num_queues, 4);
        assert!(c.writable && !c.writethrough);
        assert_eq!(c.serial, "abc");
        assert_eq!(c.logical_block_size, 512);
    }

    #[test]
    fn bad_values_name_the_parameter() {
        let err = parse("type=vhost-user-blk,id=e,node-name=n,addr.type=unix,addr.path=/s,num-queues=0").unwrap_err();
        assert!(err.to_string().contains("num-queues"), "{err}");
        let err = parse("type=nbd,id=e,node-name=n").unwrap_err();
        assert!(err.to_string().contains("'nbd'"), "{err}");
        let err = parse("type=vhost-user-blk,id=e,node-name=n,addr.type=unix,addr.path=/s,logical-block-size=1000")
            .unwrap_err();
        assert!(err.to_string().contains("logical-block-size"), "{err}");
    }

    const BASE: &str = "type=vhost-user-blk,id=e,node-name=n,addr.type=unix,addr.path=/s";

    #[test]
    fn the_socket_is_a_path_or_passed_never_tcp() {
        let c = parse("type=vhost-user-blk,id=e,node-name=n,addr.type=fd,addr.str=e0").unwrap();
        assert_eq!(c.addr, Address::Fd("e0".into()));
        let err = |text: &str| parse(&format!("type=vhost-user-blk,id=e,node-name=n,{text}")).unwrap_err().to_string();
        assert!(err("addr.type=inet,addr.host=::,addr.port=1").contains("Only socket address types 'unix' and 'fd'"));
        assert!(err("addr.type=fd").contains("'addr.str' is missing"));
        assert!(
            err("addr.type=fd,addr.str=3,socket-mode=0660").contains("socket-mode cannot be set with addr.type=fd")
        );
    }

    #[test]
    fn num_threads_is_from_one_to_num_queues() {
        let c = parse(&format!("{BASE},num-queues=4,num-threads=2")).unwrap();
        assert_eq!((c.num_queues, c.num_threads), (4, 2));
        for bad in ["num-threads=0", "num-queues=4,num-threads=5", "num-threads=2"] {
            let err = parse(&format!("{BASE},{bad}")).unwrap_err().to_string();
            assert!(err.contains("num-threads") && err.contains("from 1 to num-queues"), "{bad}: {err}");
        }
    }

    #[test]
    fn num_threads_defaults_to_one_per_queue_up_to_the_cpus() {
        let cpus = vsd_sys::allowed_cpus().unwrap().len();
        for queues in [1u16, 2, 4, 64] {
            let c = parse(&format!("{BASE},num-queues={queues}")).unwrap();
            assert_eq!(usize::from(c.num_threads), usize::from(queues).min(cpus), "num-queues={queues}");
        }
    }

    #[test]
    fn queues_go_round_robin_to_threads_and_threads_to_cpus() {
        let c = parse(&format!("{BASE},num-queues=5,num-threads=2,cpu-affinity=3:1:2")).unwrap();
        let threads: Vec<u16> = (0..5).map(|q| c.thread_of(q)).collect();
        assert_eq!(threads, [0, 1, 0, 1, 0]);
        assert_eq!((c.cpu_of(0), c.cpu_of(1)), (Some(3), Some(1)));
        let c = parse(&format!("{BASE},num-queues=4,num-threads=4,cpu-affinity=0-1")).unwrap();
        let cpus: Vec<_> = (0..4).map(|t| c.cpu_of(t)).collect();
        assert_eq!(cpus, [Some(0), Some(1), Some(0), Some(1)], "cycling through the list");
        let c = parse(&format!("{BASE},num-queues=2,num-threads=2")).unwrap();
        assert_eq!(c.cpu_of(1), None, "not pinned without cpu-affinity");
    }

    #[test]
    fn iothread_vq_mapping_spreads_queues_round_robin_or_as_listed() {
        let mapping = "iothread-vq-mapping.0.iothread=a,iothread-vq-mapping.1.iothread=b";
        let c = parse(&format!("{BASE},num-queues=5,{mapping}")).unwrap();
        assert_eq!((c.iothreads.as_slice(), c.num_threads), (&["a".to_string(), "b".into()][..], 2));
        assert_eq!((0..5).map(|q| c.thread_of(q)).collect::<Vec<_>>(), [0, 1, 0, 1, 0]);
        let json = r#"{"type": "vhost-user-blk", "id": "e", "node-name": "n", "addr": {"type": "unix", "path": "/s"},
            "num-queues": 4, "iothread-vq-mapping": [{"iothread": "a", "vqs": [3, 0]}, {"iothread": "b", "vqs": [1, 2]}]}"#;
        let c = parse(json).unwrap();
        assert_eq!((0..4).map(|q| c.thread_of(q)).collect::<Vec<_>>(), [0, 1, 1, 0]);
        let c = parse(&format!("{BASE},num-queues=2,iothread=a")).unwrap();
        assert_eq!((c.iothreads.as_slice(), c.num_threads, c.thread_of(1)), (&["a".to_string()][..], 1, 0));
    }

    #[test]
    fn iothread_vq_mapping_mistakes_are_qemus_errors() {
        let item = |i: usize, name: &str, vqs: &[u16]| {
            let vqs = vqs.iter().enumerate().map(|(j, vq)| format!(",iothread-vq-mapping.{i}.vqs.{j}={vq}"));
            format!("iothread-vq-mapping.{i}.iothread={name}{}", vqs.collect::<String>())
        };
        let cases = [
            (
                format!("iothread=a,{}", item(0, "b", &[])),
                "iothread and iothread-vq-mapping properties cannot be set at the same time",
            ),
            (
                format!("{},{}", item(0, "a", &[0]), item(1, "a", &[1])),
                "duplicate IOThread name \"a\" in iothread-vq-mapping",
            ),
            (
                format!("{},{}", item(0, "a", &[0, 1]), item(1, "b", &[])),
                "either all items in iothread-vq-mapping must have vqs or none of them must have it",
            ),
            (
                item(0, "a", &[0, 1, 2]),
                "vq index 2 for IOThread \"a\" must be less than num_queues 2 in iothread-vq-mapping",
            ),
            (
                format!("{},{}", item(0, "a", &[0, 1]), item(1, "b", &[1])),
                "cannot assign vq 1 to IOThread \"b\" because it is already assigned",
            ),
            (item(0, "a", &[1]), "missing vq 0 IOThread assignment in iothread-vq-mapping"),
            (format!("{},num-threads=1", item(0, "a", &[])), "num-threads cannot be set with I/O threads"),
            ("iothread=a,poll-us=5".to_string(), "poll-us cannot be set with I/O threads"),
        ];
        for (options, expected) in cases {
            let err = parse(&format!("{BASE},num-queues=2,{options}")).unwrap_err().to_string();
            assert!(err.contains(expected), "{options}: {err}");
        }
        let err = parse(&format!("{BASE},iothread-vq-mapping.0.vqs.0=0")).unwrap_err().to_string();
        assert!(err.contains("'iothread' is missing"), "{err}");
    }

    #[test]
    fn socket_owner_and_group_take_names_or_numbers() {
        let base = "type=vhost-user-blk,id=e,node-name=n,addr.type=unix,addr.path=/s";
        let c = parse(&format!("{base},socket-owner=root,socket-group=42")).unwrap();
        assert_eq!((c.socket_owner, c.socket_group), (Some(0), Some(42)));
        let c = parse(base).unwrap();
        assert_eq!((c.socket_owner, c.socket_group), (None, None), "the daemon's own by default");
        let err = parse(&format!("{base},socket-owner=no-such-user-vsd")).unwrap_err().to_string();
        assert!(err.contains("socket-owner") && err.contains("no such name"), "{err}");
        let err = parse(&format!("{base},socket-group=no-such-group-vsd")).unwrap_err().to_string();
        assert!(err.contains("socket-group"), "{err}");
        assert!(parse(&format!("{base},socket-owner=4294967295")).is_err(), "-1 means no change to chown");
    }
}
