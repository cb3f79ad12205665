//! kv-core's Transport contract, kept by two NIXL agents over UCX in one process, and the UCX
//! settings an engine gives (the tests of this binary take turns, so no two pairs of agents
//! run at once).

mod common;

use std::time::Duration;

use kv_core::contract::{Side, TransportPair};
use kv_core::{PeerEvent, Region, Role, Transport};
use kv_transport_nixl::{runtime, NixlConfig, NixlTransport};

use common::{clock, next_event, nixl_or_skip, offer, serial, transport, HostPool};

/// D (A) connected to P (B), each with one host pool of one 128 KiB block registered.
struct NixlPair {
    a: NixlTransport,
    b: Option<NixlTransport>,
    pools: [HostPool; 2],
}

impl NixlPair {
    fn pool(&mut self, side: Side) -> &mut HostPool {
        &mut self.pools[side as usize]
    }
}

impl TransportPair for NixlPair {
    fn transport(&mut self, side: Side) -> &mut dyn Transport {
        match side {
            Side::A => &mut self.a,
            Side::B => self.b.as_mut().expect("B is killed only at the end"),
        }
    }

    fn region(&self, side: Side) -> Region {
        self.pools[side as usize].region()
    }

    fn write(&mut self, side: Side, offset: u64, bytes: &[u8]) {
        let at = offset as usize;
        self.pool(side).bytes[at..at + bytes.len()].copy_from_slice(bytes);
    }

    fn read(&mut self, side: Side, offset: u64, out: &mut [u8]) {
        // NIXL wrote these bytes behind the compiler's back: read them afresh.
        let bytes = std::hint::black_box(&self.pool(side).bytes);
        out.copy_from_slice(&bytes[offset as usize..offset as usize + out.len()]);
    }

    fn wait(&mut self) {
        std::thread::sleep(Duration::from_millis(1));
    }

    fn kill_b(&mut self) {
        self.b = None;
    }
}

/// A fresh pair, its agents named after `n`, the pair's number, so that no NIXL agent's name
/// comes back within the process.
fn connected_pair(n: u32) -> NixlPair {
    let pools = [HostPool::new(1), HostPool::new(1)];
    let mut b = transport(offer(&format!("contract{n}-p"), Role::Prefill, 1, 16, &pools[1], 1), &pools[1]);
    let mut a = transport(offer(&format!("contract{n}-d"), Role::Decode, 1, 16, &pools[0], 1), &pools[0]);
    a.connect(&kv_core::PeerAddress(format!("127.0.0.1:{}", b.side_channel_addr().port()))).unwrap();
    for t in [&mut a, &mut b] {
        let event = next_event(t, Duration::from_secs(10));
        assert!(matches!(event, Some(PeerEvent::Connected(_))), "{event:?}");
    }
    NixlPair { a, b: Some(b), pools }
}

#[test]
fn two_nixl_agents_keep_the_transport_contract() {
    if !nixl_or_skip("two_nixl_agents_keep_the_transport_contract") {
        return;
    }
    let _turn = serial();
    let mut made = 0;
    kv_core::contract::transport(&mut || {
        made += 1;
        Box::new(connected_pair(made))
    });
}

#[test]
fn ucx_settings_reach_ucx_as_backend_parameters_and_no_environment_is_set() {
    if !nixl_or_skip("ucx_settings_reach_ucx_as_backend_parameters_and_no_environment_is_set") {
        return;
    }
    let _turn = serial();
    runtime::prepare(None).expect("the NIXL runtime");
    let pool = HostPool::new(1);
    let with = |n: u32, ucx: &str| {
        let config = NixlConfig {
            bind: "127.0.0.1:0".parse().unwrap(),
            ucx_params: vec![("engine_config".to_owned(), ucx.to_owned())],
            ..NixlConfig::default()
        };
        NixlTransport::new(offer(&format!("settings{n}"), Role::Decode, 1, 16, &pool, 1), &config, clock())
    };
    // (UCX's own environment wins over the parameter: a UCX_TLS there would decide this.)
    if std::env::var_os("UCX_TLS").is_none() {
        let Err(refused) = with(0, "TLS=no_such_transport") else {
            panic!("UCX offered no transport, yet the backend started");
        };
        assert!(refused.to_string().contains("UCX backend"), "{refused}");
    }
    with(1, "TLS=tcp,self").expect("UCX with its TCP and self transports");
    with(2, "").expect("UCX with kvflow's settings alone");
    // The environment the process started with (the kernel keeps it) is the one it has.
    let started = std::fs::read("/proc/self/environ").expect("the environment the process started with");
    let mut started: Vec<Vec<u8>> = started.split(|b| *b == 0).filter(|v| !v.is_empty()).map(<[u8]>::to_vec).collect();
    let mut now: Vec<Vec<u8>> =
        std::env::vars_os().map(|(k, v)| [k.as_encoded_bytes(), b"=", v.as_encoded_bytes()].concat()).collect();
    started.sort();
    now.sort();
    assert!(started == now, "loading NIXL and making agents changed the process's environment");
}
