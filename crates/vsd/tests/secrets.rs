//! Secrets encrypted as libvirt passes every RBD and LUKS key: a master key
//! secret read from a file, then each secret's AES-256-CBC ciphertext
//! (made here by openssl) with `keyid` and `iv`. vsd and
//! qemu-storage-daemon are given the same lines: both must take the good
//! ones and refuse each bad one in the same words.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::qmp::Qmp;
use common::{Daemon, Scratch, VSD, pattern};
use serde_json::{Value, json};

const QSD: &str = "qemu-storage-daemon";

/// The master key (libvirt's `masterKey0`, 32 bytes in a file) and an IV.
struct Keys {
    dir: Scratch,
    key: Vec<u8>,
    iv: Vec<u8>,
}

impl Keys {
    fn new(name: &str) -> Self {
        let keys = Self { dir: Scratch::new(name), key: pattern(1, 32), iv: pattern(2, 16) };
        std::fs::write(keys.dir.path("master-key.aes"), &keys.key).unwrap();
        keys
    }

    /// `--object` for the master key, as libvirt writes it.
    fn master(&self) -> String {
        format!("secret,id=masterKey0,format=raw,file={}", self.dir.path("master-key.aes").display())
    }

    fn iv_base64(&self) -> String {
        base64(&self.iv)
    }

    /// `plaintext` encrypted with `key` by openssl, PKCS#7 padded unless
    /// `nopad` (then `plaintext` must be whole blocks).
    fn encrypt_with(&self, key: &[u8], plaintext: &[u8], nopad: bool) -> Vec<u8> {
        let (key, iv) = (hex(key), hex(&self.iv));
        let mut args = vec!["enc", "-aes-256-cbc", "-K", &key, "-iv", &iv];
        if nopad {
            args.push("-nopad");
        }
        openssl(&args, plaintext)
    }

    /// A secret `id` as libvirt writes it: `plaintext` encrypted with
    /// `masterKey0`, in base64.
    fn libvirt_secret(&self, id: &str, plaintext: &[u8]) -> String {
        let data = base64(&self.encrypt_with(&self.key, plaintext, false));
        format!("secret,id={id},data={data},keyid=masterKey0,iv={},format=base64", self.iv_base64())
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn base64(bytes: &[u8]) -> String {
    String::from_utf8(openssl(&["base64", "-A"], bytes)).unwrap()
}

/// What openssl writes for `args` with `input` on its standard input.
fn openssl(args: &[&str], input: &[u8]) -> Vec<u8> {
    let mut child =
        Command::new("openssl").args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("openssl runs");
    child.stdin.take().unwrap().write_all(input).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "openssl {args:?}");
    out.stdout
}

/// `--object` for each of `objects`.
fn object_args(objects: &[String]) -> Vec<String> {
    objects.iter().flat_map(|text| ["--object".to_string(), text.clone()]).collect()
}

/// What `program` says on stderr, without its name nor the option QSD
/// quotes, when it refuses `objects` (the last is the culprit) and exits 1.
fn refusal(program: &str, objects: &[String]) -> String {
    let mut child = Command::new(program)
        .args(object_args(objects))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    let deadline = Instant::now() + Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{program} took {objects:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).trim_end().to_string();
    assert_eq!(out.status.code(), Some(1), "{program}: {stderr}");
    let culprit = format!("--object {}: ", objects.last().unwrap());
    let name = std::path::Path::new(program).file_name().unwrap().to_string_lossy();
    let said = stderr.strip_prefix(&format!("{name}: ")).unwrap_or_else(|| panic!("{program}: {stderr}"));
    said.strip_prefix(&culprit).unwrap_or(said).to_string()
}

#[test]
fn mistakes_are_refused_in_qemus_words() {
    let keys = Keys::new("secrets-refused");
    let dir = &keys.dir;
    let short_key = dir.path("short-key.aes");
    std::fs::write(&short_key, &keys.key[..16]).unwrap();
    let nul = dir.path("nul.b64");
    std::fs::write(&nul, b"AAAA\0AAAA").unwrap();
    let good = keys.libvirt_secret("s", b"AQD9kltipjBfHhAArt2hXYn7bZP7Mbb+M6h6hw==");
    let ciphertext = good.split(',').find_map(|kv| kv.strip_prefix("data=")).unwrap().to_string();
    let iv = keys.iv_base64();
    // One block whose last byte, 17, is no padding count.
    let mut block = pattern(3, 16);
    block[15] = 17;
    let bad_padding = base64(&keys.encrypt_with(&keys.key, &block, true));
    let secret = |rest: &str| format!("secret,id=s,{rest}");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec![secret(&format!("data={ciphertext},keyid=nokey,iv={iv},format=base64"))], "No secret with id 'nokey'"),
        (
            vec!["iothread,id=io0".into(), secret(&format!("data={ciphertext},keyid=io0,iv={iv},format=base64"))],
            "is not a secret",
        ),
        (
            vec![
                format!("secret,id=masterKey0,format=raw,file={}", short_key.display()),
                good.replace("id=s,", "id=t,"),
            ],
            "Key should be 32 bytes",
        ),
        (vec![keys.master(), secret(&format!("data={ciphertext},keyid=masterKey0,format=base64"))], "IV is required"),
        (vec![keys.master(), good.replace(&iv, "not*base64")], "invalid characters"),
        (vec![keys.master(), good.replace(&iv, "AAAAAAAA")], "IV should be 16 bytes in length not 6"),
        (vec![keys.master(), good.replace(&iv, iv.trim_end_matches('='))], "not 15"),
        (vec![keys.master(), good.replace(&ciphertext, "not*base64")], "invalid characters"),
        (vec![keys.master(), secret(&format!("data=abc,keyid=masterKey0,iv={iv}"))], "Length 3 must be a multiple"),
        (vec![keys.master(), good.replace(&ciphertext, &bad_padding)], "Incorrect number of padding bytes (17)"),
        (vec![keys.master(), secret(&format!("file={},keyid=masterKey0,iv={iv},format=base64", nul.display()))], "NUL"),
        (vec![secret(&format!("file={},keyid=masterKey0", dir.path("missing").display()))], "Failed to open file"),
        (vec![secret(&format!("file={},keyid=masterKey0,iv={iv}", dir.0.display()))], "Is a directory"),
    ];
    for (objects, words) in cases {
        let qsd = refusal(QSD, &objects);
        assert!(qsd.contains(words), "QSD on {objects:?} should say {words:?}: {qsd}");
        assert_eq!(refusal(VSD, &objects), qsd, "{objects:?}");
    }
}

