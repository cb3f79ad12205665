//! The smallest P and D pair on kvflow's real connectors, over kv-testkit's in-memory
//! transport on a manual clock: `cargo run -p kv-demo --example pull_pair`. The engine code is
//! `pair/mod.rs`; `pull_pair_nixl` and `pull_pair_tcp` run the same over real sockets.

mod pair;

use std::collections::HashMap;
use std::time::Duration;

use kv_core::{AgentName, Handshake, Memory, PeerAddress, Region, Time, Transport};
use kv_testkit::{FakeHeap, FakeNetwork, InMemoryMemory, ManualClock, NetConfig, FAKE_MODEL};

struct Fake {
    clock: ManualClock,
    net: FakeNetwork,
    heaps: HashMap<String, FakeHeap>,
}

impl pair::Net for Fake {
    const MODEL: &'static str = FAKE_MODEL;

    fn now(&self) -> Time {
        self.clock.now()
    }

    fn memory(&mut self, engine: &str) -> Box<dyn Memory> {
        // Distinct bases, so that a swapped address would not go unnoticed.
        let heap = FakeHeap::with_base(0x1000_0000 * (self.heaps.len() as u64 + 1));
        self.heaps.insert(engine.to_owned(), heap.clone());
        Box::new(InMemoryMemory::new(heap))
    }

    fn transport(&mut self, offer: &Handshake, region: &Region) -> pair::Fallible<(Box<dyn Transport>, PeerAddress)> {
        let address = PeerAddress(offer.engine.as_str().to_owned());
        let heap = self.heaps[offer.engine.as_str()].clone();
        let agent = AgentName::new(offer.engine.clone(), offer.rank);
        let mut transport = self.net.transport(agent, address.clone(), heap, offer.clone())?;
        transport.register(region)?;
        Ok((Box::new(transport), address))
    }

    fn wait(&mut self, most: Duration) {
        self.clock.advance(most.min(Duration::from_millis(1)));
        self.net.settle();
    }
}

fn main() -> pair::Fallible<()> {
    let clock = ManualClock::default();
    let net = FakeNetwork::new(1, clock.clone(), NetConfig::default());
    pair::pull_pair(&mut Fake { clock, net, heaps: HashMap::new() })
}
