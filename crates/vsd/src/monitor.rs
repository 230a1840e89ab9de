//! `--chardev` and `--monitor`, as qemu-storage-daemon takes them for its
//! QMP socket: `--chardev socket,id=ID,path=PATH,server=on,wait=off
//! --monitor chardev=ID`.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use vsd_block::options::OptionMap;

/// A listening socket a `--chardev` defines.
struct Chardev {
    id: String,
    path: PathBuf,
}

/// The QMP sockets to listen on, one per `--monitor`.
pub fn sockets(chardevs: &[String], monitors: &[String]) -> Result<Vec<PathBuf>> {
    let chardevs = chardevs.iter().map(|text| chardev(text)).collect::<Result<Vec<_>>>()?;
    let mut paths = Vec::new();
    for text in monitors {
        let mut opts = OptionMap::parse("--monitor", text)?;
        let id = opts.require("chardev")?;
        if let Some(mode) = opts.take_choice("mode", &["control", "readline"])?
            && mode != "control"
        {
            bail!("--monitor chardev={id}: vsd's monitor speaks QMP only (mode=control)");
        }
        if opts.take_bool("pretty")?.unwrap_or(false) {
            bail!("--monitor chardev={id}: pretty=on is not supported");
        }
        opts.finish()?;
        let chardev = chardevs
            .iter()
            .find(|c| c.id == id)
            .with_context(|| format!("--monitor chardev={id}: no --chardev with id={id}"))?;
        paths.push(chardev.path.clone());
    }
    Ok(paths)
}

fn chardev(text: &str) -> Result<Chardev> {
    let mut opts = OptionMap::parse_implied("--chardev", text, "backend")?;
    let backend = opts.require("backend")?;
    if backend != "socket" {
        return Err(opts.invalid("backend", backend, "socket").into());
    }
    let id = opts.require("id")?;
    let path = PathBuf::from(opts.require("path")?);
    if !opts.take_bool("server")?.unwrap_or(false) {
        bail!("--chardev id={id}: vsd's monitor listens for clients: give server=on");
    }
    if opts.take_bool("wait")?.unwrap_or(true) {
        bail!("--chardev id={id}: give wait=off (vsd does not wait for a monitor client before serving)");
    }
    opts.finish()?;
    Ok(Chardev { id, path })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn qsd_style_monitor_resolves_to_its_socket() {
        let chardevs = strings(&["socket,id=qmp0,path=/tmp/q.sock,server=on,wait=off"]);
        let paths = sockets(&chardevs, &strings(&["chardev=qmp0"])).unwrap();
        assert_eq!(paths, vec![PathBuf::from("/tmp/q.sock")]);
    }

    #[test]
    fn mistakes_are_named() {
        let err = |c: &[&str], m: &[&str]| sockets(&strings(c), &strings(m)).unwrap_err().to_string();
        assert!(err(&["socket,id=a,path=/p,server=on,wait=off"], &["chardev=b"]).contains("no --chardev with id=b"));
        assert!(err(&["socket,id=a,path=/p,wait=off"], &["chardev=a"]).contains("server=on"));
        assert!(err(&["socket,id=a,path=/p,server=on"], &["chardev=a"]).contains("wait=off"));
        assert!(err(&["file,id=a,path=/p"], &[]).contains("backend"));
        assert!(err(&["socket,id=a,path=/p,server=on,wait=off"], &["chardev=a,mode=readline"]).contains("QMP"));
    }
}