/// Secrets as libvirt starts a VM with them: base64 ciphertext, raw
/// ciphertext in a file, a plaintext of whole blocks (a block of padding),
/// an empty one, and a decrypted secret that is itself the key of another.
fn libvirt_objects(keys: &Keys) -> Vec<String> {
    let inner_key = pattern(4, 32);
    let raw = keys.dir.path("sec1.aes");
    std::fs::write(&raw, keys.encrypt_with(&keys.key, b"raw ciphertext", false)).unwrap();
    let inner = base64(&keys.encrypt_with(&inner_key, b"encrypted with a decrypted key", false));
    let iv = keys.iv_base64();
    vec![
        keys.master(),
        keys.libvirt_secret("sec0", b"AQD9kltipjBfHhAArt2hXYn7bZP7Mbb+M6h6hw=="),
        format!("secret,id=sec1,format=raw,file={},keyid=masterKey0,iv={iv}", raw.display()),
        keys.libvirt_secret("sec2", b"sixteen bytes!!!"),
        keys.libvirt_secret("sec3", b""),
        keys.libvirt_secret("innerKey", &inner_key),
        format!("secret,id=sec4,data={inner},keyid=innerKey,iv={iv},format=base64"),
        // An IV without a key is ignored.
        format!("secret,id=sec5,data=plain,iv={iv}"),
    ]
}

/// What a daemon answers to `object-add` of each of `objects` (given as
/// `--object` text) on its monitor.
fn object_add_answers(qmp: &mut Qmp, objects: &[String]) -> Vec<Value> {
    let as_json = |text: &String| {
        let pairs = text.split(',').skip(1).map(|kv| kv.split_once('=').unwrap());
        let mut args: serde_json::Map<String, Value> = pairs.map(|(k, v)| (k.into(), json!(v))).collect();
        args.insert("qom-type".into(), json!("secret"));
        Value::Object(args)
    };
    objects.iter().map(|text| qmp.answer("object-add", as_json(text))).collect()
}

#[test]
fn libvirt_lines_and_hotplugged_secrets_are_taken_as_by_qemu() {
    let keys = Keys::new("secrets-libvirt");
    let iv = keys.iv_base64();
    // Hot-plugged as libvirt adds a disk's secret, good and bad.
    let hotplugged = vec![
        keys.libvirt_secret("hot0", b"a key for a new disk"),
        keys.libvirt_secret("hot0", b"the same id again"),
        format!("secret,id=hot1,data=AAAA,keyid=nokey,iv={iv},format=base64"),
        format!("secret,id=hot2,data=AAAA,keyid=masterKey0,format=base64"),
        format!("secret,id=hot3,data=AAAA,keyid=masterKey0,iv={iv},format=base64"),
        keys.libvirt_secret("hot4", b"").replace(&iv, "AAAA"),
    ];
    let mut answers = Vec::new();
    for (program, start) in [(QSD, Daemon::qsd as fn(&Scratch, &[String]) -> Daemon), (VSD, Daemon::vsd)] {
        let monitor = keys.dir.path(&format!("{program}.qmp"));
        let mut args = object_args(&libvirt_objects(&keys));
        args.extend([
            "--chardev".into(),
            format!("socket,id=qmp0,path={},server=on,wait=off", monitor.display()),
            "--monitor".into(),
            "chardev=qmp0".into(),
        ]);
        let daemon = start(&keys.dir, &args);
        let mut qmp = Qmp::connect(&monitor);
        answers.push(object_add_answers(&mut qmp, &hotplugged));
        assert_eq!(qmp.answer("object-del", json!({"id": "hot0"})), json!({"return": {}}), "{program}");
        drop(qmp);
        assert!(daemon.stop().success(), "{program} stops cleanly");
    }
    assert_eq!(answers[0][0], json!({"return": {}}), "QSD takes a hot-plugged encrypted secret");
    assert!(answers[0][1..].iter().all(|a| a.get("error").is_some()), "QSD refuses the others: {:?}", answers[0]);
    assert_eq!(answers[1], answers[0], "vsd answers as QSD");
}
