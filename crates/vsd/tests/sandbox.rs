//! `--sandbox on`: every thread of the daemon confined (no new privileges,
//! no capabilities, the seccomp list), and a system call off the list
//! ending that daemon alone, with a line naming the call. That the list
//! covers what the daemon does is shown by the rest of the suite, whose
//! daemons all run sandboxed (tests/common).

mod common;

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Daemon, Scratch, VSD, file_export, pattern, run};
use vsd_bench::ClientOptions;

const MIB: u64 = 1 << 20;

/// A library that, preloaded into vsd, starts a thread which waits for
/// `$VSD_TEST_TRIGGER` to exist and then starts `/bin/true` (`execve`): a
/// call the daemon itself never makes, as an attacker's code in it would.
const EXEC_ON_TRIGGER: &str = r#"
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/syscall.h>

static void *watch(void *trigger) {
    /* The daemon's threads give up their capabilities before the sandbox
       starts (it refuses to start otherwise); this one, started before
       main, does so itself, unless the test wants to see that refusal. */
    if (!getenv("VSD_TEST_KEEP_CAPABILITIES")) {
        struct { unsigned version; int pid; } header = {0x20080522, 0};
        struct { unsigned effective, permitted, inheritable; } none[2] = {{0}};
        syscall(SYS_capset, &header, none);
    }
    while (access(trigger, F_OK) != 0)
        usleep(10000);
    char *argv[] = {"/bin/true", NULL};
    char *envp[] = {NULL};
    syscall(SYS_execve, "/bin/true", argv, envp);
    return NULL;
}

__attribute__((constructor)) static void start_watching(void) {
    char *trigger = getenv("VSD_TEST_TRIGGER");
    if (!trigger)
        return;
    pthread_t thread;
    pthread_create(&thread, NULL, watch, trigger);
    pthread_detach(thread);
}
"#;

fn build_shim(dir: &Scratch) -> PathBuf {
    let source = dir.path("exec-on-trigger.c");
    let library = dir.path("exec-on-trigger.so");
    std::fs::write(&source, EXEC_ON_TRIGGER).unwrap();
    let args = ["-shared", "-fPIC", "-o", library.to_str().unwrap(), source.to_str().unwrap(), "-lpthread"];
    let out = run("cc", &args);
    assert!(out.status.success(), "cc: {}", String::from_utf8_lossy(&out.stderr));
    library
}

/// vsd with the library preloaded and `env` set, its stderr in
/// `dir/NAME.err`, and the path that triggers the library's call.
fn spawn_with_shim(dir: &Scratch, name: &str, shim: &Path, args: &[String], env: &[(&str, &str)]) -> (Child, PathBuf) {
    let trigger = dir.path(&format!("{name}.trigger"));
    let child = Command::new(VSD)
        .args(args)
        .arg("--pidfile")
        .arg(dir.path(&format!("{name}.pid")))
        .env("LD_PRELOAD", shim)
        .env("VSD_TEST_TRIGGER", &trigger)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stderr(std::fs::File::create(dir.path(&format!("{name}.err"))).unwrap())
        .spawn()
        .unwrap();
    (child, trigger)
}

/// As [`spawn_with_shim`], once the daemon is ready.
fn start_with_shim(dir: &Scratch, name: &str, shim: &Path, args: &[String]) -> (Child, PathBuf) {
    let (mut child, trigger) = spawn_with_shim(dir, name, shim, args, &[]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !dir.path(&format!("{name}.pid")).exists() {
        assert!(child.try_wait().unwrap().is_none(), "{name} exited: {}", read(dir, &format!("{name}.err")));
        assert!(Instant::now() < deadline, "{name} did not become ready");
        std::thread::sleep(Duration::from_millis(10));
    }
    (child, trigger)
}

fn read(dir: &Scratch, name: &str) -> String {
    std::fs::read_to_string(dir.path(name)).unwrap_or_default()
}

fn wait_for_exit(child: &mut Child) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < deadline, "the daemon did not end");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn write_and_check(socket: &Path, seed: u64) {
    let mut client = vsd_bench::Client::connect(socket, ClientOptions::default()).unwrap();
    let mut queue = client.take_queue(0).unwrap();
    let data = pattern(seed, 256 * 1024);
    queue.write_at(MIB, &data).unwrap();
    queue.flush().unwrap();
    let mut back = vec![0u8; data.len()];
    queue.read_at(MIB, &mut back).unwrap();
    assert!(back == data, "what was written reads back");
}

