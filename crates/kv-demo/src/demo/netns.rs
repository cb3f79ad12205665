//! `--hosts netns`: each engine in a network namespace of its own, as if on a host of its own.
//!
//! The demo makes a bridge in the root namespace and, per engine, a namespace joined to it by a
//! veth pair, with an address of the test's own (`10.77.N.x/24`, N from the router's process
//! id); the engines bind their side channels (and TCP data listeners) to that address and UCX
//! is limited to TCP, so every byte crosses a real network stack. Everything made is removed
//! when the run ends, whether it passed or not; a namespace left by a killed router is
//! replaced by the next run of the same id.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::process::Command;

use anyhow::{bail, Context, Result};

/// One engine's namespace.
#[derive(Clone, Debug)]
pub(super) struct Host {
    /// The namespace's name, for `ip netns exec`.
    pub ns: String,
    /// The engine's address inside it.
    pub ip: Ipv4Addr,
    /// The namespace's end of the veth pair, for UCX_NET_DEVICES.
    pub device: String,
    /// The bridge's end of the veth pair.
    outside: String,
}

/// The bridge and the namespaces of one run; removed on drop.
pub(super) struct Network {
    bridge: String,
    gateway: Ipv4Addr,
    hosts: BTreeMap<String, Host>,
}

/// Runs `ip args...`; an error names the command and what `ip` said.
fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip").args(args).output().context("cannot run `ip` (iproute2) for --hosts netns")?;
    if !out.status.success() {
        bail!("`ip {}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

impl Network {
    /// A namespace per engine of `engines`, joined by a bridge. Needs root (CAP_NET_ADMIN).
    pub(super) fn create(engines: &[String]) -> Result<Network> {
        let id = std::process::id() % 200 + 20;
        let bridge = format!("kvbr{id}");
        let gateway = Ipv4Addr::new(10, 77, id as u8, 1);
        let mut network = Network { bridge: bridge.clone(), gateway, hosts: BTreeMap::new() };
        // Left over from a router of the same id that was killed.
        network.remove();
        for engine in engines {
            let _ = Command::new("ip").args(["netns", "delete", &format!("kvflow{id}-{engine}")]).output();
        }
        ip(&["link", "add", &bridge, "type", "bridge"])?;
        // A bridge takes the lowest MAC address of its ports unless it is given one: deleting
        // the port that had it (a cut) would change the gateway's address under every
        // namespace's ARP cache, and cut them all off the root namespace (etcd) for seconds.
        ip(&["link", "set", &bridge, "address", &format!("02:6b:76:00:00:{id:02x}")])?;
        ip(&["addr", "add", &format!("{gateway}/24"), "dev", &bridge])?;
        ip(&["link", "set", &bridge, "up"])?;
        for (i, engine) in engines.iter().enumerate() {
            let ns = format!("kvflow{id}-{engine}");
            let (outside, inside) = (format!("kv{id}h{i}"), format!("kv{id}n{i}"));
            let ip_addr = Ipv4Addr::new(10, 77, id as u8, 10 + i as u8);
            let host = Host { ns: ns.clone(), ip: ip_addr, device: inside.clone(), outside: outside.clone() };
            network.hosts.insert(engine.clone(), host.clone());
            ip(&["netns", "add", &ns])?;
            ip(&["link", "add", &outside, "type", "veth", "peer", "name", &inside])?;
            ip(&["link", "set", &inside, "netns", &ns])?;
            ip(&["link", "set", &outside, "master", &bridge, "up"])?;
            ip(&["-n", &ns, "addr", "add", &format!("{}/24", host.ip), "dev", &inside])?;
            ip(&["-n", &ns, "link", "set", &inside, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(network)
    }

    /// Engine `name`'s namespace.
    pub(super) fn host(&self, name: &str) -> Option<&Host> {
        self.hosts.get(name)
    }

    /// The bridge's address in the root namespace, which every engine reaches (the run's etcd
    /// listens there).
    pub(super) fn gateway(&self) -> Ipv4Addr {
        self.gateway
    }

    /// Cuts engine `name` off the network, as a host whose cable is pulled: its veth pair is
    /// deleted, so nothing it sends arrives and no FIN of its sockets reaches anyone.
    pub(super) fn cut(&self, name: &str) -> Result<()> {
        let Some(host) = self.hosts.get(name) else { bail!("no namespace for {name}") };
        ip(&["link", "delete", &host.outside])
    }

    fn remove(&mut self) {
        for host in self.hosts.values() {
            let _ = Command::new("ip").args(["netns", "delete", &host.ns]).output();
        }
        let _ = Command::new("ip").args(["link", "delete", &self.bridge]).output();
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        // Deleting a namespace deletes its end of each veth pair, and with it the other end.
        self.remove();
    }
}
