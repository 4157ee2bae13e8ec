//! Machines made on this one for the tests that need several hosts: a network namespace with
//! one veth link to this namespace, each end with its own address on a private /24 made for
//! the test (`<net>.1` here, `<net>.2` there), deleted when dropped. Root and iproute2's `ip`
//! make them; [`Namespace::make`] says why when it cannot, so the test can say it skipped.

use std::process::{Command, Stdio};

/// `ip ARGS`, its stderr in the error.
pub fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A network namespace `onebit-<kind>-<pid>-<tag>` with one veth link to this one.
pub struct Namespace {
    pub name: String,
    /// Its end's address, `<net>.2`.
    pub address: String,
}

impl Namespace {
    /// Make it on `net` (three octets of a private range, such as `10.77.4`). `tag` is short
    /// (the link's names are `ob<pid><tag>h` and `...w`, at most 15 characters).
    pub fn make(kind: &str, tag: &str, net: &str) -> Result<Namespace, String> {
        let pid = std::process::id();
        let name = format!("onebit-{kind}-{pid}-{tag}");
        let here = format!("ob{}{tag}h", pid % 100000);
        let there = format!("ob{}{tag}w", pid % 100000);
        ip(&["netns", "add", &name])?;
        let ns = Namespace {
            name: name.clone(),
            address: format!("{net}.2"),
        };
        ip(&["link", "add", &here, "type", "veth", "peer", "name", &there])?;
        ip(&["link", "set", &there, "netns", &name])?;
        ip(&["addr", "add", &format!("{net}.1/24"), "dev", &here])?;
        ip(&["link", "set", &here, "up"])?;
        let inside = |args: &[&str]| {
            let mut all = vec!["netns", "exec", &name, "ip"];
            all.extend_from_slice(args);
            ip(&all)
        };
        inside(&["addr", "add", &format!("{}/24", ns.address), "dev", &there])?;
        inside(&["link", "set", &there, "up"])?;
        inside(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// `program` to be run inside (`ip netns exec NAME program`): the process keeps the pid
    /// `ip` had, since `ip` execs it.
    pub fn command(&self, program: &std::path::Path) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.name]).arg(program);
        command
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        // Deleting the namespace deletes its end of the veth pair, and with it ours.
        let _ = ip(&["netns", "del", &self.name]);
    }
}
