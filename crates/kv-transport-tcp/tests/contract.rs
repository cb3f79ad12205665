//! kv-core's Transport contract, on two TCP transports in this process over loopback.

mod common;

use std::time::Duration;

use common::{duo, Pool};
use kv_core::contract::{Side, TransportPair, CONTRACT_REGION_BYTES};
use kv_core::{Region, Transport};
use kv_transport_tcp::TcpTransport;

/// A is the decode agent (it posts), B the prefill agent it connected to.
struct TcpPair {
    a: TcpTransport,
    b: Option<TcpTransport>,
    a_pool: Pool,
    b_pool: Pool,
}

impl TcpPair {
    fn pool(&mut self, side: Side) -> &mut Pool {
        match side {
            Side::A => &mut self.a_pool,
            Side::B => &mut self.b_pool,
        }
    }
}

impl TransportPair for TcpPair {
    fn transport(&mut self, side: Side) -> &mut dyn Transport {
        match side {
            Side::A => &mut self.a,
            Side::B => self.b.as_mut().expect("B is asked for after it was killed"),
        }
    }

    fn region(&self, side: Side) -> Region {
        match side {
            Side::A => self.a_pool.region(),
            Side::B => self.b_pool.region(),
        }
    }

    fn write(&mut self, side: Side, offset: u64, bytes: &[u8]) {
        let at = offset as usize;
        self.pool(side).bytes_mut()[at..at + bytes.len()].copy_from_slice(bytes);
    }

    fn read(&mut self, side: Side, offset: u64, out: &mut [u8]) {
        let at = offset as usize;
        out.copy_from_slice(&self.pool(side).bytes()[at..at + out.len()]);
    }

    fn wait(&mut self) {
        std::thread::sleep(Duration::from_millis(1));
    }

    fn kill_b(&mut self) {
        self.b = None;
    }
}

#[test]
fn tcp_transports_keep_the_transport_contract() {
    kv_core::contract::transport(&mut || {
        let len = CONTRACT_REGION_BYTES as usize;
        let (b_pool, a_pool) = (Pool::new(1, len), Pool::new(2, len));
        let duo = duo(&b_pool, &a_pool);
        Box::new(TcpPair { a: duo.d, b: Some(duo.p), a_pool, b_pool })
    });
}