#[test]
fn a_forbidden_call_ends_its_daemon_alone_and_says_which() {
    let dir = Scratch::new("sandbox-kill");
    let shim = build_shim(&dir);
    let (image_a, image_b) = (dir.image("a.img", 8 * MIB), dir.image("b.img", 8 * MIB));
    let (sock_a, sock_b) = (dir.path("a.sock"), dir.path("b.sock"));

    // Without the sandbox the call is made: the daemon becomes /bin/true.
    let plain = file_export(&image_a, &sock_a, "", ",writable=on");
    let (mut child, trigger) = start_with_shim(&dir, "plain", &shim, &plain);
    write_and_check(&sock_a, 1);
    std::fs::write(&trigger, b"").unwrap();
    let status = wait_for_exit(&mut child);
    assert_eq!(status.code(), Some(0), "the call ran, and /bin/true ended the process: {status}");

    // The sandbox starts only if no thread kept a capability: here the
    // library's thread, started before main, keeps root's.
    let _ = std::fs::remove_file(&sock_a);
    let sandboxed = common::sandboxed(&plain);
    let keep = [("VSD_TEST_KEEP_CAPABILITIES", "1")];
    let (mut child, _) = spawn_with_shim(&dir, "kept", &shim, &sandboxed, &keep);
    assert_eq!(wait_for_exit(&mut child).code(), Some(1));
    let said = read(&dir, "kept.err");
    assert!(said.contains("--sandbox: thread 'vsd' kept capabilities"), "{said}");
    assert!(!sock_a.exists(), "the refused daemon removed its socket");

    // With it, the same call ends that daemon, killed by SIGSYS, after a
    // line naming the call; a daemon beside it serves on.
    let (mut child, trigger) = start_with_shim(&dir, "sandboxed", &shim, &sandboxed);
    let beside = Daemon::vsd(&dir, &file_export(&image_b, &sock_b, "", ",writable=on"));
    write_and_check(&sock_a, 2);
    write_and_check(&sock_b, 3);
    std::fs::write(&trigger, b"").unwrap();
    let status = wait_for_exit(&mut child);
    assert_eq!(status.signal(), Some(libc::SIGSYS), "killed by SIGSYS: {status}");
    let said = read(&dir, "sandboxed.err");
    let line = format!("vsd: the sandbox stopped the daemon: it made system call {}", libc::SYS_execve);
    assert!(said.contains(&line), "{said}");
    write_and_check(&sock_b, 4);
    drop(beside);

    // What the killed daemon had flushed is in its image, which a new
    // daemon serves once the old one's locks are gone.
    common::wait_until_unlocked(&image_a);
    let mut back = vec![0u8; 256 * 1024];
    std::os::unix::fs::FileExt::read_exact_at(&std::fs::File::open(&image_a).unwrap(), &mut back, MIB).unwrap();
    assert!(back == pattern(2, back.len()), "the flushed write survived");
    let _ = std::fs::remove_file(&sock_a);
    let again = Daemon::vsd(&dir, &file_export(&image_a, &sock_a, "", ",writable=on"));
    write_and_check(&sock_a, 5);
    drop(again);
}

/// Each thread of `pid`: its name and the status fields the sandbox sets.
fn thread_confinement(pid: u32) -> Vec<(String, [String; 5])> {
    let mut threads = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let Ok(status) = std::fs::read_to_string(task.unwrap().path().join("status")) else { continue };
        let field = |key: &str| {
            status.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(':')).unwrap_or_default().trim().to_string()
        };
        let fields = ["NoNewPrivs", "Seccomp", "CapEff", "CapPrm", "CapAmb"].map(field);
        threads.push((field("Name"), fields));
    }
    threads
}

#[test]
fn every_thread_is_confined_and_serves() {
    let dir = Scratch::new("sandbox-threads");
    let image = dir.image("disk.img", 16 * MIB);
    let qmp = dir.path("qmp.sock");
    let mut args = file_export(&image, &dir.path("s.sock"), "", ",writable=on,num-queues=2");
    args.extend(["--nbd-server".into(), format!("addr.type=unix,addr.path={}", dir.path("nbd.sock").display())]);
    args.extend(["--chardev".into(), format!("socket,id=m,path={},server=on,wait=off", qmp.display())]);
    args.extend(["--monitor".into(), "chardev=m".into()]);
    let daemon = Daemon::vsd(&dir, &args);

    // Threads that start later (the queues' workers, a QMP connection's,
    // an NBD export's) are confined too.
    let mut client = daemon.connect(ClientOptions { num_queues: 2, ..Default::default() });
    let mut queues = [client.take_queue(0).unwrap(), client.take_queue(1).unwrap()];
    let mut qmp = vsd_control::client::QmpClient::connect(&qmp).unwrap();
    let export = serde_json::json!({"type": "nbd", "id": "n", "node-name": "disk0", "writable": true});
    qmp.execute("block-export-add", export).unwrap();
    let uri = format!("nbd+unix:///disk0?socket={}", dir.path("nbd.sock").display());
    let out = run("qemu-io", &["-f", "raw", "-c", "write -P 7 0 64k", &uri]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for (i, queue) in queues.iter_mut().enumerate() {
        let data = pattern(i as u64, 64 * 1024);
        queue.write_at(MIB * (i as u64 + 1), &data).unwrap();
        let mut back = vec![0u8; data.len()];
        queue.read_at(MIB * (i as u64 + 1), &mut back).unwrap();
        assert!(back == data);
    }

    let threads = thread_confinement(daemon.pid());
    assert!(threads.len() >= 5, "{threads:?}");
    for (name, [no_new_privs, seccomp, effective, permitted, ambient]) in &threads {
        assert_eq!(no_new_privs, "1", "thread {name}");
        assert_eq!(seccomp, "2", "thread {name} is filtered");
        for set in [effective, permitted, ambient] {
            assert_eq!(set.trim_start_matches('0'), "", "thread {name} holds no capability");
        }
    }
    drop(queues);
    drop(client);
    assert!(daemon.stop().success(), "a clean stop: sockets and pidfile removed under the sandbox");
    assert!(!dir.path("s.sock").exists() && !dir.path("nbd.sock").exists());
}

#[test]
fn the_sandbox_is_spelled_as_qemu_spells_it() {
    let dir = Scratch::new("sandbox-cli");
    let image = dir.image("disk.img", MIB);
    let export = file_export(&image, &dir.path("s.sock"), "", "");
    for (sandbox, said) in [
        ("on,spawn=allow", "--sandbox: spawn=allow is not vsd's: its sandbox always denies spawn"),
        ("on,bogus=1", "bogus"),
        ("maybe", "--sandbox"),
    ] {
        let mut args: Vec<&str> = export.iter().map(String::as_str).collect();
        args.extend(["--sandbox", sandbox]);
        let out = run(VSD, &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{sandbox}: {stderr}");
        assert!(stderr.contains(said), "{sandbox}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(!dir.path("s.sock").exists(), "nothing left behind");
    }
}
