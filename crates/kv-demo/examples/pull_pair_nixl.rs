//! The `pull_pair` engines over NIXL/UCX: two agents in this process, meeting over their TCP
//! side channels on loopback. `cargo run -p kv-demo --features nixl --example pull_pair_nixl`,
//! with `KVFLOW_NIXL_DIR` naming the runtime (`cargo xtask setup` fetches it and says where).

mod pair;

use kv_core::PeerAddress;
use kv_transport_nixl::{runtime, NixlConfig, NixlTransport};

fn main() -> pair::Fallible<()> {
    // Once, before the first transport: it loads the runtime.
    runtime::prepare(None)?;
    let config = NixlConfig { bind: "127.0.0.1:0".parse()?, ..NixlConfig::default() };
    pair::pull_pair(&mut pair::Sockets::new(|offer, clock| {
        let transport = NixlTransport::new(offer.clone(), &config, clock)?;
        let address = PeerAddress(transport.side_channel_addr().to_string());
        Ok((Box::new(transport), address))
    }))
}
